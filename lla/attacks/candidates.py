"""Candidate token sets for the beam search (PROTOCOL section 4).

All functions are batched over documents and positions. Sorting is stable: `lax.top_k`
returns equal values in index order, so ties go to the lower token id (or lower rank).
The vocabulary-wide rankings go through `lla_kernels.vocab_topk.topk`: on CPU the same
materialise-and-`lax.top_k` computation as ever (bit-identical), on GPU and TPU a Pallas
kernel that never materialises the [positions, V] scores. The kernel ranks the same scores
with the same tie-breaks; its tiled matmuls round differently from one large matmul, so
entries within float32 rounding of each other can swap (0.01% of positions at GPT-2's
shape in interpret mode: experiments/bench_kernels.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from lla_kernels import vocab_topk
from lla.attacks import ridge


def _nearest(e_hat: jax.Array, wte: jax.Array, num: int) -> jax.Array:
  return vocab_topk.topk(e_hat, wte, num, "neg_sq_dist")[1]


@functools.partial(jax.jit, static_argnames=("num",))
def nearest_tokens(wte: jax.Array, e_hat: jax.Array, num: int) -> jax.Array:
  """The `num` tokens with the smallest ||e_hat - wte[v]||^2, nearest first.

  Args:
    wte: [V, d] token embeddings.
    e_hat: [..., d] decoded embeddings.

  Returns:
    [..., num] int32 token ids.
  """
  return _nearest(e_hat, wte, num)


@functools.partial(jax.jit, static_argnames=("num",))
def decoded_nearest_tokens(weights, mu_h, mu_e, wte: jax.Array, h: jax.Array,
                           num: int) -> jax.Array:
  """`nearest_tokens` of the ridge decoding (h - mu_h) W + mu_e of h [..., d]."""
  return _nearest(ridge.decode_fn(weights, mu_h, mu_e, h), wte, num)


@functools.partial(jax.jit, static_argnames=("num",))
def gradient_ranked_tokens(wte: jax.Array, g: jax.Array, num: int) -> jax.Array:
  """Tokens ranked by the previous position's negative gradient, <-g[t-1], wte[v]>.

  Args:
    wte: [V, d] token embeddings.
    g: [B, T, d] backward message.

  Returns:
    [B, T, num] int32; row t ranks tokens for position t using g[t-1]. Row 0 has no
    previous gradient and is ranked from a zero score (lowest ids), never used by callers.
  """
  prev = jnp.pad(g[:, :-1], ((0, 0), (1, 0), (0, 0)))
  return vocab_topk.topk(prev, wte, num, "neg_dot")[1]


def _first_absent(ranked: jax.Array, present: jax.Array, num: int) -> jax.Array:
  """First `num` entries of ranked [..., R] that are not in present [..., P], in order."""
  duplicate = jnp.any(ranked[..., :, None] == present[..., None, :], axis=-1)
  order = jnp.argsort(duplicate, axis=-1, stable=True)
  return jnp.take_along_axis(ranked, order, axis=-1)[..., :num]


@functools.partial(jax.jit, static_argnames=("c_a", "c_g"))
def joint_candidates(activation_ranked: jax.Array, gradient_ranked: jax.Array, c_a: int,
                     c_g: int) -> jax.Array:
  """Joint candidate sets [B, T, c_a + c_g].

  Position 0: the first c_a + c_g activation candidates. Position t >= 1: the first c_a
  activation candidates, then the best-ranked gradient tokens not already among them.

  Args:
    activation_ranked: [B, T, >= c_a + c_g] activation candidates, nearest first.
    gradient_ranked: [B, T, >= c_a + c_g] gradient ranking (at most c_a can be duplicates).
  """
  activation_part = activation_ranked[..., :c_a]
  gradient_part = _first_absent(gradient_ranked[..., :c_a + c_g], activation_part, c_g)
  later = jnp.concatenate([activation_part, gradient_part], axis=-1)
  return later.at[:, 0].set(activation_ranked[:, 0, :c_a + c_g])


@functools.partial(jax.jit, static_argnames=("c_a", "c_g", "vocab_size"))
def random_fill_candidates(key: jax.Array, activation_ranked: jax.Array, doc_index: jax.Array,
                           c_a: int, c_g: int, vocab_size: int) -> jax.Array:
  """The random-candidate control: gradient slots filled with uniform random tokens.

  Each (document, position >= 1) draws c_g distinct tokens uniformly from those not among
  its first c_a activation candidates (Gumbel top-k over the allowed tokens). Position 0
  uses c_a + c_g activation candidates, like the joint attack.

  Args:
    key: the control's seed key.
    activation_ranked: [B, T, >= c_a + c_g].
    doc_index: [B] int each document's index in the capture; its draw uses
      fold_in(key, index), so it does not depend on how documents are batched.
  """
  activation_part = activation_ranked[..., :c_a]
  t = activation_part.shape[1]
  draw = lambda i: jax.random.gumbel(jax.random.fold_in(key, i), (t, vocab_size))
  gumbel = jax.vmap(draw)(doc_index)
  present = jnp.zeros(gumbel.shape, jnp.bool_)
  present = jax.vmap(jax.vmap(lambda row, ids: row.at[ids].set(True)))(present, activation_part)
  random_part = jax.lax.top_k(jnp.where(present, -jnp.inf, gumbel), c_g)[1].astype(jnp.int32)
  later = jnp.concatenate([activation_part, random_part], axis=-1)
  return later.at[:, 0].set(activation_ranked[:, 0, :c_a + c_g])


def derangement(num: int, seed: int) -> np.ndarray:
  """A seeded permutation of range(num) with no fixed point (Sattolo's random cycle)."""
  if num < 2:
    raise ValueError(f"a derangement needs at least 2 documents, got {num}")
  perm = np.arange(num)
  rng = np.random.default_rng(seed)
  for i in range(num - 1, 0, -1):
    j = int(rng.integers(0, i))
    perm[i], perm[j] = perm[j], perm[i]
  return perm


def candidate_flops(num_positions: int, vocab_size: int, d: int) -> float:
  """Distances of num_positions vectors to the whole vocabulary."""
  return 2.0 * num_positions * vocab_size * d
