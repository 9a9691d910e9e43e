r"""Pre-trains the embedded default GPT-2 (lla.train.pretrain); reuses a cached checkpoint.

  python experiments/pretrain.py --config=configs/pretrain.py --workdir=runs/pretrain_embedded

Writes WORKDIR/checkpoint/{params,config.json,hf,metadata.json}; the metadata holds the
params sha256 (the model's identity) and the WikiText-2 valid perplexity.
"""

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from lla import runtime
from lla.train import pretrain

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/pretrain.py", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoint cache).", required=True)


def main(argv):
  del argv
  runtime.configure()
  checkpoint = pretrain.pretrain(_CONFIG.value, _WORKDIR.value)
  valid = checkpoint.metadata["valid"]
  logging.info("checkpoint %s sha256 %s valid CE %.4f perplexity %.2f", checkpoint.path,
               checkpoint.sha256, valid["ce"], valid["perplexity"])


if __name__ == "__main__":
  app.run(main)
