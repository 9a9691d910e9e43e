"""The server's downstream part, linearised at the observed activations.

In training the server returns g = dL/dh for the loss L = mean over the N = batch_docs *
(T - 1) positions of the capture batch of CE(logits[t], x[t+1]). The logits do not depend
on the labels, and for soft labels Y (rows on the simplex) dCE/dlogits[t] = p[t] - Y[t+1].
So the gradient a label guess would produce is affine in Y:

    g(Y) = J(h)^T (mask(P) - shift(Y)) wte / N,

J(h) the Jacobian at h of `body` (blocks k..L-1, then ln_f: [T, d] -> [T, d]), P the
softmax of the logits at h, shift(Y)[t] = Y[t+1] for t < T-1 and 0 at T-1, mask(P) zero at
T-1 (the last position has no target), and wte the tied head. `linearize` evaluates the
body once per document with `jax.linearize`; afterwards each g(Y) is one transposed JVP
(a VJP through the body, no second-order autodiff) and the gradient of any loss of g(Y)
with respect to Y is one JVP. The head is kept outside J, so that a label guess enters
as Y wte ([T, d]), which also makes permuting label positions (LAMP) a row gather.

Shapes: B documents, T positions, d = n_embd, V vocabulary.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lla.model import cost
from lla.model import split
from lla.model.gpt2 import GPT2Config


def body(params, cfg: GPT2Config, h: jax.Array, k: int) -> jax.Array:
  """ln_f(blocks k..L-1(h)): h [B, T, d] -> [B, T, d]; logits are this times wte^T."""
  model = split.module(cfg)
  x = model.apply({"params": params}, h, k, cfg.n_layer, method="blocks")
  return model.apply({"params": params}, x, method=lambda m, y: m.ln_f(y)).astype(jnp.float32)


class Linearized(NamedTuple):
  """The downstream part of a chunk of documents, linearised at their activations.

  Attributes:
    base: [B, T, d] mask(P) wte, the label-independent part of the logits' cotangent
      projected through the head.
    jvp: the body's JVP at h, [B, T, d] -> [B, T, d] (a pytree: its residuals are leaves,
      so it passes between compiled steps without recomputing the forward).
  """

  base: jax.Array
  jvp: jax.tree_util.Partial


@functools.partial(jax.jit, static_argnames=("cfg", "k"))
def linearize(params, h: jax.Array, cfg: GPT2Config, k: int) -> Linearized:
  """Linearises the downstream part at h [B, T, d] (one forward through the body)."""
  x_f, jvp = jax.linearize(lambda h_: body(params, cfg, h_, k), h)
  wte = split.output_table(params)  # the output head (lm_head when untied)
  probs = jax.nn.softmax(jnp.einsum("btd,vd->btv", x_f, wte), axis=-1)
  base = jnp.einsum("btv,vd->btd", probs, wte).at[:, -1].set(0.0)
  return Linearized(base, jvp)


def shift_labels(projected: jax.Array) -> jax.Array:
  """[B, T, d] rows of Y wte -> row t holds row t+1 (the target of logits t); row T-1 zero."""
  return jnp.pad(projected[:, 1:], ((0, 0), (0, 1), (0, 0)))


def vjp(lin: Linearized, cotangent: jax.Array) -> jax.Array:
  """J^T applied to a [B, T, d] cotangent of the body's output (linear in it)."""
  transpose = jax.linear_transpose(lin.jvp, jax.ShapeDtypeStruct(cotangent.shape, jnp.float32))
  return transpose(cotangent)[0]


def gradient(lin: Linearized, projected_labels: jax.Array, norm: jax.Array) -> jax.Array:
  """g(Y) [B, T, d] for labels given as Y wte [B, T, d]; norm [B] = N of each document."""
  cotangent = (lin.base - shift_labels(projected_labels)) / norm[:, None, None]
  return vjp(lin, cotangent)


@jax.jit
def gradient_of_labels(lin: Linearized, wte: jax.Array, labels: jax.Array,
                       norm: jax.Array) -> jax.Array:
  """g(Y) [B, T, d] for soft labels Y [B, T, V] (rows summing to one)."""
  return gradient(lin, jnp.einsum("btv,vd->btd", labels, wte), norm)


def body_flops(cfg: GPT2Config, k: int, seq_len: int) -> float:
  """Matmul FLOPs of one document's forward through blocks k..L-1: per token and block
  every weight matrix (q, k, v, o, the MLP's) and attention 4 T H D
  (lla.model.cost.token_block_flops; GPT-2: qkv 6d^2, projection 2d^2, MLP 16d^2, 4Td)."""
  return float(cfg.n_layer - k) * seq_len * cost.token_block_flops(cfg, seq_len)


def linearize_flops(cfg: GPT2Config, k: int, seq_len: int) -> float:
  """One document's `linearize`: the body, logits (2TVd) and P wte (2TVd)."""
  return body_flops(cfg, k, seq_len) + 4.0 * seq_len * cfg.vocab_size * cfg.n_embd
