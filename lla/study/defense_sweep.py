"""Defenses in the main job: defended captures, linked references, utility cost, frontier.

Each defense configuration (name, parameter, strength) is applied to every public target at
the defense cut (one per model seed, the gate's independent seeds). The defended capture
stores what crossed the cut, h' and g' = dL/dh' (PROTOCOL section 1 with the defense in
the loop), and each attack's record links the undefended run of the same target and
attack as its positive control. The utility cost is the held-out cross-entropy under the
defense against the same weights undefended, with a bootstrap interval over documents.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from lla import defenses
from lla.attacks import replay
from lla.capture import capture, store
from lla.defenses import aware, training, utility
from lla.evidence import files

UTILITY_FILE = "defense_utility.json"


def secret_seed(name: str, strength, model_seed: int) -> int:
  """The defender's secret seed: derived, never recorded (only its hash is)."""
  digest = hashlib.sha256(f"lla-defense/{name}/{strength}/{model_seed}".encode()).digest()
  return int.from_bytes(digest[:8], "little")


def defended_messages(params, cfg, tokens: np.ndarray, cut: int, defense, batch_size: int):
  """(h', g') one training batch at a time; each batch draws fresh defense randomness."""
  hs, gs = [], []
  for step, start in enumerate(range(0, tokens.shape[0], batch_size)):
    batch = jnp.asarray(tokens[start:start + batch_size])
    key = defense.step_key(step) if defense.has_secret else None
    h, g = training.defended_messages(params, cfg, batch, cut, defense, key)
    hs.append(np.asarray(h, np.float32))
    gs.append(np.asarray(g, np.float32))
  return np.concatenate(hs), np.concatenate(gs)


def configurations(config) -> list[tuple[str, str, float]]:
  return [(name, param, strength) for name, param, strengths in config.defenses
          for strength in strengths]


def run(config, workdir: pathlib.Path, captures: pathlib.Path, study: pathlib.Path, targets,
        splits) -> dict:
  """Runs every defense configuration; returns {"label/m<seed>": utility cost}."""
  cut = int(config.defense_cut)
  public = [t for t in targets if t.cut == cut and t.knowledge == "public"]
  tokens = splits.evaluation.tokens[:int(config.defense_docs)]
  ids = splits.evaluation.document_ids[:int(config.defense_docs)]
  utility_path = workdir / UTILITY_FILE
  costs = files.read_json(str(utility_path)) if utility_path.exists() else {}
  jobs = [(c, t) for c in configurations(config) for t in public]
  for (name, param, strength), target in tqdm(jobs, desc="defenses", unit="capture"):
    label = f"{name}_{param}{strength}"
    secret = {"secret_seed": secret_seed(name, strength, target.model_seed)} if any(
        f.name == "secret_seed" for f in dataclasses.fields(defenses.get(name))) else {}
    defense = defenses.make(name, **{param: strength}, **secret)
    record = defense.to_record()
    directory = captures / f"def_{label}_m{target.model_seed}"
    store.reuse_or_write(directory, lambda d, t=target, dfn=defense, r=record: capture.capture_target(
        d, t.params, t.cfg, tokens, ids, cut, model_id=t.model_id, corpus=splits.corpus,
        split_hashes={n: p.sha256 for n, p in splits.items()}, training=True,
        messages=defended_messages(t.params, t.cfg, tokens, cut, dfn,
                                   int(config.capture_batch_size)),
        defense=name, defense_params={**r["params"], "strength": r["strength"],
                                      "label": label}))
    attacker = target.attacker(splits.calibration.tokens)
    for seed in config.attack_seeds:
      replay.replay(str(study), str(directory), attacker, list(config.defense_attacks),
                    config.budget, int(seed), run_prefix=f"def_{label}/m{target.model_seed}/s{seed}/",
                    reference_prefix=f"{target.name}/s{seed}/", model_seed=target.model_seed,
                    memory_budget_bytes=int(config.memory_budget_mb) << 20)
      mimic = {"name": name, "params": record["params"],
               "attacker_seed": secret_seed("attacker/" + name, strength, target.model_seed)}
      if config.defense_aware_attacks and aware.calibration_transform(**mimic) is not None:
        replay.replay(str(study), str(directory), attacker,
                      list(config.defense_aware_attacks), config.budget,
                      int(seed), run_prefix=f"def_{label}/m{target.model_seed}/s{seed}/",
                      reference_prefix=f"{target.name}/s{seed}/", model_seed=target.model_seed,
                      memory_budget_bytes=int(config.memory_budget_mb) << 20,
                      calibration_defense=mimic)
    key = f"{label}/m{target.model_seed}"
    if key not in costs:
      costs[key] = {"defense": name, "param": param, "strength": strength,
                    "model_seed": target.model_seed,
                    **utility.heldout_utility(target.params, target.cfg, tokens, cut, defense,
                                              jax.random.key(target.model_seed), n_boot=2000)}
      files.atomic_write_json(str(utility_path), costs, overwrite=True)
  return costs
