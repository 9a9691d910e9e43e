"""Pre-training of the embedded default model on WikiText-2 train.

  python experiments/pretrain.py --config=configs/pretrain.py --workdir=runs/pretrain_embedded

Variants (`--config=configs/pretrain.py:ARG`): `embedded` (default, ~20 min on 2 idle CPU
cores: 500 steps x 16 x 128 tokens ~ 1.0M tokens, about 0.43 epoch of WikiText-2 train, each
window seen at most once) and `tiny` (seconds; a smoke test of the whole pipeline).
The data directory comes from --config.data.data_dir or $LLA_DATA_DIR.
"""

import ml_collections

from configs import models
from lla import data


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  variant = arg or "embedded"
  tiny = variant == "tiny"
  config = ml_collections.ConfigDict()
  config.model = models.get_config(variant)  # Architecture (configs/models.py); random init.
  # The protocol's split draw (lla.data.get_config()): its passages in `exclude_splits` are cut
  # out of the pretraining stream so that the base never saw the fine-tuning/attacked documents.
  config.data = data.get_config()
  config.exclude_splits = ("training", "evaluation")
  config.seq_len = 64 if tiny else 128  # Pretraining window length (<= model.n_positions).
  config.batch_size = 8 if tiny else 16  # Windows per step.
  config.num_steps = 20 if tiny else 500  # Optimiser steps (the budget, see the docstring).
  config.seed = 0  # Init key and batch order.
  config.optimizer = ml_collections.ConfigDict()
  config.optimizer.lr = 3e-3  # Peak learning rate (small models take a high one).
  config.optimizer.warmup_steps = 2 if tiny else 50  # Linear warm-up from 0.
  config.optimizer.decay = "cosine"  # "cosine" or "linear" decay after warm-up.
  config.optimizer.end_lr_fraction = 0.1  # Final lr as a fraction of the peak.
  config.optimizer.b1 = 0.9  # AdamW first-moment decay.
  config.optimizer.b2 = 0.95  # AdamW second-moment decay (GPT-style short memory).
  config.optimizer.eps = 1e-8  # AdamW epsilon.
  config.optimizer.weight_decay = 0.1  # On Dense kernels only (not LN, biases, embeddings).
  config.optimizer.clip_norm = 1.0  # Global gradient-norm clip.
  config.eval_batch_size = 32  # Windows per held-out evaluation batch.
  # Held-out windows of WikiText-2 valid to evaluate (0 = all 2,020 of them).
  config.eval_windows = 64 if tiny else 0
  config.log_every = 5 if tiny else 25  # Steps between logged mean losses.
  config.export_hf = True  # Also write a HF save_pretrained directory (checkpoint/hf).
  return config
