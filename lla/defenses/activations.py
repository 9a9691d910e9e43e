"""Defenses on the forward message h [B, T, d]: noise, compression, mixup, projection.

A "row" is one position's d-vector h[b, t]. Every mechanism here is differentiable (or has
a straight-through gradient) so that it can sit in the fine-tuning loop.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from lla.defenses.base import Defense, RowwiseDefense, register


def clip_rows(x: jax.Array, clip_norm: float) -> jax.Array:
  """Each row x[..., :] scaled to L2 norm <= clip_norm; rows already within it are unchanged.

  `C / max(||x||, C)` is exactly 1.0 for rows within the bound (no rounding), and never
  divides by zero.
  """
  norm = jnp.linalg.norm(x, axis=-1, keepdims=True)
  return x * (clip_norm / jnp.maximum(norm, clip_norm))


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class GaussianNoise(RowwiseDefense):
  """h' = clip_C(h) + sigma * N(0, I), per row; the forward protection of PROTOCOL section 7.

  strength = sigma (absolute noise std). `clip_norm=None` skips clipping; with it, each row
  is first scaled to L2 norm <= clip_norm, which bounds the signal-to-noise ratio.
  """

  name = "gaussian"
  acts_on = "activations"

  has_secret = True

  sigma: float
  clip_norm: float | None = None

  def __post_init__(self):
    if self.sigma < 0:
      raise ValueError(f"sigma={self.sigma} must be >= 0")
    if self.clip_norm is not None and self.clip_norm <= 0:
      raise ValueError(f"clip_norm={self.clip_norm} must be > 0 or None")

  @property
  def strength(self) -> float:
    return self.sigma

  def transform_document(self, x, persistent, key):
    del persistent
    if self.clip_norm is not None:
      x = clip_rows(x, self.clip_norm)
    return x + self.sigma * jax.random.normal(key, x.shape, x.dtype)


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class TopK(RowwiseDefense):
  """Per-row top-k sparsification: keep the k entries of largest |h| in each row, zero the rest.

  strength = sparsity, the fraction of the d entries zeroed: k = d - floor(sparsity * d)
  (>= 1 since sparsity < 1). Exactly k entries per row are kept even under ties in |h|
  (the lower index wins, as in `lax.top_k`). The gradient flows to the kept entries.
  """

  name = "topk"
  acts_on = "activations"

  sparsity: float

  def __post_init__(self):
    if not 0 <= self.sparsity < 1:
      raise ValueError(f"sparsity={self.sparsity} must lie in [0, 1)")

  @property
  def strength(self) -> float:
    return self.sparsity

  def kept(self, d: int) -> int:
    return d - math.floor(self.sparsity * d)

  def transform_document(self, x, persistent, key):
    del persistent, key
    _, idx = jax.lax.top_k(jnp.abs(x), self.kept(x.shape[-1]))
    rows = jnp.arange(x.shape[0])[:, None]
    keep = jnp.zeros(x.shape, bool).at[rows, idx].set(True)
    return jnp.where(keep, x, 0.0)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def quantize_rows(x: jax.Array, bits: int) -> jax.Array:
  """Uniform `bits`-bit quantisation of each row x[..., :] over its own [min, max] range.

  Levels lo + i * step, i = 0..2^bits - 1, step = (max - min) / (2^bits - 1): at most 2^bits
  distinct values per row, |x - q| <= step / 2, and min and max are levels. A constant row
  is returned as is. The row's range travels implicitly (the receiver needs lo and step).
  Gradient: straight-through (identity), so the quantiser can sit in the training loop.
  """
  lo = x.min(axis=-1, keepdims=True)
  span = x.max(axis=-1, keepdims=True) - lo
  top = 2**bits - 1
  step = jnp.where(span > 0, span / top, 1.0)
  level = jnp.clip(jnp.round((x - lo) / step), 0, top)
  return lo + level * step


@quantize_rows.defjvp
def _quantize_rows_jvp(bits, primals, tangents):
  (x,), (dx,) = primals, tangents
  return quantize_rows(x, bits), dx


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Quantize(RowwiseDefense):
  """Per-row uniform quantisation to `bits` bits over the row's [min, max] (`quantize_rows`).

  bits = 0 means no quantisation (the float32 wire); otherwise strength = 1 / bits, so fewer
  bits is stronger.
  """

  name = "quantize"
  acts_on = "activations"

  bits: int

  def __post_init__(self):
    if not 0 <= self.bits <= 24:
      raise ValueError(f"bits={self.bits} must lie in 0..24 (float32 has a 24-bit mantissa)")

  @property
  def strength(self) -> float:
    return 0.0 if self.bits == 0 else 1.0 / self.bits

  def transform_document(self, x, persistent, key):
    del persistent, key
    return quantize_rows(x, self.bits)


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class SecretMixup(Defense):
  """Secret mixup of documents within a batch, in the spirit of InstaHide / TextMixer.

  Scheme, for a batch of B documents and m = strength + 1 mixed rows per document:
    1. a secret uniformly random permutation sigma of 0..B-1 and m - 1 distinct secret
       offsets s_1..s_{m-1} drawn without replacement from 1..B-1, with s_0 = 0;
    2. partners pi_j(b) = sigma[(sigma^{-1}[b] + s_j) mod B]: pi_0 is the identity, each
       pi_j is a permutation of the batch, and for j >= 1 it has no fixed point, so the m
       partners of each document are distinct and every document enters exactly m mixtures;
    3. secret coefficients lambda_b ~ Dirichlet(alpha * 1_m), independently per document
       (non-negative, sum to 1);
    4. h'_b = sum_j lambda_{b,j} h_{pi_j(b)} (the same mixture at every position t).
  In training the labels are mixed alike: the server loss is
  mean_{b, t < T-1} sum_j lambda_{b,j} CE(logits[b, t], x[pi_j(b), t+1]).
  Everything is fresh per call (from the step key); the server never sees lambda or pi.
  Requires m <= B.
  """

  name = "mixup"
  acts_on = "activations"

  has_secret = True

  m: int = 1
  alpha: float = 1.0

  def __post_init__(self):
    if self.m < 1:
      raise ValueError(f"m={self.m} must be >= 1")
    if self.alpha <= 0:
      raise ValueError(f"alpha={self.alpha} must be > 0")

  @property
  def strength(self) -> float:
    return float(self.m - 1)

  def mix(self, h: jax.Array, key: jax.Array):
    """h [B, T, d] -> (h' [B, T, d], lam [B, m] coefficients, partners [B, m] int)."""
    n_docs = h.shape[0]
    if self.m > n_docs:
      raise ValueError(f"mixup with m={self.m} needs at least m documents per batch, got {n_docs}")
    key_perm, key_offset, key_lam = jax.random.split(key, 3)
    sigma = jax.random.permutation(key_perm, n_docs)
    rank = jnp.argsort(sigma)
    offsets = jnp.concatenate([
        jnp.zeros((1,), jnp.int32),
        1 + jax.random.choice(key_offset, n_docs - 1, (self.m - 1,), replace=False)])
    partners = sigma[(rank[:, None] + offsets[None, :]) % n_docs]
    lam = jax.random.dirichlet(key_lam, jnp.full((self.m,), self.alpha), (n_docs,))
    mixed = jnp.einsum("bj,bjtd->btd", lam, h[partners])
    return mixed, lam, partners

  def transform(self, x, keys):
    return self.mix(x, keys.step)[0]


def random_projection(key: jax.Array, d: int, kind: str) -> jax.Array:
  """A d x d secret projection R, applied as h' = h R.

  "haar": Q of the QR of a standard Gaussian matrix with the signs of diag(R_qr) folded
  into Q's columns (Mezzadri 2007) -- without that fix Q is not Haar-distributed.
  "gaussian": Z / sqrt(d), Z standard Gaussian (orthogonal only in expectation).
  """
  z = jax.random.normal(key, (d, d), jnp.float32)
  if kind == "gaussian":
    return z / math.sqrt(d)
  q, r = jnp.linalg.qr(z)
  return q * jnp.sign(jnp.diagonal(r))[None, :]


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class SecretProjection(RowwiseDefense):
  """h' = h R with a secret d x d matrix R (`random_projection`), fixed for the model's life.

  R depends only on the persistent key, not on the step key, because the server adapts
  to it: fine-tune with `defended_loss` and the server's blocks k.. learn to read rotated
  residuals. `matrix(persistent, d)` is R for the (client-side) training code.
  strength = 1 when enabled, 0 when off (a projection has no partial setting here).
  """

  name = "projection"
  acts_on = "activations"

  has_secret = True

  kind: str = "haar"
  enabled: bool = True

  def __post_init__(self):
    if self.kind not in ("haar", "gaussian"):
      raise ValueError(f"kind={self.kind!r} must be 'haar' or 'gaussian'")

  @property
  def strength(self) -> float:
    return 1.0 if self.enabled else 0.0

  def matrix(self, persistent: jax.Array, d: int) -> jax.Array:
    """The secret R [d, d] of the persistent key."""
    return random_projection(persistent, d, self.kind)

  def transform(self, x, keys):
    # One R for every document (not vmapped: one QR per call).
    return jnp.einsum("btd,de->bte", x, self.matrix(keys.persistent, x.shape[-1]))
