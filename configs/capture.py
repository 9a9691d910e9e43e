"""Capture the boundary messages of a target (lla.capture).

Run (embedded default target, WikiText-2 evaluation documents, k = 6):

  python -m experiments.capture --config=configs/capture.py --workdir=runs/capture_k6

A user's own model and tokens:

  python -m experiments.capture --config=configs/capture.py \
      --config.model.hf_dir=DIR --config.data.tokens_npy=TOKENS.npy --config.cut=6 --workdir=OUT

A defended capture (any registered defense of lla.defenses and its public parameters; the
secret is drawn from the OS unless --config.defense.secret_seed gives one, which the record
then marks as explicit):

  python -m experiments.capture --config=configs/capture.py --config.training=False \
      --config.defense.name=projection --config.defense.kind=haar --workdir=OUT

`arg` is the model preset of configs/models.py ("embedded", "tiny", "gpt2_124m").
"""

import ml_collections
from ml_collections import config_dict

from configs import models
from lla import defenses
from lla.data import load as data_load


def defense_config() -> ml_collections.ConfigDict:
  """`name` (a registered defense, or "none"), `secret_seed` (None: 128 bits from the OS) and
  every public parameter any registered defense declares (None: the defense's default);
  setting one its defense does not declare is refused, naming it."""
  config = ml_collections.ConfigDict()
  config.name = "none"  # A registered defense: lla.defenses.names().
  config.secret_seed = config_dict.placeholder(int)  # Explicit secret, for reproducibility.
  for name in defenses.names():
    for param, kind in defenses.declared(name).items():
      if param not in config:
        config[param] = config_dict.placeholder(kind)
  return config


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
  # The defense at the cut (messages as the defended client sends them); see defense_config.
  config.defense = defense_config()
  return config
