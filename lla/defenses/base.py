"""The defense registry: what a defense is, how it is applied and how it is recorded.

A defense is part of the target T (PROTOCOL section 1): it transforms what crosses the cut
and, where it acts in training, is in the loop while the model is fine-tuned. Each one is a
frozen, hashable dataclass of its declared **public** parameters (a static jit argument, so
one mechanism configuration compiles once) with

  * `name`: its registry name;
  * `acts_on`: "activations" (it transforms the forward message h [B, T, d]), "gradients"
    (it transforms the backward message g = dL/dh [B, T, d]), "embeddings" (it transforms
    the client's input token embeddings e [B, T, d] before block 0, and the client's k
    blocks run on them: `lla.defenses.training.defended_client`) or "training" (it changes
    the fine-tuning objective and leaves both messages as the model computes them);
  * `strength`: a float, larger is stronger, and **zero strength turns the whole mechanism
    off** (clipping included where a mechanism clips), so that the zero point of a
    strength sweep is the undefended target, bit for bit;
  * `has_secret`: whether it draws secrets (noise, mixing partners and coefficients, a
    projection matrix).

Secrets are not part of the defense: a `Secret` holds 128 bits from the OS
(`Secret.draw()`) or a seed given explicitly for reproducibility (`Secret.explicit`,
marked as such in every record). Only its sha256 is ever recorded. Compiled code receives
it as traced data, `SecretKeys(persistent, step)`: `persistent` for what lives as long as
the model (a projection matrix), `step` for what is fresh at every step (noise, mixing).
Nothing derives a secret from public values.

`apply(defense, x, keys)` is the pure functional entry point, for h or g alike:
`x [B, T, d] -> x' [B, T, d]`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import secrets as os_secrets
import typing
from typing import Any, ClassVar, NamedTuple

import jax
import numpy as np

ACTS_ON = ("activations", "gradients", "embeddings", "training")
SECRET_BITS = 128

_REGISTRY: dict[str, type["Defense"]] = {}


class DefenseError(ValueError):
  """A defense that cannot be built: an unknown name, an undeclared parameter or a value
  out of range. The message is one line naming it."""


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
    raise DefenseError(f"unknown defense {name!r}; registered: {', '.join(names())}")
  return _REGISTRY[name]


def declared(name: str) -> dict[str, type]:
  """The public parameters defense `name` declares: {parameter: type}."""
  cls = get(name)
  hints = typing.get_type_hints(cls)
  out = {}
  for f in dataclasses.fields(cls):
    kind = hints[f.name]
    # "float | None" and the like: the non-None member.
    members = [a for a in typing.get_args(kind) if a is not type(None)]
    out[f.name] = members[0] if members else kind
  return out


def make(name: str, **params) -> "Defense":
  """A defense by registry name and its public parameters, e.g. make("topk", sparsity=0.9).

  Raises:
    DefenseError naming the problem: an unknown defense, a parameter it does not declare,
    or a value its mechanism refuses (out of range).
  """
  fields = declared(name)
  unknown = sorted(set(params) - set(fields))
  if unknown:
    raise DefenseError(f"defense {name!r} does not declare parameter(s) {', '.join(unknown)} "
                       f"(it declares: {', '.join(sorted(fields)) or 'none'})")
  try:
    return get(name)(**params)
  except (TypeError, ValueError) as e:
    raise DefenseError(f"defense {name!r}: {e}") from None


def seed_hash(seed: int) -> str:
  """The public commitment to a secret (domain-separated from the key derivation)."""
  return hashlib.sha256(f"lla.defense.seed/{int(seed)}".encode()).hexdigest()


class SecretKeys(NamedTuple):
  """A defense's secret as compiled code sees it (a pytree of traced keys)."""

  persistent: jax.Array  # secrets fixed for the model's life (a projection matrix)
  step: jax.Array        # this step's fresh randomness (noise, partners, coefficients)


def step_keys(root: SecretKeys, step) -> SecretKeys:
  """The keys of step `step` (an int or a traced scalar) from a secret's root keys."""
  return SecretKeys(root.persistent, jax.random.fold_in(root.step, step))


def _derived_key(value: int, name: str, purpose: str) -> jax.Array:
  # Hashing accepts secrets of any size and separates mechanisms and purposes. A JAX
  # threefry key holds 64 bits, so each derived key carries 64 of the secret's bits.
  digest = hashlib.sha256(f"lla.defense.key/{name}/{purpose}/{int(value)}".encode()).digest()
  return jax.random.wrap_key_data(np.frombuffer(digest[:8], np.uint32), impl="threefry2x32")


class Secret:
  """The defender's secret for one defended target: never printed, recorded only as a hash.

  `Secret.draw()` takes SECRET_BITS bits from the OS (`secrets.randbits`); `Secret.explicit(s)`
  takes a seed given for reproducibility, and its records say so (`source`).
  """

  __slots__ = ("_value", "source")

  def __init__(self, value: int, source: str):
    if source not in ("os_random_128", "explicit_seed"):
      raise ValueError(f"unknown secret source {source!r}")
    if int(value) < 0:
      raise DefenseError(f"secret seed must be >= 0, got {value}")
    self._value, self.source = int(value), source

  @classmethod
  def draw(cls) -> "Secret":
    return cls(os_secrets.randbits(SECRET_BITS), "os_random_128")

  @classmethod
  def explicit(cls, seed: int) -> "Secret":
    return cls(seed, "explicit_seed")

  @property
  def sha256(self) -> str:
    return seed_hash(self._value)

  def __repr__(self) -> str:
    return f"Secret(sha256={self.sha256[:12]}..., source={self.source})"

  def root_keys(self, defense_name: str) -> SecretKeys:
    """The keys from which every step's keys derive (`step_keys`)."""
    return SecretKeys(_derived_key(self._value, defense_name, "persistent"),
                      _derived_key(self._value, defense_name, "step"))

  def keys(self, defense_name: str, step: int = 0) -> SecretKeys:
    """The keys of step `step` (a capture batch or a training step) of `defense_name`."""
    return step_keys(self.root_keys(defense_name), step)

  def reveal(self) -> int:
    """The secret itself: for the defender's own key store only (never a record)."""
    return self._value

  def record(self) -> dict[str, str]:
    return {"secret_sha256": self.sha256, "secret_source": self.source}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Defense:
  """Base of every defense; subclasses are frozen kw-only dataclasses and `@register`ed."""

  name: ClassVar[str]
  acts_on: ClassVar[str]
  has_secret: ClassVar[bool] = False

  @property
  def strength(self) -> float:
    raise NotImplementedError

  @property
  def off(self) -> bool:
    return self.strength == 0

  def transform(self, x: jax.Array, keys: SecretKeys | None) -> jax.Array:
    """The mechanism itself, x [B, T, d] -> [B, T, d]; only called when not `off`."""
    raise NotImplementedError

  def mimic(self, x: jax.Array, keys: SecretKeys | None) -> jax.Array:
    """The mechanism as a defense-aware attacker runs it on its own calibration activations
    x [N, T, d], with `keys` of its own (lla.defenses.aware): `apply`, for a defense whose
    public parameters define it. A defense with trained weights of its own overrides this
    (they are the defender's secret)."""
    return apply(self, x, keys)

  def client_cross_entropy(self, params, cfg, tokens, k: int, secret: "Secret | None", *,
                           client_tokens, batch_size: int, first_step: int):
    """Per-document next-token CE [N] of held-out tokens [N, T] as the defended client
    predicts them, for a defense whose client processes what the server returns (SnD's
    denoiser, trained first on the client's own documents client_tokens [M, T]); None for
    every other defense: the client reads the server's logits as they are, and
    `lla.defenses.utility` computes the CE."""
    del params, cfg, tokens, k, secret, client_tokens, batch_size, first_step
    return None

  def params(self) -> dict[str, Any]:
    """The declared public parameters."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

  def to_record(self, secret: Secret | None = None) -> dict[str, Any]:
    """The public description for E's target component: never the secret itself."""
    record = {"name": self.name, "acts_on": self.acts_on, "strength": float(self.strength),
              "params": dict(sorted(self.params().items()))}
    if self.has_secret and secret is not None:
      record.update(secret.record())
    return record


class RowwiseDefense(Defense):
  """A defense that acts on each document independently; `transform` vmaps over documents."""

  def transform_document(self, x: jax.Array, persistent: jax.Array | None,
                         key: jax.Array | None) -> jax.Array:
    """One document: x [T, d] -> [T, d], with the persistent key and its own step key."""
    raise NotImplementedError

  def transform(self, x: jax.Array, keys: SecretKeys | None) -> jax.Array:
    if keys is None:
      return jax.vmap(lambda doc: self.transform_document(doc, None, None))(x)
    doc_keys = jax.random.split(keys.step, x.shape[0])
    return jax.vmap(lambda doc, key: self.transform_document(doc, keys.persistent, key))(
        x, doc_keys)


@functools.partial(jax.jit, static_argnums=0)
def apply(defense: Defense, x: jax.Array, keys: SecretKeys | None = None) -> jax.Array:
  """The defended message: x [B, T, d] (h, or g for a gradient defense) -> [B, T, d].

  Zero strength returns x untouched (bit for bit). A "training" defense leaves messages
  as they are: its effect is on the fine-tuned weights (see `lla.defenses.training`); an
  "embeddings" defense acted before block 0 (`lla.defenses.training.defended_client`), so
  it leaves h alone here.
  """
  if defense.off or defense.acts_on in ("training", "embeddings"):
    return x
  if defense.has_secret and keys is None:
    raise ValueError(f"defense {defense.name!r} draws secrets: pass its SecretKeys")
  return defense.transform(x, keys)
