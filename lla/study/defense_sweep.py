"""Defenses in the main job: defended captures, linked references, utility cost, frontier.

Each defense configuration (name, parameter, strength) is applied to every public target at
the defense cut (one per model seed, the gate's independent seeds); defenses named in
`config.defense_finetune` are first kept in the loop while that target is fine-tuned again
from the base (same seed and data), so that the server adapts. The defended capture
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
import ml_collections
import numpy as np
from tqdm import tqdm

from lla import defenses
from lla.attacks import memory, replay
from lla.capture import capture, store
from lla.defenses import aware, training, utility
from lla.evidence import files
from lla.train import finetune as finetune_lib

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


def defended_target(config, workdir: pathlib.Path, target, defense, label: str, splits, base):
  """The target fine-tuned from the base with `defense` in the loop (same seed and data as
  the undefended target), so that the server adapts to the mechanism; a training-time
  defense (NoPeek) also trains the client layers it regularises."""
  ft = ml_collections.ConfigDict(config.finetune.to_dict())
  ft.k, ft.data = target.cut, config.data
  ft.train_client_layers = defense.acts_on == "training"
  ft.num_models, ft.first_seed = 1, target.model_seed
  checkpoint, = finetune_lib.finetune(
      ft, workdir / "finetune" / f"def_{label}_m{target.model_seed}", splits=splits, base=base,
      defense=defense)
  # Public knowledge: the attacker holds the defended target's exact client layers.
  return dataclasses.replace(target, params=checkpoint.params, model_id=checkpoint.sha256,
                             attacker_params=checkpoint.params,
                             attacker_source={"checkpoint": str(checkpoint.path)})


def run(config, workdir: pathlib.Path, captures: pathlib.Path, study: pathlib.Path, targets,
        splits, base) -> dict:
  """Runs every defense configuration; returns {"label/m<seed>": utility cost}."""
  cut = int(config.defense_cut)
  public = [t for t in targets if t.cut == cut and t.knowledge == "public"]
  tokens = splits.evaluation.tokens[:int(config.defense_docs)]
  ids = splits.evaluation.document_ids[:int(config.defense_docs)]
  utility_path = workdir / UTILITY_FILE
  costs = files.read_json(str(utility_path)) if utility_path.exists() else {}
  jobs = [(c, t) for c in configurations(config) for t in public]
  for (name, param, strength), undefended in tqdm(jobs, desc="defenses", unit="capture"):
    label = f"{name}_{param}{strength}"
    secret = {"secret_seed": secret_seed(name, strength, undefended.model_seed)} if any(
        f.name == "secret_seed" for f in dataclasses.fields(defenses.get(name))) else {}
    defense = defenses.make(name, **{param: strength}, **secret)
    record = defense.to_record()
    target = undefended
    if name in config.defense_finetune:
      target = defended_target(config, workdir, undefended, defense, label, splits, base)
    directory = captures / f"def_{label}_m{target.model_seed}"
    store.reuse_or_write(directory, lambda d, t=target, dfn=defense, r=record: capture.capture_target(
        d, t.params, t.cfg, tokens, ids, cut, model_id=t.model_id, corpus=splits.corpus,
        split_hashes={n: p.sha256 for n, p in splits.items()}, training=True,
        messages=defended_messages(t.params, t.cfg, tokens, cut, dfn,
                                   int(config.capture_batch_size)),
        defense=name, defense_seed_sha256=r.get("secret_seed_sha256", ""),
        defense_params={**r["params"], "strength": r["strength"], "label": label,
                        "fine_tuned_with_defense": name in config.defense_finetune}))
    attacker = target.attacker(splits.calibration.tokens)
    mimic = {"name": name, "params": record["params"],
             "attacker_seed": secret_seed("attacker/" + name, strength, target.model_seed)}
    aware_too = bool(config.defense_aware_attacks) and \
        aware.calibration_transform(**mimic) is not None
    for seed in config.attack_seeds:
      common = dict(run_prefix=f"def_{label}/m{target.model_seed}/s{seed}/",
                    reference_prefix=f"{undefended.name}/s{seed}/", model_seed=target.model_seed,
                    memory_budget_bytes=memory.chunk_budget_bytes(
                        int(config.memory_budget_mb) << 20)[0])
      replay.replay(str(study), str(directory), attacker, list(config.defense_attacks),
                    config.budget, int(seed), **common)
      if aware_too:
        replay.replay(str(study), str(directory), attacker, list(config.defense_aware_attacks),
                      config.budget, int(seed), calibration_defense=mimic, **common)
    key = f"{label}/m{target.model_seed}"
    if key not in costs:
      # Against the undefended target of the same seed: the defense's whole utility cost,
      # its fine-tuning included.
      costs[key] = {"defense": name, "param": param, "strength": strength,
                    "model_seed": target.model_seed,
                    **utility.heldout_utility(target.params, target.cfg, tokens, cut, defense,
                                              jax.random.key(target.model_seed),
                                              reference_params=undefended.params, n_boot=2000)}
      files.atomic_write_json(str(utility_path), costs, overwrite=True)
  return costs
