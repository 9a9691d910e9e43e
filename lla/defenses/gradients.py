"""Defense on the backward message g = dL/dh [B, T, d]: per-row clipping plus Gaussian noise.

The mitigation of PROTOCOL section 7: every returned gradient row is clipped to L2 norm
C_g and receives N(0, (noise_multiplier * C_g)^2 I) noise. In training it sits at the cut as
an identity whose backward pass defends the cotangent (`guard_gradient`), so the client's
layers are fine-tuned from exactly the gradient that crossed the wire.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from lla.defenses.activations import clip_rows
from lla.defenses.base import RowwiseDefense, SecretKeys, apply, register


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class GradientClipNoise(RowwiseDefense):
  """g' = clip_C(g) + noise_multiplier * C * N(0, I), per row g[b, t].

  strength = noise_multiplier; at zero the mechanism is off, clipping included.
  Defaults are PROTOCOL section 7's [C_g = 0.01, std = 0.35 C_g].
  """

  name = "gradient_clip_noise"
  acts_on = "gradients"

  has_secret = True

  clip_norm: float = 0.01
  noise_multiplier: float = 0.35

  def __post_init__(self):
    if self.clip_norm <= 0:
      raise ValueError(f"clip_norm={self.clip_norm} must be > 0")
    if self.noise_multiplier < 0:
      raise ValueError(f"noise_multiplier={self.noise_multiplier} must be >= 0")

  @property
  def strength(self) -> float:
    return self.noise_multiplier

  def transform_document(self, x, persistent, key):
    del persistent
    std = self.noise_multiplier * self.clip_norm
    return clip_rows(x, self.clip_norm) + std * jax.random.normal(key, x.shape, x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def guard_gradient(defense: GradientClipNoise, h: jax.Array, keys: SecretKeys) -> jax.Array:
  """Identity on h [B, T, d] whose cotangent g is replaced by apply(defense, g, keys)."""
  del defense, keys
  return h


def _guard_fwd(defense, h, keys):
  del defense
  return h, keys


def _guard_bwd(defense, keys, g):
  # The keys are secret inputs, not parameters: no cotangent.
  return apply(defense, g, keys), None


guard_gradient.defvjp(_guard_fwd, _guard_bwd)
