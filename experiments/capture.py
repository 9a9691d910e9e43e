"""Runs a target once and writes its boundary messages as a capture directory.

  python -m experiments.capture --config=configs/capture.py --workdir=OUT

A defense at the cut: --config.defense.name=<registered defense> and its public parameters
(--config.defense.<param>=VALUE); see configs/capture.py.

A bad input (a token file that is missing, empty, not [B, T] integers, out of the
vocabulary or longer than the model's positions; a cut outside 1..n_layer-1; a missing model;
an existing --workdir) is one line on stderr and exit status 1, with nothing written.
"""

from absl import flags, logging
from ml_collections import config_flags

from experiments import cli
from lla import runtime
from lla.capture import capture, runner
from lla.data.paths import DataNotFoundError
from lla.defenses import DefenseError
from lla.model import checkpoint, gguf_io, hf_io, loading

_CONFIG = config_flags.DEFINE_config_file("config", None, "Capture config.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Capture directory to write.", required=True)
# Inputs checked before anything is computed: one line on stderr, exit status 1, nothing
# written. Anything else is a bug and keeps its traceback.
_INPUT_ERRORS = (capture.CaptureInputError, DefenseError, checkpoint.CheckpointError,
                 hf_io.CheckpointError, gguf_io.GGUFError, DataNotFoundError,
                 loading.ModelLoadError)


def main(argv):
  del argv
  runtime.configure()
  with cli.one_line_errors(*_INPUT_ERRORS, prefix="capture"):
    sha = runner.capture_from_config(_CONFIG.value, _WORKDIR.value)
  logging.info("capture written to %s (manifest sha256 %s)", _WORKDIR.value, sha)
  print(f"capture: {_WORKDIR.value} manifest sha256 {sha}")


if __name__ == "__main__":
  cli.run(main)
