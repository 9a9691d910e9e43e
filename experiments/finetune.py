r"""Fine-tunes N seeded copies of a base GPT-2 (lla.train.finetune); finished seeds are reused.

  python experiments/finetune.py --config=configs/finetune.py --workdir=runs/finetune_embedded_k6_public

Writes WORKDIR/seed_{s}/{params,config.json,hf,metadata.json} per seed and WORKDIR/models.json.
"""

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from experiments import cli
from lla import runtime
from lla.model import checkpoint as checkpoint_lib, gguf_io, hf_io, loading
from lla.train import finetune

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/finetune.py", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (one checkpoint per seed).",
                               required=True)
# A base that cannot be loaded as named, or a cached seed of another base: one line.
_INPUT_ERRORS = (loading.ModelLoadError, checkpoint_lib.CheckpointError, hf_io.CheckpointError,
                 gguf_io.GGUFError, finetune.CheckpointMismatch)


def main(argv):
  del argv
  runtime.configure()
  with cli.one_line_errors(*_INPUT_ERRORS):
    checkpoints = finetune.finetune(_CONFIG.value, _WORKDIR.value)
  for checkpoint in checkpoints:
    logging.info("seed %d: %s sha256 %s held-out CE %.4f", checkpoint.metadata["seed"],
                 checkpoint.path, checkpoint.sha256, checkpoint.metadata["eval_after"]["ce"])


if __name__ == "__main__":
  app.run(main)
