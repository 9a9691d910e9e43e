"""Config-driven replay (experiments/replay.py)."""

from __future__ import annotations

from absl import logging
import ml_collections

from lla.attacks import budget as budget_lib
from lla.attacks import memory, registry
from lla.replay import driver as replay
from lla.capture.runner import load_tokens_npy
from lla.data import load as data_load
from lla.model.loading import load_model


def calibration_tokens(config: ml_collections.ConfigDict):
  if config.tokens_npy:
    try:
      return load_tokens_npy(config.tokens_npy)
    except ValueError as e:
      raise replay.ReplayInputError(f"--config.calibration.tokens_npy: {e}") from None
  data = {k: v for k, v in config.to_dict().items() if k != "tokens_npy"}
  return data_load.load_splits(**data).calibration.tokens


def parse_assignments(text: str) -> dict:
  """'name=value,name2=value2' (plugin budget fields) -> {name: value}, typed by the
  field's declaration."""
  out = {}
  for item in (p.strip() for p in text.split(",") if p.strip()):
    name, sep, raw = item.partition("=")
    if not sep:
      raise budget_lib.BudgetError(f"plugin_budget entry {item!r} is not name=value")
    field = budget_lib.get(name.strip())
    raw = raw.strip()
    if field.kind is bool:
      if raw not in ("True", "False", "true", "false"):
        raise budget_lib.BudgetError(f"budget field {name}={raw!r}: expected True or False")
      out[field.name] = raw.lower() == "true"
    else:
      try:
        out[field.name] = field.kind(raw)
      except ValueError:
        raise budget_lib.BudgetError(f"budget field {name}={raw!r}: expected "
                                     f"{field.range_text()}") from None
  return out


def attack_names(text: str) -> list[str]:
  return [a.strip() for a in text.split(",") if a.strip()]


def replay_from_config(config: ml_collections.ConfigDict, workdir: str):
  """The replay of experiments/replay.py: a whole run, sealed when it ends."""
  if not config.capture_dir:
    raise replay.ReplayInputError("--config.capture_dir is required")
  registry.load_plugins(config.plugins)
  budget = {**config.budget.to_dict(), **parse_assignments(config.plugin_budget)}
  model = load_model(config.attacker)
  source = {k: config.attacker[k] for k in ("hf_dir", "checkpoint", "hub") if config.attacker[k]}
  attacker = replay.Attacker(model.params, model.cfg, model.model_id,
                             calibration_tokens(config.calibration), config.knowledge, source)
  chunk_budget, where = memory.chunk_budget_bytes(int(config.memory_budget_mb) << 20)
  logging.info("%s", memory.describe_replay(config.capture_dir, model.cfg,
                                            attack_names(config.attacks), budget, chunk_budget,
                                            where))
  return replay.replay(workdir, config.capture_dir, attacker, attack_names(config.attacks),
                       budget, int(config.seed), run_prefix=config.run_prefix,
                       reference_prefix=config.reference_prefix or None,
                       model_seed=int(config.model_seed), memory_budget_bytes=chunk_budget,
                       seal=True)
