"""The attack registry: each attack is one module that declares what it needs.

An attack declares the observations (O) and knowledge (K) of the protocol tuple it
requires. `check_compatible` refuses to run it on a capture that lacks them, naming the
missing piece, so adding an attack means writing one module and no driver changes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import numpy as np

OBSERVATIONS = ("activations", "gradients")
KNOWLEDGE = ("public", "trained", "none")


class IncompatibleCaptureError(ValueError):
  """An attack was asked to run on a capture that lacks an input it declares."""


@dataclasses.dataclass(frozen=True)
class AttackSpec:
  """What an attack is and what it needs.

  Attributes:
    name: registry key, also the predictions' file name.
    family: attack family; a defense's positive control must come from the same family.
    requires: observations it reads (subset of OBSERVATIONS).
    knowledge: knowledge settings it can run under (weights the attacker holds).
    needs_weights: whether it runs the attacker's copy of the client layers.
    budget_fields: names of the budget config fields it reads.
    scored_positions: "all" or "t>=1".
    role: "attack", "negative_control" or "baseline".
    description: one line for reports.
    reference: where the algorithm is pinned or published.
    defense_aware: fits its decoder on calibration passed through the defense's mechanism
      (with the attacker's own randomness); runs only with such a transform.
    reference_attack: the attack whose undefended run is this one's positive control
      ("" = itself).
  """

  name: str
  family: str
  requires: tuple[str, ...]
  knowledge: tuple[str, ...] = ("public", "trained")
  needs_weights: bool = True
  budget_fields: tuple[str, ...] = ()
  scored_positions: str = "all"
  role: str = "attack"
  description: str = ""
  reference: str = "PROTOCOL.md section 4"
  defense_aware: bool = False
  reference_attack: str = ""

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class AttackResult:
  """predictions [B, T] int32, and the compiled work it took."""

  predictions: np.ndarray
  flops: float
  flops_source: str
  flops_analytic: float


class Attack(Protocol):
  spec: AttackSpec

  def __call__(self, workspace, budget, key: jax.Array) -> AttackResult:
    ...


_REGISTRY: dict[str, Attack] = {}


def register(attack: Attack) -> Attack:
  """Adds an attack instance to the registry (used as a decorator on a factory's result)."""
  name = attack.spec.name
  if name in _REGISTRY:
    raise ValueError(f"attack {name!r} is registered twice")
  unknown = set(attack.spec.requires) - set(OBSERVATIONS)
  if unknown:
    raise ValueError(f"attack {name!r} requires unknown observations {sorted(unknown)}")
  _REGISTRY[name] = attack
  return attack


def get(name: str) -> Attack:
  _load_builtin_attacks()
  if name not in _REGISTRY:
    raise KeyError(f"no attack named {name!r}; registered: {', '.join(sorted(_REGISTRY))}")
  return _REGISTRY[name]


def get_unloaded(name: str) -> Attack:
  """An already registered attack, without triggering the built-in imports (for modules
  that derive variants while they are being imported)."""
  return _REGISTRY[name]


def names() -> list[str]:
  _load_builtin_attacks()
  return sorted(_REGISTRY)


def specs() -> list[AttackSpec]:
  return [get(n).spec for n in names()]


def module_entries() -> list[dict[str, Any]]:
  """Every registered attack as the scoring layer's module entry (coverage, qualification)."""
  return [{**s.to_dict(), "observations": list(s.requires)} for s in specs()]


def check_compatible(spec: AttackSpec, observed: set[str] | frozenset[str], knowledge: str,
                     capture_name: str = "capture") -> None:
  """Raises IncompatibleCaptureError naming what the capture or attacker lacks."""
  missing = [o for o in spec.requires if o not in observed]
  if missing:
    raise IncompatibleCaptureError(
        f"attack {spec.name!r} needs {', '.join(missing)}, which {capture_name} does not hold "
        f"(it holds: {', '.join(sorted(observed)) or 'nothing'})")
  if knowledge not in spec.knowledge:
    raise IncompatibleCaptureError(
        f"attack {spec.name!r} runs under knowledge {spec.knowledge}, not {knowledge!r}")


def _load_builtin_attacks() -> None:
  # Imported for their registration side effect; lazily, so that importing the registry
  # alone compiles nothing.
  from lla.attacks import beam_attacks, heuristics  # noqa: F401

