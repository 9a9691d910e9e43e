r"""The active-server tier: FSHA and its mixed variant against split fine-tuning.

  python -m experiments.active_server --config=configs/active.py:cpu \
      --config.model.checkpoint=RUN/pretrain/checkpoint --workdir=runs/active

Writes WORKDIR/summary.json (recovery against hijacked steps, the client's task loss,
detection at fixed thresholds) and WORKDIR/report/active_server.md with its figures.
"""

from absl import app, flags, logging
from ml_collections import config_flags

from lla import runtime
from lla.active import report
from lla.active import run

_CONFIG = config_flags.DEFINE_config_file("config", "configs/active.py:cpu", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Experiment directory (resumable).",
                               required=True)


def main(argv):
  del argv
  runtime.configure()
  run.run(_CONFIG.value, _WORKDIR.value)
  path = report.write(_WORKDIR.value, f"{_WORKDIR.value}/report")
  logging.info("active-server report: %s", path)
  print(path)


if __name__ == "__main__":
  app.run(main)
