"""Config-driven replay (experiments/replay.py)."""

from __future__ import annotations

import ml_collections

from lla.attacks import replay
from lla.capture.runner import load_tokens_npy
from lla.data import load as data_load
from lla.model.loading import load_model


def calibration_tokens(config: ml_collections.ConfigDict):
  if config.tokens_npy:
    return load_tokens_npy(config.tokens_npy)
  data = {k: v for k, v in config.to_dict().items() if k != "tokens_npy"}
  return data_load.load_splits(**data).calibration.tokens


def replay_from_config(config: ml_collections.ConfigDict, workdir: str):
  if not config.capture_dir:
    raise ValueError("--config.capture_dir is required")
  attacks = [a.strip() for a in config.attacks.split(",") if a.strip()]
  model = load_model(config.attacker)
  source = {k: config.attacker[k] for k in ("hf_dir", "checkpoint", "hub") if config.attacker[k]}
  attacker = replay.Attacker(model.params, model.cfg, model.model_id,
                             calibration_tokens(config.calibration), config.knowledge, source)
  return replay.replay(workdir, config.capture_dir, attacker, attacks, config.budget,
                       int(config.seed), run_prefix=config.run_prefix,
                       reference_prefix=config.reference_prefix or None, model_seed=int(config.model_seed),
                       memory_budget_bytes=int(config.memory_budget_mb) << 20)
