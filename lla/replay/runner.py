"""Config-driven replay (experiments/replay.py)."""

from __future__ import annotations

import os

from absl import logging
import ml_collections

from lla.attacks import budget as budget_lib
from lla.attacks import memory, registry
from lla.replay import driver as replay
from lla import defenses
from lla.capture import store
from lla.capture.runner import load_tokens_npy
from lla.data import load as data_load
from lla.evidence import files, rundir
from lla.model import loading


def calibration_tokens(config: ml_collections.ConfigDict, model: loading.LoadedModel):
  """[N, T] int32: `config.tokens_npy`, else the calibration split cut by the attacker's
  model's own tokenizer (its BOS, if any, at position 0).

  Raises:
    ReplayInputError: an unreadable token file.
    loading.TokenizerPolicyError: a model without a tokenizer and no token file.
  """
  if config.tokens_npy:
    try:
      return load_tokens_npy(config.tokens_npy)
    except ValueError as e:
      raise replay.ReplayInputError(f"--config.calibration.tokens_npy: {e}") from None
  data = {k: v for k, v in config.to_dict().items() if k != "tokens_npy"}
  tokenizer = model.text_tokenizer("--config.calibration.tokens_npy=TOKENS.npy")
  return data_load.load_splits(**data, tokenizer=tokenizer).calibration.tokens


def check_bos_policy(capture_dir: str, calibration, tokenizer) -> None:
  """Refuses calibration documents whose BOS policy is not the capture's: every document
  starts with the capture's known prefix (E.C.known_prefix) and, for a capture without one,
  the attacker's tokenizer (None: GPT-2's, which has none) adds no BOS.

  Raises:
    ReplayInputError: one line naming the difference.
  """
  path = os.path.join(capture_dir, store.METADATA_FILE)
  if not os.path.isfile(path):
    raise store.CaptureError(f"{path}: no capture metadata")
  prefix = tuple(int(t) for t in files.read_json(path)["protocol"]["C"].get("known_prefix", ()))
  if prefix:
    differ = sum(tuple(int(t) for t in row[:len(prefix)]) != prefix for row in calibration)
    if differ:
      raise replay.ReplayInputError(
          f"capture {capture_dir} starts every document with BOS {list(prefix)}; {differ} "
          "calibration document(s) do not (calibrate with the capture's model's tokenizer, "
          "or token files that start with it)")
  elif tokenizer is not None and tokenizer.bos_id is not None:
    raise replay.ReplayInputError(
        f"capture {capture_dir} has no BOS; the attacker's tokenizer ({tokenizer.source}) "
        f"prepends BOS {tokenizer.bos_id} to every calibration document")


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


def calibration_defense(capture_dir: str, attacker_seed) -> dict | None:
  """The mechanism a defense-aware attacker mimics on its calibration: the capture's defense
  and its public parameters (those the defense declares), with the attacker's own seed; None
  without a seed."""
  if attacker_seed is None:
    return None
  path = os.path.join(capture_dir, store.METADATA_FILE)
  if not os.path.isfile(path):
    raise store.CaptureError(f"{path}: no capture metadata")
  target = files.read_json(path).get("protocol", {}).get("T", {})
  name = str(target.get("defense", "none"))
  if name == "none":
    raise replay.ReplayInputError(f"--config.calibration_defense_seed: capture {capture_dir} "
                                  "has no defense to mimic")
  declared = defenses.declared(name)
  params = {k: v for k, v in (target.get("defense_params") or {}).items() if k in declared}
  return {"name": name, "params": params, "attacker_seed": int(attacker_seed)}


def attack_names(text: str) -> list[str]:
  return [a.strip() for a in text.split(",") if a.strip()]


def replay_from_config(config: ml_collections.ConfigDict, workdir: str,
                       lock_wait_s: float = 0.0):
  """The replay of experiments/replay.py: a whole run, sealed when it ends; another writer
  holding `workdir` is waited for up to `lock_wait_s` seconds (lla.evidence.rundir.locked)."""
  if not config.capture_dir:
    raise replay.ReplayInputError("--config.capture_dir is required")
  replay.check_workdir(workdir, config.capture_dir)
  # Held from here (before the attacker loads): a second writer is refused (or waits) at
  # once, one line naming the holder.
  with rundir.locked(workdir, lock_wait_s, what="experiments.replay"):
    registry.load_plugins(config.plugins)
    budget = {**config.budget.to_dict(), **parse_assignments(config.plugin_budget)}
    model = loading.load_model(config.attacker)
    calibration = calibration_tokens(config.calibration, model)
    check_bos_policy(config.capture_dir, calibration,
                     None if config.calibration.tokens_npy else model.tokenizer)
    attacker = replay.Attacker(model.params, model.cfg, model.model_id, calibration,
                               config.knowledge, loading.source_of(config.attacker))
    chunk_budget, where = memory.chunk_budget_bytes(int(config.memory_budget_mb) << 20)
    logging.info("%s", memory.describe_replay(config.capture_dir, model.cfg,
                                              attack_names(config.attacks), budget, chunk_budget,
                                              where))
    return replay.replay(workdir, config.capture_dir, attacker, attack_names(config.attacks),
                         budget, int(config.seed), run_prefix=config.run_prefix,
                         reference_prefix=config.reference_prefix or None,
                         model_seed=int(config.model_seed), memory_budget_bytes=chunk_budget,
                         calibration_defense=calibration_defense(
                             config.capture_dir, config.get("calibration_defense_seed")),
                         seal=True, lock_wait_s=lock_wait_s, layer_form=config.layer_form)
