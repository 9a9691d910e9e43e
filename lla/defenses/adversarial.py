"""Adversarial training: the client fine-tuned against an inverter it trains at the same time.

Source: VFLAIR-LLM (Gu et al., KDD 2025), its AdversarialTraining defense: an "imagined
adversary" (src/models/imagined_adversary_models.py, `ImaginedAdversary_MLP3_noflatten`: per
position Linear(d, H) -> LayerNorm -> ReLU -> Linear(H, H) -> LayerNorm -> ReLU -> Linear(H,
d)) learns to map the client's output back to the input embeddings, and the client is
updated to keep the task loss low while that inverter fails (the min-max of adversarial
representation learning; Xie et al., NeurIPS 2017). With e = wte[x] [B, T, d] and the
client's h [B, T, d]:

  L_inv(phi, h) = mean over the B * T positions of ||A_phi(h_t) - e_t||^2,
  the inverter:  min_phi L_inv(phi, h),
  the client:    min_theta CE(server(h)) - alpha * L_inv(phi, h).

Both updates come from one gradient: the inverter reads h through a gradient-reversal
identity (Ganin & Lempitsky, ICML 2015), forward h, backward -alpha * cotangent, so the loss
CE + L_inv(phi, reverse_alpha(h)) gives phi the gradient of L_inv and theta that of
CE - alpha * L_inv (simultaneous updates; VFLAIR alternates them within a step). Departures
from VFLAIR, and why: the client's own layers play the role of its separate mapping layer
(lla's client trains: "trained" knowledge), the output Sigmoid is dropped (the targets are
embeddings, not values in [0, 1]), the LayerNorms carry no affine parameters, and VFLAIR's
mapping-distance term (weighted by its lambda, it keeps the mapping near identity) is absent
because there is no separate mapping.

The server sees h as the client computes it ("training": the messages are untouched, the
defense is in the weights). The inverter's weights, initialised from the defender's secret
(`init_weights`), train under params[PARAMS_KEY] and are kept by the defender beside the
checkpoint like MID's (`lla.train.finetune`); the capture does not read them.

strength = alpha; alpha = 0 is the undefended fine-tune bit for bit (no inverter).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp

from lla.defenses import mid
from lla.defenses.base import Defense, Secret, register
from lla.model import split

PARAMS_KEY = "adversary"


def init_weights(key: jax.Array, d: int, hidden: int) -> dict:
  """The inverter at initialisation: Dense layers with LeCun-normal kernels, zero biases."""
  keys = jax.random.split(key, 3)
  dense = lambda k, n, m: {"kernel": jax.random.normal(k, (n, m), jnp.float32) / jnp.sqrt(n),
                           "bias": jnp.zeros((m,), jnp.float32)}
  return {"in": dense(keys[0], d, hidden), "mid": dense(keys[1], hidden, hidden),
          "out": dense(keys[2], hidden, d)}


def _layer_norm(x: jax.Array) -> jax.Array:
  mean = x.mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)


def invert(weights: dict, h: jax.Array) -> jax.Array:
  """The inverter's embedding estimate [..., d] of h [..., d]."""
  dense = lambda p, x: x @ p["kernel"] + p["bias"]
  x = jax.nn.relu(_layer_norm(dense(weights["in"], h.astype(jnp.float32))))
  x = jax.nn.relu(_layer_norm(dense(weights["mid"], x)))
  return dense(weights["out"], x)


def inverter_loss(weights: dict, h: jax.Array, embeddings: jax.Array) -> jax.Array:
  """L_inv: mean over positions of the squared error of the inverter's estimate, [B, T, d]."""
  return jnp.mean(jnp.sum((invert(weights, h) - embeddings) ** 2, axis=-1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def reverse_gradient(x: jax.Array, scale: float) -> jax.Array:
  """Identity forward; the cotangent times -scale backward."""
  return x


def _reverse_fwd(x, scale):
  return x, None


def _reverse_bwd(scale, _, cotangent):
  return (-scale * cotangent,)


reverse_gradient.defvjp(_reverse_fwd, _reverse_bwd)


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Adversarial(Defense):
  """Adversarial training against a jointly trained inverter; strength = alpha."""

  name = "adversarial"
  acts_on = "training"
  # The inverter's initialisation is the defender's randomness.
  has_secret = True
  params_key: ClassVar[str] = PARAMS_KEY
  save_weights = staticmethod(mid.save_weights)
  load_weights = staticmethod(mid.load_weights)

  alpha: float
  hidden: int = 200  # VFLAIR-LLM's ImaginedAdversary_MLP3_noflatten width

  def __post_init__(self):
    if not self.alpha >= 0:
      raise ValueError(f"alpha={self.alpha} must be >= 0")
    if self.hidden < 1:
      raise ValueError(f"hidden={self.hidden} must be >= 1")

  @property
  def strength(self) -> float:
    return self.alpha

  def init_weights(self, cfg, secret: Secret) -> dict:
    return init_weights(secret.keys(self.name).persistent, cfg.n_embd, self.hidden)

  def penalty(self, params, tokens: jax.Array, h: jax.Array) -> jax.Array:
    """L_inv(phi, reverse_alpha(h)) for tokens [B, T] and the client's h [B, T, d]: the
    inverter descends L_inv, the client ascends alpha * L_inv (module docstring)."""
    e = jax.lax.stop_gradient(split.input_table(params)[tokens])
    return inverter_loss(params[PARAMS_KEY], reverse_gradient(h, self.alpha), e)
