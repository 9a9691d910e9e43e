r"""The active-server tier: FSHA and its mixed variant against split fine-tuning.

  python -m experiments.active_server --config=configs/active.py:cpu \
      --config.model.checkpoint=RUN/pretrain/checkpoint --workdir=runs/active

Writes WORKDIR/summary.json (recovery against hijacked steps, the client's task loss,
detection at fixed thresholds) and WORKDIR/report/active_server.md with its figures.

A checkpoint of any family: --config.model.hf_dir=DIR or --config.model.gguf=FILE. A model
or data that do not fit (a missing or damaged checkpoint, missing data, token ids beyond the
model's vocabulary) is one line on stderr and exit status 1.
"""

from absl import flags, logging
from ml_collections import config_flags

from experiments import cli
from lla import runtime
from lla.active import report
from lla.active import run
from lla.data.paths import DataNotFoundError
from lla.model import checkpoint, gguf_io, hf_io

_CONFIG = config_flags.DEFINE_config_file("config", "configs/active.py:cpu", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Experiment directory (resumable).",
                               required=True)


# The model and the data, checked before anything is trained: one line on stderr, exit 1.
_INPUT_ERRORS = (run.ActiveInputError, checkpoint.CheckpointError, hf_io.CheckpointError,
                 gguf_io.GGUFError, DataNotFoundError)


def main(argv):
  del argv
  runtime.configure()
  with cli.one_line_errors(*_INPUT_ERRORS, prefix="active_server", workdir=_WORKDIR.value):
    run.run(_CONFIG.value, _WORKDIR.value)
  path = report.write(_WORKDIR.value, f"{_WORKDIR.value}/report")
  logging.info("active-server report: %s", path)
  print(path)


if __name__ == "__main__":
  cli.run(main)
