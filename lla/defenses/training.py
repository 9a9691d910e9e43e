"""The split model's fine-tuning objective and boundary messages with a defense in the loop.

Per defense kind, what crosses the cut and what the client minimises:
  * "activations": the server sees h' = defense(h); the loss is the server's next-token CE
    on h' (for `mixup`, against the mixed labels: see `mixed_next_token_loss`);
  * "gradients": the server sees h and returns g' = defense(g); in training an identity
    at the cut (`guard_gradient`) swaps the cotangent g for g', so the client's layers learn
    from the defended gradient while the server's own layers get their exact gradient;
  * "embeddings" (`dx_privacy`): the client's blocks run on the defended input embeddings
    (`defended_client`); h is what they compute, and the loss the server's CE on it;
  * "training" (`nopeek`): messages are untouched; the client adds alpha * dCor(wte[x], h);
  * "training" (`adversarial`): messages are untouched; the client adds the loss of an
    inverter it trains at once, through a gradient reversal (`Adversarial.penalty`);
  * `mid` (acts on "activations" with trained weights of its own, in params["mid"]): the
    server sees the bottleneck's sample h' (`forward_message`); the client adds lambda * KL.
`defense` (public parameters only, a frozen dataclass) is a static argument; the secret
enters as traced `SecretKeys`, so one mechanism configuration compiles once for every
secret. Zero strength gives exactly the undefended loss, gradients and messages.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from lla.defenses.activations import SecretMixup
from lla.defenses.adversarial import Adversarial
from lla.defenses.base import Defense, DefenseError, Secret, SecretKeys, apply, step_keys
from lla.defenses.gradients import guard_gradient
from lla.defenses.mid import Mid
from lla.defenses.nopeek import NoPeek
from lla.model import layer_stack
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


def defended_client(params, cfg: GPT2Config, tokens: jax.Array, k: int,
                    defense: Defense | None, keys: SecretKeys | None) -> jax.Array:
  """h [B, T, d] the client computes: `split.client`, except that a defense on the input
  embeddings (acts_on "embeddings") replaces input_table[tokens] before block 0."""
  if defense is None or defense.off or defense.acts_on != "embeddings":
    return split.client(params, cfg, tokens, k)
  e = defense.noisy_inputs(split.input_table(params), tokens, keys)
  return split.client_from_embeddings(params, cfg, e, k)


def forward_message(params, h: jax.Array, defense: Defense | None,
                    keys: SecretKeys | None) -> jax.Array:
  """h' [B, T, d] the server receives for the client's h: `apply`, except for a defense with
  trained weights of its own in `params` (mid), which its `wire` applies."""
  if defense is not None and not defense.off and isinstance(defense, Mid):
    return defense.wire(params, h, keys)
  return h if defense is None else apply(defense, h, keys)


def _wire_and_server_loss(params, cfg, h, tokens, k, defense, keys):
  """(h on the wire [B, T, d], the server's loss as a function of the wire message)."""
  if defense.off or defense.acts_on != "activations":
    wire = h
    loss_of_wire = lambda w: split.server_loss(params, cfg, w, tokens, k)[0]
  elif isinstance(defense, SecretMixup):
    wire, lam, partners = defense.mix(h, keys.step)
    loss_of_wire = lambda w: mixed_next_token_loss(
        split.server_loss(params, cfg, w, tokens, k)[1], tokens, lam, partners)
  elif isinstance(defense, Mid):
    wire = defense.wire(params, h, keys)
    loss_of_wire = lambda w: split.server_loss(params, cfg, w, tokens, k)[0]
  else:
    wire = defense.transform(h, keys)
    loss_of_wire = lambda w: split.server_loss(params, cfg, w, tokens, k)[0]
  return wire, loss_of_wire


def defended_loss(model_params, cfg: GPT2Config, tokens: jax.Array, k: int,
                  defense: Defense, keys: SecretKeys | None) -> jax.Array:
  """The scalar the client and server jointly minimise; differentiate w.r.t. model_params.

  tokens [B, T] int; `keys` are the step's secret keys (`secret.keys(name, step)`; None for
  a defense without secrets).
  The loss is the mean over B * (T - 1) positions, so the cotangent reaching the cut is
  the protocol's g (a caller that rescales the loss rescales what the gradient defense
  clips: clip_norm is calibrated for the unscaled mean).
  """
  h = defended_client(model_params, cfg, tokens, k, defense, keys)
  wire, loss_of_wire = _wire_and_server_loss(model_params, cfg, h, tokens, k, defense, keys)
  if not defense.off and defense.acts_on == "gradients":
    wire = guard_gradient(defense, wire, keys)
  loss = loss_of_wire(wire)
  if not defense.off and isinstance(defense, NoPeek):
    loss = loss + defense.penalty(split.wte(model_params)[tokens], h)
  if not defense.off and isinstance(defense, Mid):
    loss = loss + defense.penalty(model_params, h)
  if not defense.off and isinstance(defense, Adversarial):
    loss = loss + defense.penalty(model_params, tokens, h)
  return loss


@functools.partial(jax.jit, static_argnames=("cfg", "k", "defense"))
def defended_messages(params, cfg: GPT2Config, tokens: jax.Array, k: int, defense: Defense,
                      keys: SecretKeys | None):
  """What crosses the cut in one defended training step: (h' [B, T, d], g' [B, T, d]).

  h' is the defended forward message; g' = d(server loss)/dh' (mixed labels for mixup),
  then defended if the defense acts on gradients. The NoPeek penalty is the client's own
  term and never crosses the wire. Same keys, same secrets as `defended_loss`.
  """
  h = defended_client(params, cfg, tokens, k, defense, keys)
  wire, loss_of_wire = _wire_and_server_loss(params, cfg, h, tokens, k, defense, keys)
  g = jax.grad(loss_of_wire)(wire)
  if not defense.off and defense.acts_on == "gradients":
    g = defense.transform(g, keys)
  return wire, g


def check_capturable(defense: Defense, secret: Secret | None, training: bool,
                     fine_tuned: bool = False) -> None:
  """Raises DefenseError (one line) if `defense` cannot defend a capture of this kind: it
  draws secrets and has none, it acts on the returned gradient of an inference capture, or
  it acts through fine-tuning (its effect is in the weights, not the messages) and the
  model was not fine-tuned with it."""
  if defense.off:
    return
  if defense.has_secret and secret is None:
    raise DefenseError(f"defense {defense.name!r} draws secrets: it needs a Secret")
  if defense.acts_on == "training" and not fine_tuned:
    raise DefenseError(f"defense {defense.name!r} acts through fine-tuning and leaves the "
                       "messages alone: capture a model fine-tuned with it instead")
  if defense.acts_on == "gradients" and not training:
    raise DefenseError(f"defense {defense.name!r} acts on the returned gradient, which an "
                       "inference capture (training=False) does not have")


def batched_messages(params, cfg: GPT2Config, tokens: np.ndarray, k: int, defense: Defense,
                     secret: Secret | None, batch_size: int, training: bool,
                     first_step: int = 0, fine_tuned: bool = False):
  """What crosses the cut for tokens [N, T], one batch of `batch_size` at a time: (h' [N, T,
  d], g' [N, T, d] or None for an inference capture). Batch i uses the secret's keys of
  step first_step + i, so every batch draws fresh randomness. `fine_tuned`: `params` were
  fine-tuned with the defense in the loop (what a training-time defense needs).

  Raises:
    DefenseError: see `check_capturable`.
  """
  check_capturable(defense, secret, training, fine_tuned)
  # The layers stacked for this capture (lla.capture.capture.boundary_messages_batched).
  params = layer_stack.stack(params, cfg.n_layer)
  hs, gs = [], []
  for step, start in enumerate(range(0, tokens.shape[0], batch_size)):
    batch = jnp.asarray(tokens[start:start + batch_size])
    keys = secret.keys(defense.name, first_step + step) if defense.has_secret else None
    if training:
      h, g = defended_messages(params, cfg, batch, k, defense, keys)
      gs.append(np.asarray(g, np.float32))
    else:
      h = forward_message(params, defended_client(params, cfg, batch, k, defense, keys),
                          defense, keys)
    hs.append(np.asarray(h, np.float32))
  return np.concatenate(hs), (np.concatenate(gs) if training else None)


@dataclasses.dataclass(frozen=True)
class DefendedStepLoss:
  """`defended_loss` as a training loop's `loss_fn(params, cfg, tokens, step, root_keys)`.

  Frozen and hashable (public parameters only), so compiled training steps are cached per
  (mechanism configuration, cut); the secret's root keys (`secret.root_keys(name)`) are the
  loop's traced `loss_inputs`, and step `step` uses `step_keys(root_keys, step)`.
  """

  defense: Defense
  k: int

  def __call__(self, params, cfg: GPT2Config, tokens: jax.Array, step: jax.Array,
               root_keys: SecretKeys | None = None) -> jax.Array:
    keys = None if root_keys is None else step_keys(root_keys, step)
    return defended_loss(params, cfg, tokens, self.k, self.defense, keys)
