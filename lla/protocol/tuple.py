"""The protocol tuple E = (T, V, O, K, B, C, M, G) of PROTOCOL section 2.

Each component is a frozen record. E serialises to canonical JSON (sorted keys, no
whitespace) and its sha256 is the experiment's identity: two runs that differ in one
component are a controlled contrast, and a record names the E it belongs to.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lla.evidence import files

SCHEMA = "lla.protocol.v2"
POSITIONS = ("passive_server", "eavesdropper", "active_server")
KNOWLEDGE = ("public", "trained", "none")


def _freeze(value):
  """dicts -> sorted tuples of pairs, lists -> tuples: hashable, order-independent."""
  if isinstance(value, dict):
    return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
  if isinstance(value, (list, tuple)):
    return tuple(_freeze(v) for v in value)
  return value


def _thaw(value):
  if isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 and
                                      isinstance(p[0], str) for p in value) and value:
    return {k: _thaw(v) for k, v in value}
  if isinstance(value, tuple):
    return [_thaw(v) for v in value]
  return value


@dataclasses.dataclass(frozen=True)
class Target:
  """T: the system under test."""
  model_id: str                 # checkpoint content hash (or a name for HF dirs)
  cut: int                      # k
  defense: str = "none"
  defense_params: tuple = ()    # frozen dict of the defense's public parameters
  defense_seed_sha256: str = "" # hash of the defender's secret seed: one instance of it
  n_layer: int = 0


@dataclasses.dataclass(frozen=True)
class Attacker:
  """V: where the attacker sits and what it may do."""
  position: str = "passive_server"
  rights: tuple[str, ...] = ("observe",)


@dataclasses.dataclass(frozen=True)
class Observations:
  """O: what crosses the boundary and is stored in the capture."""
  activations: bool = True
  gradients: bool = False
  logits: bool = False
  row_norms: bool = False
  metadata: bool = True
  capture_sha256: str = ""      # the replayed capture's manifest hash ("" in the capture's
                                # own E, which the manifest covers)

  def available(self) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(self)
                     if f.type == "bool" and getattr(self, f.name))


@dataclasses.dataclass(frozen=True)
class Knowledge:
  """K: the client weights the attacker holds."""
  weights: str = "public"
  weights_sha256: str = ""      # identity of the attacker's copy of the model
  calibration_sha256: str = ""  # the attacker's calibration tokens (int32 bytes)
  mechanism: tuple = ()         # frozen dict: the defense mechanism a defense-aware attacker
                                # mimics (name, public params, its own seed); () = unaware


@dataclasses.dataclass(frozen=True)
class Budgets:
  """B: calibration size and every budget field (lla.attacks.budget), defaults included."""
  calibration_size: int = 32
  fields: tuple = ()            # frozen dict field -> value

  def values(self) -> dict[str, Any]:
    return _thaw(self.fields) or {}


@dataclasses.dataclass(frozen=True)
class Corpora:
  """C: the corpus and its splits' content hashes."""
  name: str = "wikitext2"
  seq_len: int = 32
  split_hashes: tuple = ()      # frozen dict split -> sha256
  # Tokens every document starts with, public to every party (the model's BOS): attacks
  # may start after them and no position among them is scored. Left out of E's JSON when
  # empty, so that every E without one keeps the hash it had before the field existed.
  known_prefix: tuple[int, ...] = ()
  # Which recorded copy of the corpus's files the passages were cut from (lla.data.fetch.COPIES:
  # "hub-canonical", "shared-repacked", or "unrecognised"): copies of one corpus may hold the
  # same text in another order, which draws other passages. Left out of E's JSON when empty
  # (a corpus with no recorded copies, or an E from before the field), like known_prefix.
  copy: str = ""


@dataclasses.dataclass(frozen=True)
class Metrics:
  """M: what is measured."""
  names: tuple[str, ...] = ("token_recovery", "exact_document_recovery")


@dataclasses.dataclass(frozen=True)
class Controls:
  """G: controls, uncertainty and decision rules."""
  policy: str = "scorecard-policy.v3"
  policy_sha256: str = ""       # sha256 of the policy file, fixed before the run
  seeds: tuple[int, ...] = (0,)
  controls: tuple[str, ...] = ("shuffled_gradients", "random_candidates")


@dataclasses.dataclass(frozen=True)
class ProtocolTuple:
  T: Target
  V: Attacker
  O: Observations
  K: Knowledge
  B: Budgets
  C: Corpora
  M: Metrics
  G: Controls

  def __post_init__(self):
    if self.V.position not in POSITIONS:
      raise ValueError(f"attacker position {self.V.position!r} not in {POSITIONS}")
    if self.K.weights not in KNOWLEDGE:
      raise ValueError(f"knowledge {self.K.weights!r} not in {KNOWLEDGE}")

  def to_dict(self) -> dict[str, Any]:
    out = {"schema": SCHEMA}
    for f in dataclasses.fields(self):
      component = getattr(self, f.name)
      out[f.name] = {g.name: _thaw(getattr(component, g.name))
                     for g in dataclasses.fields(component)}
    if not self.C.known_prefix:
      del out["C"]["known_prefix"]
    if not self.C.copy:
      del out["C"]["copy"]
    return out

  def canonical_json(self) -> bytes:
    return files.canonical_json(self.to_dict())

  def sha256(self) -> str:
    return files.sha256_bytes(self.canonical_json())

  def replace(self, **components) -> "ProtocolTuple":
    return dataclasses.replace(self, **components)

  @classmethod
  def from_dict(cls, data: dict[str, Any]) -> "ProtocolTuple":
    if data.get("schema") != SCHEMA:
      raise ValueError(f"protocol tuple schema {data.get('schema')!r}, expected {SCHEMA!r}")
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, component_type in zip(types, (Target, Attacker, Observations, Knowledge,
                                            Budgets, Corpora, Metrics, Controls)):
      kwargs[name] = component_type(**{k: _freeze(v) for k, v in data[name].items()})
    return cls(**kwargs)


def make(**components) -> ProtocolTuple:
  """A tuple with defaults for every component not given; dict values are frozen."""
  defaults = dict(T=None, V=Attacker(), O=Observations(), K=Knowledge(), B=Budgets(),
                  C=Corpora(), M=Metrics(), G=Controls())
  defaults.update(components)
  if defaults["T"] is None:
    raise ValueError("a protocol tuple needs a target T")
  return ProtocolTuple(**defaults)


def frozen(mapping: dict) -> tuple:
  """A dict as a frozen, canonically ordered tuple of pairs (for *_params fields)."""
  return _freeze(mapping)
