"""Capture the boundary messages of a target (lla.capture).

Run (embedded default target, WikiText-2 evaluation documents, k = 6):

  python -m experiments.capture --config=configs/capture.py --workdir=runs/capture_k6

A user's own model and tokens:

  python -m experiments.capture --config=configs/capture.py \
      --config.model.hf_dir=DIR --config.data.tokens_npy=TOKENS.npy --config.cut=6 --workdir=OUT

`arg` is the model preset of configs/models.py ("embedded", "tiny", "gpt2_124m").
"""

import ml_collections

from configs import models
from lla.data import load as data_load


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  # The target model: checkpoint / hf_dir / hub, first non-empty wins (hf_dir first).
  config.model = models.get_config(arg or "embedded")
  # The documents: the corpus splits of lla.data (evaluation split is captured) ...
  config.data = data_load.get_config()
  # ... or a user's own token ids, an .npy file of [B, T] integers (overrides the corpus).
  config.data.tokens_npy = ""
  config.cut = 6  # k: the client runs blocks 0..k-1.
  config.training = True  # Store the backward message g = dL/dh too (a training capture).
  config.batch_size = 32  # Documents per training batch; g is dL/dh of that batch's mean loss.
  config.session_id = ""  # Empty: derived from E and the tokens (deterministic).
  return config
