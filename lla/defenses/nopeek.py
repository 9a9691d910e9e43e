"""NoPeek (Vepakomma et al. 2020): fine-tune with a distance-correlation penalty at the cut.

The client adds alpha * dCor(e, h) to its loss, with e = wte[x] the input tokens' embeddings
(the quantity the ridge decoder of PROTOCOL section 4 recovers; position embeddings carry
nothing private) and h the forward message, both as [B*T, d] samples, one per position.
The messages themselves are not transformed; the penalty shapes the client's weights.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lla.defenses.base import Defense, register


def _pairwise_distances(x: jax.Array) -> jax.Array:
  """||x_i - x_j|| for x [n, p] -> [n, n], with a finite gradient at zero distance."""
  x = x - x.mean(axis=0)  # centring first keeps the Gram identity's cancellation small
  sq_norm = jnp.einsum("ip,ip->i", x, x)
  sq = sq_norm[:, None] + sq_norm[None, :] - 2.0 * jnp.einsum("ip,jp->ij", x, x)
  # Zero distances (the diagonal, repeated rows) would make sqrt's gradient 0/0.
  positive = (sq > 0) & ~jnp.eye(x.shape[0], dtype=bool)
  return jnp.where(positive, jnp.sqrt(jnp.where(positive, sq, 1.0)), 0.0)


def _double_centre(a: jax.Array) -> jax.Array:
  return a - a.mean(axis=0, keepdims=True) - a.mean(axis=1, keepdims=True) + a.mean()


def distance_correlation(x: jax.Array, z: jax.Array) -> jax.Array:
  """Sample distance correlation (Szekely, Rizzo & Bakirov 2007) of x [n, p] and z [n, q].

  A, B the double-centred distance matrices; dCov^2 = mean(A * B); dCor = sqrt(dCov^2(x, z)
  / sqrt(dVar^2(x) dVar^2(z))), in [0, 1], 1 for x = z, 0 if either sample is constant.
  """
  a = _double_centre(_pairwise_distances(x.astype(jnp.float32)))
  b = _double_centre(_pairwise_distances(z.astype(jnp.float32)))
  dcov2_xz = jnp.mean(a * b)
  dvar2 = jnp.mean(a * a) * jnp.mean(b * b)
  ok = dvar2 > 0
  dcor2 = jnp.where(ok, dcov2_xz / jnp.sqrt(jnp.where(ok, dvar2, 1.0)), 0.0)
  # dCov^2 is >= 0 in exact arithmetic; the clamp removes rounding below zero.
  dcor2 = jnp.maximum(dcor2, 0.0)
  return jnp.where(dcor2 > 0, jnp.sqrt(jnp.where(dcor2 > 0, dcor2, 1.0)), 0.0)


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class NoPeek(Defense):
  """Distance-correlation regularisation; strength = alpha, the penalty's weight."""

  name = "nopeek"
  acts_on = "training"

  alpha: float

  def __post_init__(self):
    if self.alpha < 0:
      raise ValueError(f"alpha={self.alpha} must be >= 0")

  @property
  def strength(self) -> float:
    return self.alpha

  def penalty(self, embeddings: jax.Array, h: jax.Array) -> jax.Array:
    """alpha * dCor(e, h) for e = wte[x] [B, T, d_e] and h [B, T, d], rows = positions.

    The embeddings are a fixed reference: the penalty should move h away from them, not
    drag the (tied) embedding matrix along.
    """
    e = jax.lax.stop_gradient(embeddings)
    return self.alpha * distance_correlation(e.reshape(-1, e.shape[-1]), h.reshape(-1, h.shape[-1]))
