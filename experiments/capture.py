"""Runs a target once and writes its boundary messages as a capture directory.

  python -m experiments.capture --config=configs/capture.py --workdir=OUT

A defense at the cut: --config.defense.name=<registered defense> and its public parameters
(--config.defense.<param>=VALUE); see configs/capture.py.
"""

from absl import app, flags, logging
from ml_collections import config_flags

from lla import runtime
from lla.capture import runner
from lla.defenses import DefenseError

_CONFIG = config_flags.DEFINE_config_file("config", None, "Capture config.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Capture directory to write.", required=True)


def main(argv):
  del argv
  runtime.configure()
  try:
    sha = runner.capture_from_config(_CONFIG.value, _WORKDIR.value)
  except DefenseError as e:
    raise SystemExit(f"capture: {e}") from None
  logging.info("capture written to %s (manifest sha256 %s)", _WORKDIR.value, sha)
  print(f"capture: {_WORKDIR.value} manifest sha256 {sha}")


if __name__ == "__main__":
  app.run(main)
