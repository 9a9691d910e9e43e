"""Replays registered attacks on a capture and writes predictions and records.

  python -m experiments.replay --config=configs/replay.py --config.capture_dir=CAP --workdir=RUN

The run directory is sealed (log sealed, manifest written) when the command ends, so
`experiments.verify` passes at once; replaying more attacks into it later reopens and
reseals it. A bad input (budget, calibration tokens, capture, attack name, a --workdir that
is not a run directory) is one line on stderr and a non-zero exit, with the run directory
untouched. One writer at a time: a replay started on a run directory another process is
writing is refused with one line naming it (pid, host, start time), or waits for it with
--lock_wait_s. An attack that crashed is
recorded as unmeasured, the others are kept, and the exit status is non-zero.

As one job across processes (each process runs the same command; the capture and the
attacker's weights must be readable at the same paths on every host; process 0 writes):

  python -m experiments.replay ... --coordinator_address=HOST0:PORT --num_processes=2 \
      --process_id=$RANK
"""

from absl import flags
from ml_collections import config_flags

from experiments import cli, distributed
from lla import dist, runtime
from lla.attacks import budget, registry
from lla.replay import driver as replay, runner as replay_runner
from lla.capture import store
from lla.model import checkpoint, gguf_io, hf_io, loading
from lla.evidence import rundir

_CONFIG = config_flags.DEFINE_config_file("config", None, "Replay config.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (resumed if it exists).",
                               required=True)
flags.mark_flag_as_required("config")
_LOCK_WAIT_S = flags.DEFINE_float(
    "lock_wait_s", 0.0, "Seconds to wait for another writer of --workdir to finish before "
    "refusing (0: refuse at once, naming it).", lower_bound=0.0)
# Inputs that can be checked before anything runs (an unknown attack name is a KeyError);
# anything else is a bug and keeps its trace.
_INPUT_ERRORS = (replay.ReplayInputError, budget.BudgetError, registry.IncompatibleCaptureError,
                 registry.PluginError, store.CaptureError, rundir.RunLockedError,
                 gguf_io.GGUFError, FileNotFoundError, KeyError, loading.ModelLoadError,
                 checkpoint.CheckpointError, hf_io.CheckpointError)


def main(argv):
  del argv
  distributed.initialize()  # Before anything touches a JAX backend.
  runtime.configure()
  if not dist.is_leader():
    with dist.following():
      replay.follow(_CONFIG.value.plugins)
    return
  with cli.one_line_errors(*_INPUT_ERRORS, workdir=_WORKDIR.value), dist.leading():
    records = replay_runner.replay_from_config(_CONFIG.value, _WORKDIR.value,
                                               _LOCK_WAIT_S.value)
  for record in records:
    print(f"{record.attack:24s} {record.status:8s} flops={record.flops} wall_s={record.wall_s}")
  crashed = [r.attack for r in records if r.status != "ok"]
  if crashed:
    raise SystemExit(f"{_WORKDIR.value}: {len(crashed)} attack(s) crashed (recorded as "
                     f"unmeasured, the rest kept): {', '.join(crashed)}")


if __name__ == "__main__":
  cli.run(main)
