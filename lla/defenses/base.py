"""The defense registry: what a defense is, how it is applied and how it is recorded.

A defense is part of the target T (PROTOCOL section 1): it transforms what crosses the cut
and, where it acts in training, is in the loop while the model is fine-tuned. Each one is a
frozen, hashable dataclass of its declared parameters (so it is a static jit argument) with

  * `name`: its registry name;
  * `acts_on`: "activations" (it transforms the forward message h [B, T, d]), "gradients"
    (it transforms the backward message g = dL/dh [B, T, d]) or "training" (it changes the
    fine-tuning objective and leaves both messages as the model computes them);
  * `strength`: a float, larger is stronger, and **zero strength turns the whole mechanism
    off** (clipping included where a mechanism clips), so that the zero point of a
    strength sweep is the undefended target, bit for bit;
  * `secret_seed` (only where the mechanism has secrets): every secret (noise, mixing
    coefficients, partners, projection matrix) is derived from it. It is never printed
    (`repr=False`) and `to_record()` carries only its sha256. That hash hides the seed only
    as well as the seed's entropy allows: draw seeds with `secrets.randbits(64)`, not 0..99.

`apply(defense, x, key)` is the pure functional entry point, for h or g alike:
`x [B, T, d] -> x' [B, T, d]`. Fresh per-step randomness comes from the explicit `key`,
which a client derives from the secret seed with `defense.step_key(step)`; secrets that
persist across steps (a projection matrix) come from `defense.secret_key(purpose)` and do
not depend on `key`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any, ClassVar

import jax
import numpy as np

ACTS_ON = ("activations", "gradients", "training")

_REGISTRY: dict[str, type["Defense"]] = {}


def register(cls: type["Defense"]) -> type["Defense"]:
  """Class decorator: adds a defense to the registry under `cls.name`."""
  if cls.acts_on not in ACTS_ON:
    raise ValueError(f"{cls.__name__}.acts_on={cls.acts_on!r} is not one of {ACTS_ON}")
  if cls.name in _REGISTRY:
    raise ValueError(f"defense name {cls.name!r} is already registered")
  _REGISTRY[cls.name] = cls
  return cls


def names() -> tuple[str, ...]:
  """The registered defense names, sorted."""
  return tuple(sorted(_REGISTRY))


def get(name: str) -> type["Defense"]:
  if name not in _REGISTRY:
    raise KeyError(f"unknown defense {name!r}; registered: {names()}")
  return _REGISTRY[name]


def make(name: str, **params) -> "Defense":
  """A defense by registry name and its declared parameters, e.g. make("topk", sparsity=0.9)."""
  return get(name)(**params)


def seed_hash(seed: int) -> str:
  """The public commitment to a secret seed (domain-separated from the key derivation)."""
  return hashlib.sha256(f"lla.defense.seed/{int(seed)}".encode()).hexdigest()


def _derived_key(seed: int, name: str, purpose: str) -> jax.Array:
  # Hashing rather than PRNGKey(seed) accepts seeds of any size, and separates the secrets
  # of different mechanisms and purposes that share one seed.
  digest = hashlib.sha256(f"lla.defense.key/{name}/{purpose}/{int(seed)}".encode()).digest()
  return jax.random.wrap_key_data(np.frombuffer(digest[:8], np.uint32), impl="threefry2x32")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Defense:
  """Base of every defense; subclasses are frozen kw-only dataclasses and `@register`ed."""

  name: ClassVar[str]
  acts_on: ClassVar[str]

  @property
  def strength(self) -> float:
    raise NotImplementedError

  @property
  def off(self) -> bool:
    return self.strength == 0

  def transform(self, x: jax.Array, key: jax.Array | None) -> jax.Array:
    """The mechanism itself, x [B, T, d] -> [B, T, d]; only called when not `off`."""
    raise NotImplementedError

  @property
  def has_secret(self) -> bool:
    return any(f.name == "secret_seed" for f in dataclasses.fields(self))

  def secret_key(self, purpose: str) -> jax.Array:
    """A key for one persistent secret of this defense, derived from its secret seed."""
    if not self.has_secret:
      raise ValueError(f"defense {self.name!r} has no secret seed")
    return _derived_key(self.secret_seed, self.name, purpose)

  def step_key(self, step: int) -> jax.Array:
    """The key of training/capture step `step`: fresh noise, coefficients, partners."""
    return jax.random.fold_in(self.secret_key("step"), step)

  def params(self) -> dict[str, Any]:
    """The declared public parameters (the secret seed excluded)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if f.name != "secret_seed"}

  def to_record(self) -> dict[str, Any]:
    """The public description for E's target component: never the secret itself."""
    record = {"name": self.name, "acts_on": self.acts_on, "strength": float(self.strength),
              "params": dict(sorted(self.params().items()))}
    if self.has_secret:
      record["secret_seed_sha256"] = seed_hash(self.secret_seed)
    return record


class RowwiseDefense(Defense):
  """A defense that acts on each document independently; `transform` vmaps over documents."""

  def transform_document(self, x: jax.Array, key: jax.Array | None) -> jax.Array:
    """One document: x [T, d] -> [T, d]."""
    raise NotImplementedError

  def transform(self, x: jax.Array, key: jax.Array | None) -> jax.Array:
    keys = None if key is None else jax.random.split(key, x.shape[0])
    return jax.vmap(self.transform_document)(x, keys)


@functools.partial(jax.jit, static_argnums=0)
def apply(defense: Defense, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
  """The defended message: x [B, T, d] (h, or g for a gradient defense) -> [B, T, d].

  Zero strength returns x untouched (bit for bit). A "training" defense leaves messages
  as they are: its effect is on the fine-tuned weights (see `lla.defenses.training`).
  """
  if defense.off or defense.acts_on == "training":
    return x
  return defense.transform(x, key)
