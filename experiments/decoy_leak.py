r"""Decoy-row split experiment (PROTOCOL section 7); the logic is in `lla.decoy.run`.

  python experiments/decoy_leak.py --config=configs/decoy_leak.py:cpu --workdir=/tmp/decoy_leak
"""

from absl import flags, logging
from ml_collections import config_flags

from experiments import cli
from lla import runtime
from lla.decoy import report, run

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/decoy_leak.py[:cpu|tiny]",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (resumable per seed).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  runtime.configure()
  with cli.one_line_errors(workdir=_WORKDIR.value):  # lla's input errors: one line
    summary = run.run(_CONFIG.value, _WORKDIR.value)
  logging.info("\n%s", report.markdown(summary))


if __name__ == "__main__":
  cli.run(main)
