"""The main job: one command from a fresh machine to the tables, figures and a verifiable run.

  python -m experiments.main_table --config=configs/main_table.py:cpu --workdir=runs/main

Killed at any point and started again with the same --workdir, it reuses every finished
artifact (verified by hash); on a finished run it re-renders the report.

As one job across processes (the same command on every process, a --workdir every host
reads at the same path): process 0 runs every phase and alone writes; the others take their
share of every attack's document chunks.

  python -m experiments.main_table ... --coordinator_address=HOST0:PORT --num_processes=2 \
      --process_id=$RANK
"""

from absl import flags
from ml_collections import config_flags

from experiments import cli, distributed
from lla import dist, runtime
from lla.capture import store
from lla.evidence import rundir
from lla.model import gguf_io, loading
from lla.replay import driver as replay
from lla.study import main_table
from lla.train import finetune

# An artifact of the workdir that this job cannot reuse (a capture or fine-tune made with
# another model, secret or config): one line naming what differs, no traceback.
# A --workdir another writer holds: one line naming the holder. A --workdir whose study
# another config or binary started, or that fails verification: one line saying so. A GGUF
# model that cannot be read, a tokenizer whose BOS policy the job cannot follow, a published
# model whose weights no directory names, a phase asked for more documents than the job
# draws: one line, before any write.
_REFUSALS = (store.CaptureError, finetune.CheckpointMismatch, rundir.RunLockedError,
             main_table.WorkdirMismatch, main_table.DocumentCountError, gguf_io.GGUFError,
             loading.ModelLoadError)

_CONFIG = config_flags.DEFINE_config_file("config", "configs/main_table.py:cpu",
                                          "Main-table config.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "runs/main", "Run directory (resumed if it exists).")


def main(argv):
  del argv
  distributed.initialize()  # Before anything touches a JAX backend.
  runtime.configure()
  if not dist.is_leader():
    with dist.following():
      replay.follow(_CONFIG.value.plugins)
    return
  # These and every other input error of lla (a plugin that does not import, a model
  # directory that does not exist: experiments.cli.INPUT_ERRORS), as one line; a workdir
  # made for the job and left empty is removed.
  with cli.one_line_errors(*_REFUSALS, workdir=_WORKDIR.value), dist.leading():
    report = main_table.run(_CONFIG.value, _WORKDIR.value)
  print(f"report: {report}")


if __name__ == "__main__":
  cli.run(main)
