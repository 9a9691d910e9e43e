"""Defenses in the main job: defended captures, every fitting attack, utility cost, frontier.

Each defense configuration (a defense, one value of its swept parameter and its fixed
parameters: `Configuration`) is applied to every public target at the defense cut (one per
model seed, the gate's independent seeds). Each (configuration,
seed) is one defended target with its own secret, 128 bits drawn from the OS the first time
it is needed and kept only in the defender's key store `workdir/defender/secrets.json`
(outside the captures and the study, which record its hash alone; the store lets an
interrupted job resume with the same secret). Defenses named in `config.defense_finetune`,
and every defense that acts through the training objective or has trained weights of its own
(kept from the attacker), are first kept in the loop while that target is fine-tuned again
from the base (same seed and data), so that the server adapts; a defense on the returned
gradient or on the training objective also trains the client layers, where its effect lands. A defense on the input embeddings runs the client's
blocks on its noisy embeddings at fine-tuning, capture and utility alike
(`lla.defenses.training.defended_client`).

The defended capture stores what crossed the cut, h' and g' = dL/dh' (PROTOCOL section 1
with the defense in the loop), in batches of `capture_batch_size`. On it runs every
registered attack that fits it (PROTOCOL section 5a: its observations, knowledge and
threat model; adaptive attacks on the mechanisms they adapt to; defense-aware baselines
with the attacker's own randomness), and each record links the undefended run of the same
target and reference attack as its positive control. The utility cost is the held-out
cross-entropy under the defense against the undefended model of the same seed; a defense
that trains the client layers is compared with the undefended fine-tune that trains them
too, so that its cost is the defense's alone.
"""

from __future__ import annotations

import dataclasses
import fcntl
import pathlib
from typing import Any

import ml_collections
from absl import logging
from tqdm import tqdm

from lla import allocator, defenses, runtime
from lla.attacks import memory, registry
from lla.replay import driver as replay
from lla.capture import capture, store
from lla.defenses import training, utility
from lla.evidence import files, rundir
from lla.model import loading
from lla.protocol import tuple as protocol
from lla.scoring import gates
from lla.train import finetune as finetune_lib

# The utility costs, a file of the study (logged, overwritten as costs are added; the
# report's cost column reads it through the log).
UTILITY_FILE = f"{rundir.INPUTS}/defense_utility.json"
KEY_STORE = pathlib.Path("defender") / "secrets.json"
# Step offsets of the secret's per-step keys: training uses steps 0.., so that capture and
# utility draw randomness of their own.
CAPTURE_STEP, UTILITY_STEP = 1 << 24, 1 << 20


def trains_client(defense: defenses.Defense) -> bool:
  """Whether the defended fine-tune must train the client layers: a defense on the returned
  gradient or on the training objective acts only through them."""
  return defense.acts_on in ("gradients", "training")


class KeyStore:
  """The defenders' secrets of one job, by defended target: drawn once from the OS, then
  reused on resume. Lives outside the captures and the study (file mode 0600). Processes
  that share it (sweep workers) draw under a file lock, so a target gets one secret."""

  def __init__(self, path: pathlib.Path):
    self.path = pathlib.Path(path)
    self._values = files.read_json(str(self.path)) if self.path.exists() else {}

  def secret(self, target: str) -> defenses.Secret:
    if target not in self._values:
      self.path.parent.mkdir(parents=True, exist_ok=True)
      with open(f"{self.path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # Released when the file closes.
        # Another process may have drawn it (or others) since this store was read.
        self._values = files.read_json(str(self.path)) if self.path.exists() else {}
        if target not in self._values:
          self._values[target] = str(defenses.Secret.draw().reveal())
          files.atomic_write_json(str(self.path), self._values, overwrite=True)
    return defenses.Secret(int(self._values[target]), "os_random_128")


def own_weights_key(defense: defenses.Defense) -> str | None:
  """The params key of a defense's own trained weights (mid's bottleneck, `params_key`):
  the client's secret, trained in the defended fine-tune; None for a defense without."""
  return getattr(defense, "params_key", None)


def fine_tunes_with(defense: defenses.Defense, config) -> bool:
  """Whether the main job fine-tunes the target again with `defense` in the loop: where
  `config.defense_finetune` names it, and always for a defense that acts through the
  training objective (its messages are the model's own until it has trained) or has trained
  weights of its own (they exist only once trained)."""
  return (defense.name in config.defense_finetune or defense.acts_on == "training"
          or own_weights_key(defense) is not None)


def attacker_facing(target, defense: defenses.Defense, calibration) -> replay.Attacker:
  """The attacker of a defended target: the client layers its knowledge allows, never the
  defense's own trained weights (the client's secret)."""
  attacker = target.attacker(calibration)
  key = own_weights_key(defense)
  if key is None or key not in attacker.params:
    return attacker
  return dataclasses.replace(attacker, params={n: v for n, v in attacker.params.items()
                                               if n != key})


@dataclasses.dataclass(frozen=True)
class Configuration:
  """One defended configuration of the main job: defense `name` with its parameter `param`
  at `value` and its other public parameters at `fixed` ((parameter, value), ...).

  `value` is the parameter's own value; how strong it is comes from the defense
  (`Defense.strength`, larger is stronger: 1 / epsilon for an epsilon), which the report
  orders by."""

  name: str
  param: str
  value: Any
  fixed: tuple[tuple[str, Any], ...] = ()

  @property
  def label(self) -> str:
    """Its name in run ids, capture directories, the key store and the report:
    `name_paramvalue`, then `_paramvalue` for each fixed parameter."""
    return f"{self.name}_{self.param}{self.value}" + "".join(f"_{p}{v}" for p, v in self.fixed)

  def defense(self) -> defenses.Defense:
    return defenses.make(self.name, **{self.param: self.value, **dict(self.fixed)})


def configurations(config) -> list[Configuration]:
  """`config.defenses`, one Configuration per swept value, in order. Each entry is (name,
  parameter, values) or (name, parameter, values, ((parameter, value), ...)); every defense
  is built here, so that a bad entry is refused before any phase runs.

  Raises:
    defenses.DefenseError (one line naming the entry): a malformed entry, an unknown
    defense or parameter, a value its mechanism refuses, or two entries with one label.
  """
  out = []
  for entry in config.defenses:
    if len(entry) not in (3, 4) or not isinstance(entry[2], (tuple, list)) or not entry[2]:
      raise defenses.DefenseError(
          f"config.defenses entry {tuple(entry)!r}: expected (name, parameter, values) or "
          "(name, parameter, values, ((parameter, value), ...)) with at least one value")
    name, param, values = entry[:3]
    fixed = tuple(tuple(pair) for pair in (entry[3] if len(entry) == 4 else ()))
    if any(len(pair) != 2 for pair in fixed) or param in dict(fixed):
      raise defenses.DefenseError(
          f"config.defenses entry for {name!r}: fixed parameters {fixed!r} must be "
          f"(parameter, value) pairs other than the swept {param!r}")
    out += [Configuration(name, param, value, fixed) for value in values]
  labels = [c.label for c in out]
  repeated = sorted({label for label in labels if labels.count(label) > 1})
  if repeated:
    raise defenses.DefenseError(f"config.defenses lists {', '.join(repeated)} twice")
  for c in out:
    c.defense()
  return out


def fitting_attacks(defense: defenses.Defense, observed, knowledge: str,
                    skip=()) -> tuple[list[str], list[str]]:
  """(attacks, defense-aware baselines) of the replayable registry that fit a capture
  defended by `defense` with observations `observed`, by the rule the gates apply
  (lla.scoring.gates.fitting_modules, PROTOCOL section 5a), less `skip`."""
  entries = [registry.module_entry(spec) for spec in registry.specs()]
  fitting = [m for m in gates.fitting_modules(entries, observed, knowledge, defense.name)
             if m["name"] not in skip]
  return ([m["name"] for m in fitting if not m.get("defense_aware")],
          [m["name"] for m in fitting if m.get("defense_aware")])


def _finetune_config(config, cut: int, train_client_layers: bool) -> ml_collections.ConfigDict:
  ft = ml_collections.ConfigDict(config.finetune.to_dict())
  ft.k, ft.train_client_layers, ft.data = cut, train_client_layers, config.data
  return ft


def trained_reference(config, workdir: pathlib.Path, target, splits, base):
  """The undefended fine-tune of `target`'s seed with trainable client layers: the main
  job's (cut, trained) model, same configuration and cache."""
  ft = _finetune_config(config, target.cut, True)
  checkpoints = finetune_lib.finetune(ft, workdir / "finetune" / f"k{target.cut}_trained",
                                      splits=splits, base=base)
  by_seed = dict(zip(finetune_lib.seeds(ft), checkpoints))
  if target.model_seed not in by_seed:
    raise ValueError(f"model seed {target.model_seed} is not among the fine-tuned seeds "
                     f"{sorted(by_seed)}")
  return by_seed[target.model_seed].params


def defended_target(config, workdir: pathlib.Path, target, defense, secret, label: str,
                    splits, base):
  """The target fine-tuned from the base with `defense` in the loop (same seed and data as
  the undefended target), so that the server adapts to the mechanism."""
  ft = _finetune_config(config, target.cut, trains_client(defense))
  ft.num_models, ft.first_seed = 1, target.model_seed
  checkpoint, = finetune_lib.finetune(
      ft, workdir / "finetune" / f"def_{label}_m{target.model_seed}", splits=splits, base=base,
      defense=defense, secret=secret)
  # Public knowledge: the attacker holds the defended target's exact client layers.
  target.resident.keep(checkpoint)
  return dataclasses.replace(target, checkpoint=checkpoint.path,
                             model_id=loading.identify(checkpoint.sha256, checkpoint.cfg,
                                                       checkpoint.tokenizer)[0],
                             params_sha256=checkpoint.sha256,
                             attacker_source={"checkpoint": str(checkpoint.path)}, base=None)


def public_params(defense: defenses.Defense, secret: defenses.Secret | None, label: str,
                  fine_tuned: bool) -> dict:
  """The defense's public parameters as the defended capture's E records them."""
  record = defense.to_record(secret)
  params = {**record["params"], "strength": record["strength"], "label": label,
            "fine_tuned_with_defense": fine_tuned,
            "client_layers_trained": fine_tuned and trains_client(defense)}
  if secret is not None:
    params["secret_source"] = secret.source
  return params


def capture_expectation(target, defense: defenses.Defense, secret: defenses.Secret | None,
                        label: str, fine_tuned: bool, cut: int, split_hashes: dict) -> dict:
  """What a reused defended capture of `target` must match (store.reuse_or_write): the
  model it was captured from (a fine-tune done again has another id), the defense and its
  public parameters, the hash of the secret it was made with (a lost key store draws
  another), the cut and the splits."""
  stored = protocol.make(T=protocol.Target(
      model_id=target.model_id, cut=cut, defense=defense.name,
      defense_params=protocol.frozen(public_params(defense, secret, label, fine_tuned)),
      defense_seed_sha256=secret.sha256 if secret is not None else "")).to_dict()["T"]
  return {"T.model_id": stored["model_id"], "T.cut": stored["cut"],
          "T.defense": stored["defense"], "T.defense_params": stored["defense_params"],
          "T.defense_seed_sha256": stored["defense_seed_sha256"],
          "C.split_hashes": dict(split_hashes)}


def defended_capture(directory: pathlib.Path, target, defense: defenses.Defense,
                     secret: defenses.Secret | None, label: str, fine_tuned: bool, tokens, ids,
                     cut: int, corpus: str, split_hashes: dict, batch_size: int,
                     known_prefix: tuple[int, ...] = ()) -> str:
  """The defended capture of `target` (PROTOCOL section 1 with the defense in the loop),
  made once; a capture already in `directory` is reused only if its E matches what this
  one would be (`capture_expectation`), else refused (store.CaptureError, one line naming
  what differs). Returns its manifest sha256."""
  params = public_params(defense, secret, label, fine_tuned)
  return store.reuse_or_write(directory, lambda d: capture.capture_target(
      d, target.params, target.cfg, tokens, ids, cut, model_id=target.model_id, corpus=corpus,
      split_hashes=split_hashes, training=True, batch_size=batch_size,
      messages=training.batched_messages(target.params, target.cfg, tokens, cut, defense,
                                         secret, batch_size, training=True,
                                         first_step=CAPTURE_STEP, fine_tuned=fine_tuned),
      defense=defense.name, defense_seed_sha256=secret.sha256 if secret is not None else "",
      defense_params=params, known_prefix=known_prefix),
      expected=capture_expectation(target, defense, secret, label, fine_tuned, cut,
                                   split_hashes))


def run(config, workdir: pathlib.Path, captures: pathlib.Path, study: pathlib.Path, targets,
        splits, base) -> dict:
  """Runs every defense configuration; returns {"label/m<seed>": utility cost}."""
  cut = int(config.defense_cut)
  batch_size = int(config.capture_batch_size)
  public = [t for t in targets if t.cut == cut and t.knowledge == "public"]
  tokens = splits.evaluation.tokens[:int(config.defense_docs)]
  ids = splits.evaluation.document_ids[:int(config.defense_docs)]
  costs = rundir.read_logged_json(str(study), UTILITY_FILE) or {}
  keys = KeyStore(workdir / KEY_STORE)
  jobs = [(c, t) for c in configurations(config) for t in public]
  for configuration, undefended in tqdm(jobs, desc="defenses", unit="capture"):
    # Each job fine-tunes, captures and attacks anew: once the heap's free pages from the
    # jobs before it add up past a limit, they go back to the OS (lla.allocator.release_free).
    allocator.release_free()
    name, label = configuration.name, configuration.label
    # What the jobs before this one left held (a job's growth shows between two lines).
    logging.info("defenses: before %s/m%d: malloc %s, JAX arrays %s, memory mappings %s",
                 label, undefended.model_seed, allocator.heap_usage(), runtime.held_arrays(),
                 runtime.memory_mappings())
    defense = configuration.defense()
    secret = keys.secret(f"{label}/m{undefended.model_seed}") if defense.has_secret else None
    record = defense.to_record(secret)
    target = undefended
    fine_tuned = fine_tunes_with(defense, config)
    if fine_tuned:
      target = defended_target(config, workdir, undefended, defense, secret, label, splits,
                               base)
    directory = captures / f"def_{label}_m{target.model_seed}"
    defended_capture(directory, target, defense, secret, label, fine_tuned, tokens, ids, cut,
                     splits.corpus, {n: s.sha256 for n, s in splits.items()}, batch_size,
                     splits.known_prefix)
    attacker = attacker_facing(target, defense, splits.calibration.tokens)
    attacks, baselines = fitting_attacks(defense, {"activations", "gradients"},
                                         target.knowledge, tuple(config.defense_skip_attacks))
    for seed in config.attack_seeds:
      common = dict(run_prefix=f"def_{label}/m{target.model_seed}/s{seed}/",
                    reference_prefix=f"{undefended.name}/s{seed}/", model_seed=target.model_seed,
                    memory_budget_bytes=memory.chunk_budget_bytes(
                        int(config.memory_budget_mb) << 20)[0])
      replay.replay(str(study), str(directory), attacker, attacks,
                    registry.relevant_budget(config.budget, attacks), int(seed), **common)
      if baselines:
        # The attacker's own randomness: its attack seed, recorded in E.K.
        mimic = {"name": name, "params": record["params"], "attacker_seed": int(seed)}
        replay.replay(str(study), str(directory), attacker, baselines,
                      registry.relevant_budget(config.budget, baselines), int(seed),
                      calibration_defense=mimic, **common)
    key = f"{label}/m{target.model_seed}"
    if key not in costs:
      # Against the undefended model of the same seed (its fine-tune training the client
      # layers too where the defended one does): the defense's whole utility cost.
      reference = (trained_reference(config, workdir, undefended, splits, base)
                   if fine_tuned and trains_client(defense) else undefended.params)
      costs[key] = {"defense": name, "param": configuration.param,
                    "value": configuration.value, "fixed": dict(configuration.fixed),
                    "strength": defense.strength, "model_seed": target.model_seed,
                    **utility.heldout_utility(target.params, target.cfg, tokens, cut, defense,
                                              secret, reference_params=reference,
                                              first_step=UTILITY_STEP, n_boot=2000,
                                              client_tokens=splits.training.tokens)}
      with rundir.extending(str(study)):
        rundir.save_file(str(study), UTILITY_FILE, files.canonical_json(costs),
                         "defense_utility", overwrite=True)
  return costs
