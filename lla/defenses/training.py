"""The split model's fine-tuning objective and boundary messages with a defense in the loop.

Per defense kind, what crosses the cut and what the client minimises:
  * "activations": the server sees h' = defense(h); the loss is the server's next-token CE
    on h' (for `mixup`, against the mixed labels: see `mixed_next_token_loss`);
  * "gradients": the server sees h and returns g' = defense(g); in training an identity
    at the cut (`guard_gradient`) swaps the cotangent g for g', so the client's layers learn
    from the defended gradient while the server's own layers get their exact gradient;
  * "training" (`nopeek`): messages are untouched; the client adds alpha * dCor(wte[x], h).
`defense` is a static argument (frozen dataclass): jit/grad callers must close over it or
mark it static. Zero strength gives exactly the undefended loss, gradients and messages.
"""

from __future__ import annotations

import dataclasses

import functools

import jax
import jax.numpy as jnp

from lla.defenses.activations import SecretMixup
from lla.defenses.base import Defense
from lla.defenses.gradients import guard_gradient
from lla.defenses.nopeek import NoPeek
from lla.model import split
from lla.model.gpt2 import GPT2Config


def mixed_next_token_loss(logits: jax.Array, tokens: jax.Array, lam: jax.Array,
                          partners: jax.Array) -> jax.Array:
  """mean_{b, t < T-1} sum_j lam[b, j] CE(logits[b, t], tokens[partners[b, j], t + 1]).

  logits [B, T, V], tokens [B, T], lam [B, m], partners [B, m]. With m = 1 and
  partners = b it is `split.next_token_loss`.
  """
  log_probs = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
  targets = tokens[partners][:, :, 1:]  # [B, m, T-1]
  picked = jnp.take_along_axis(log_probs[:, None], targets[..., None], axis=-1)[..., 0]
  return -jnp.einsum("bj,bjt->", lam, picked) / (logits.shape[0] * (logits.shape[1] - 1))


def _wire_and_server_loss(params, cfg, h, tokens, k, defense, key):
  """(h on the wire [B, T, d], the server's loss as a function of the wire message)."""
  if defense.off or defense.acts_on != "activations":
    wire = h
    loss_of_wire = lambda w: split.server_loss(params, cfg, w, tokens, k)[0]
  elif isinstance(defense, SecretMixup):
    wire, lam, partners = defense.mix(h, key)
    loss_of_wire = lambda w: mixed_next_token_loss(
        split.server_loss(params, cfg, w, tokens, k)[1], tokens, lam, partners)
  else:
    wire = defense.transform(h, key)
    loss_of_wire = lambda w: split.server_loss(params, cfg, w, tokens, k)[0]
  return wire, loss_of_wire


def defended_loss(model_params, cfg: GPT2Config, tokens: jax.Array, k: int,
                  defense: Defense, key: jax.Array) -> jax.Array:
  """The scalar the client and server jointly minimise; differentiate w.r.t. model_params.

  tokens [B, T] int; `key` is the step's key (`defense.step_key(step)` in a real run).
  The loss is the mean over B * (T - 1) positions, so the cotangent reaching the cut is
  the protocol's g (a caller that rescales the loss rescales what the gradient defense
  clips: clip_norm is calibrated for the unscaled mean).
  """
  h = split.client(model_params, cfg, tokens, k)
  wire, loss_of_wire = _wire_and_server_loss(model_params, cfg, h, tokens, k, defense, key)
  if not defense.off and defense.acts_on == "gradients":
    wire = guard_gradient(defense, wire, key)
  loss = loss_of_wire(wire)
  if not defense.off and isinstance(defense, NoPeek):
    loss = loss + defense.penalty(split.wte(model_params)[tokens], h)
  return loss


@functools.partial(jax.jit, static_argnames=("cfg", "k", "defense"))
def defended_messages(params, cfg: GPT2Config, tokens: jax.Array, k: int, defense: Defense,
                      key: jax.Array):
  """What crosses the cut in one defended training step: (h' [B, T, d], g' [B, T, d]).

  h' is the defended forward message; g' = d(server loss)/dh' (mixed labels for mixup),
  then defended if the defense acts on gradients. The NoPeek penalty is the client's own
  term and never crosses the wire. Same key, same secrets as `defended_loss`.
  """
  h = split.client(params, cfg, tokens, k)
  wire, loss_of_wire = _wire_and_server_loss(params, cfg, h, tokens, k, defense, key)
  g = jax.grad(loss_of_wire)(wire)
  if not defense.off and defense.acts_on == "gradients":
    g = defense.transform(g, key)
  return wire, g


@dataclasses.dataclass(frozen=True)
class DefendedStepLoss:
  """`defended_loss` as a training loop's `loss_fn(params, cfg, tokens, step)`.

  Frozen and hashable, so compiled training steps are cached per (defense, cut).
  """

  defense: Defense
  k: int

  def __call__(self, params, cfg: GPT2Config, tokens: jax.Array, step: jax.Array) -> jax.Array:
    key = self.defense.step_key(step) if self.defense.has_secret else None
    return defended_loss(params, cfg, tokens, self.k, self.defense, key)
