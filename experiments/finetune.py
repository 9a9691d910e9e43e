r"""Fine-tunes N seeded copies of a base GPT-2 (lla.train.finetune); finished seeds are reused.

  python experiments/finetune.py --config=configs/finetune.py --workdir=runs/finetune_embedded_k6_public

Writes WORKDIR/seed_{s}/{params,config.json,hf,metadata.json} per seed and WORKDIR/models.json.
"""

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from lla import runtime
from lla.train import finetune

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/finetune.py", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (one checkpoint per seed).",
                               required=True)


def main(argv):
  del argv
  runtime.configure()
  for checkpoint in finetune.finetune(_CONFIG.value, _WORKDIR.value):
    logging.info("seed %d: %s sha256 %s held-out CE %.4f", checkpoint.metadata["seed"],
                 checkpoint.path, checkpoint.sha256, checkpoint.metadata["eval_after"]["ce"])


if __name__ == "__main__":
  app.run(main)
