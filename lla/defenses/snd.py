"""Split-and-Denoise (SnD): d_chi noise on the input embeddings, a client-side denoiser.

Source: P. Mai, R. Yan, Z. Huang, Y. Yang, Y. Pang, "Split-and-Denoise: Protect large
language model inference with local differential privacy", ICML 2024 (arXiv 2310.09130).
The client perturbs its token embeddings with d_chi-privacy noise (Feyisetan et al., WSDM
2020), e'_t = clip(e_t) + z_t with p(z) proportional to exp(-epsilon ||z||) (optional row
clipping to `clip_norm`, the paper's bound on the embeddings' norm), sends the result to the
server, and denoises what the server returns with a small network of its own, trained on
its own data to map (noisy output, noise) to the clean output.

What the server observes in lla's split: the client runs its k blocks on e' and sends h =
blocks[0..k-1](e' + positions) (`lla.defenses.training.defended_client`), exactly as for
`dx_privacy` without projection (and with clipping where `clip_norm` is set); the noise
sampler is dx_privacy's (`dx_noise`). The denoiser never touches h: it changes utility only,
so the attacks that fit `dx_privacy` (`dx_privacy_adaptive`) fit `snd` unchanged.

What the denoiser acts on in lla's split: the server runs blocks k..L-1 and, in lla, also
the final norm and the head. SnD's server returns its last hidden state; here the client
takes that state o~ [B, T, d] (the output of the last block, before the final norm), computes
o_hat = o~ + D([o~_t, z_t]) position by position (D a two-layer GELU MLP of width
`width`, residual, zero-initialised output so D starts as the identity), then the final
norm and the head. SnD's denoiser is a transformer over the sequence with the noisy
input embeddings as a further input; this one is per position (a simplification: noise at
earlier positions reaches o~_t through attention and is seen only through o~_t).
D is trained by the client on documents of its own (in the main job its fine-tuning split;
`client_cross_entropy`, which the held-out utility calls) by Adam on
mean_t ||o_hat_t - o_t||^2, o the model's last hidden state on the clean embeddings, with
fresh noise every step (the paper's training on (noisy output, noise, clean output)
triples).

strength = 1 / epsilon; epsilon = None is the undefended client (no noise, no clipping, no
denoiser): the defended forward is the undefended one bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lla.defenses.activations import clip_rows
from lla.defenses.base import Defense, Secret, SecretKeys, register
from lla.defenses.dx_privacy import dx_noise
from lla.model import split


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class SplitAndDenoise(Defense):
  """e' = clip(e) + z, p(z) ~ exp(-epsilon ||z||), per input position (the server's view);
  the client's denoiser acts on the server's output. See the module docstring."""

  name = "snd"
  acts_on = "embeddings"
  has_secret = True

  epsilon: float | None
  clip_norm: float | None = None
  # The client's denoiser (`train_denoiser`): hidden width, Adam steps and learning rate,
  # and the seed of its initialisation and batch order; public, in E like epsilon.
  denoiser_width: int = 64
  denoiser_steps: int = 150
  denoiser_lr: float = 3e-3
  denoiser_seed: int = 0

  def __post_init__(self):
    if self.epsilon is not None and not self.epsilon > 0:
      raise ValueError(f"epsilon={self.epsilon} must be > 0 (None: no noise)")
    if self.clip_norm is not None and not self.clip_norm > 0:
      raise ValueError(f"clip_norm={self.clip_norm} must be > 0 (None: no clipping)")
    if not (self.denoiser_width >= 1 and self.denoiser_steps >= 0 and self.denoiser_lr > 0):
      raise ValueError(f"denoiser_width={self.denoiser_width}, denoiser_steps="
                       f"{self.denoiser_steps}, denoiser_lr={self.denoiser_lr}: need a width "
                       ">= 1, steps >= 0 and a positive learning rate")

  @property
  def strength(self) -> float:
    return 0.0 if self.epsilon is None else 1.0 / self.epsilon

  def clean_rows(self, e: jax.Array) -> jax.Array:
    """The rows the noise is added to: e [..., d] clipped to `clip_norm` where set."""
    return e if self.clip_norm is None else clip_rows(e, self.clip_norm)

  def noise(self, shape: tuple[int, ...], keys: SecretKeys) -> jax.Array:
    """z [B, T, d] of this step (the draw `noisy_inputs` adds; the denoiser's input)."""
    return dx_noise(keys.step, shape, self.epsilon)

  def transform(self, x: jax.Array, keys: SecretKeys | None) -> jax.Array:
    """e [B, T, d] -> clip(e) + z."""
    return self.clean_rows(x) + self.noise(x.shape, keys).astype(x.dtype)

  def noisy_inputs(self, table: jax.Array, tokens: jax.Array, keys: SecretKeys) -> jax.Array:
    """What the client's block 0 receives before positions: tokens [B, T] -> e' [B, T, d]."""
    return self.transform(table[tokens], keys)

  def client_cross_entropy(self, params, cfg, tokens, k: int, secret: Secret | None, *,
                           client_tokens, batch_size: int, first_step: int) -> np.ndarray:
    """Held-out CE [N] of the SnD client: its denoiser trained on its own documents
    client_tokens [M, T] (`train_denoiser` at this defense's public settings), then the
    head on the denoised server output (`corpus_cross_entropy`). Off: the undefended CE."""
    if self.off:
      return corpus_cross_entropy(params, cfg, tokens, k, self, None, None, batch_size,
                                  first_step)
    if client_tokens is None:
      raise ValueError("snd's utility needs the client's own documents to train its "
                       "denoiser on (client_tokens)")
    denoiser, _ = train_denoiser(params, cfg, np.asarray(client_tokens), k, self, secret,
                                 width=self.denoiser_width, steps=self.denoiser_steps,
                                 lr=self.denoiser_lr, batch_size=batch_size,
                                 seed=self.denoiser_seed)
    return corpus_cross_entropy(params, cfg, tokens, k, self, secret, denoiser, batch_size,
                                first_step)


def init_denoiser(key: jax.Array, d: int, width: int) -> dict:
  """D's weights: [2d -> width] (LeCun normal), GELU, [width -> d] at zero (D = identity)."""
  return {"w1": jax.random.normal(key, (2 * d, width), jnp.float32) / np.sqrt(2 * d),
          "b1": jnp.zeros((width,), jnp.float32),
          "w2": jnp.zeros((width, d), jnp.float32), "b2": jnp.zeros((d,), jnp.float32)}


def denoise(denoiser: dict, noisy: jax.Array, noise: jax.Array) -> jax.Array:
  """o_hat = o~ + MLP([o~, z]): noisy, noise [..., d] -> [..., d]."""
  hidden = jax.nn.gelu(jnp.concatenate([noisy, noise], -1) @ denoiser["w1"] + denoiser["b1"])
  return noisy + hidden @ denoiser["w2"] + denoiser["b2"]


def _last_hidden(params, cfg, h: jax.Array, k: int) -> jax.Array:
  """The server's blocks k..L-1 on h [B, T, d] (what SnD's server returns)."""
  return split.module(cfg).apply({"params": params}, h, k, cfg.n_layer, method="blocks")


def _logits(params, cfg, o: jax.Array) -> jax.Array:
  return split.module(cfg).apply({"params": params}, o, method="head")


def _noisy_and_clean(params, cfg, tokens, k, defense: SplitAndDenoise, keys: SecretKeys):
  """(o~ [B, T, d] from the noisy embeddings, z [B, T, d], o [B, T, d] from the clean ones)."""
  e = split.input_table(params)[tokens]
  z = defense.noise(e.shape, keys)
  noisy = split.client_from_embeddings(params, cfg, defense.clean_rows(e) + z, k)
  clean = split.client(params, cfg, tokens, k)
  return _last_hidden(params, cfg, noisy, k), z, _last_hidden(params, cfg, clean, k)


@functools.partial(jax.jit, static_argnames=("cfg", "k", "defense", "lr"))
def _train_step(params, denoiser, opt_state, tokens, keys, *, cfg, k, defense, lr):
  noisy, z, clean = _noisy_and_clean(params, cfg, tokens, k, defense, keys)
  loss_fn = lambda p: jnp.mean(jnp.sum((denoise(p, noisy, z) - clean) ** 2, -1))
  loss, grad = jax.value_and_grad(loss_fn)(denoiser)
  updates, opt_state = optax.adam(lr).update(grad, opt_state, denoiser)
  return optax.apply_updates(denoiser, updates), opt_state, loss


def train_denoiser(params, cfg, tokens: np.ndarray, k: int, defense: SplitAndDenoise,
                   secret: Secret, *, width: int, steps: int, lr: float, batch_size: int,
                   seed: int, first_step: int = 1 << 26) -> tuple[dict, np.ndarray]:
  """The client's denoiser, trained on its own documents tokens [N, T].

  Step s draws batch s of a seeded permutation (numpy PCG64 from `seed`) and the client's
  noise of step first_step + s (its own secret, as in deployment; far from the steps of
  training, utility (1 << 20) and the main job's captures (1 << 24)). D's initial weights
  come from jax.random.key(seed).
  Returns (the denoiser's weights, the loss of every step [steps]).
  """
  rng = np.random.Generator(np.random.PCG64(seed))
  denoiser = init_denoiser(jax.random.key(seed), cfg.n_embd, width)
  opt_state = optax.adam(lr).init(denoiser)
  losses = []
  order = np.zeros(0, np.int64)
  for s in range(steps):
    if len(order) < batch_size:
      order = np.concatenate([order, rng.permutation(len(tokens))])
    batch, order = order[:batch_size], order[batch_size:]
    denoiser, opt_state, loss = _train_step(
        params, denoiser, opt_state, jnp.asarray(tokens[batch]),
        secret.keys(defense.name, first_step + s), cfg=cfg, k=k, defense=defense, lr=lr)
    losses.append(loss)
  return denoiser, np.asarray(jnp.stack(losses)) if losses else np.zeros(0)


@functools.partial(jax.jit, static_argnames=("cfg", "k", "defense"))
def document_cross_entropy(params, cfg, tokens: jax.Array, k: int, defense: SplitAndDenoise,
                           keys: SecretKeys | None, denoiser: dict | None) -> jax.Array:
  """Per-document mean next-token CE [B] of what the SnD client predicts, tokens [B, T]:
  the head on the denoised server output (no denoiser: on the noisy one). Off: the
  undefended split model, as `lla.defenses.utility.document_cross_entropy` computes it."""
  if defense.off:
    o = _last_hidden(params, cfg, split.client(params, cfg, tokens, k), k)
  else:
    e = split.input_table(params)[tokens]
    z = defense.noise(e.shape, keys)
    h = split.client_from_embeddings(params, cfg, defense.clean_rows(e) + z, k)
    o = _last_hidden(params, cfg, h, k)
    if denoiser is not None:
      o = denoise(denoiser, o, z)
  logits = _logits(params, cfg, o)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
  return ce.mean(axis=1)


def corpus_cross_entropy(params, cfg, tokens, k: int, defense: SplitAndDenoise,
                         secret: Secret | None, denoiser: dict | None, batch_size: int = 32,
                         first_step: int = 1 << 20) -> np.ndarray:
  """Per-document CE [N] over tokens [N, T]; batch i draws the noise of step first_step + i
  (`lla.defenses.utility.heldout_utility`'s default first step for held-out documents)."""
  tokens = np.asarray(tokens)
  out = [document_cross_entropy(
      params, cfg, jnp.asarray(tokens[i:i + batch_size]), k, defense,
      None if defense.off else secret.keys(defense.name, first_step + i // batch_size),
      denoiser) for i in range(0, len(tokens), batch_size)]
  return np.concatenate([np.asarray(x, np.float64) for x in out])
