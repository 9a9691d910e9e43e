"""Activation-matching beam search (PROTOCOL section 4), KV-cached and vmapped.

For each document, beams hold a prefix, its client KV cache and a score. At position t
every (beam, candidate) pair runs one cached client step; its cost is
`||client(prefix + [c])[t] - h[t]||^2`, added to the beam's score, and the W lowest totals
survive. Pairs are flattened beam-major (`w * C + c`) and `lax.top_k` is stable, so ties
go to the lower beam index (beams are kept sorted, best first), then the lower candidate
rank. Position 0 is the same step from one empty beam: the other W-1 start at +inf.
Documents that start with a public token (a BOS, `prefix`) start the search after it: the
prefix runs as that step with the one known candidate, so the beams begin from its cache.

One step is one position for all documents, vmapped over documents, beams and
candidates, so each block's matmuls run as `[docs * W * C, d] x [d, 4d]` GEMMs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lla.attacks import workspace
from lla.model import cost
from lla.model import split
from lla.model.gpt2 import GPT2Config


def _doc_step(params, cfg: GPT2Config, carry, position):
  """One position of one document's beam search.

  Args:
    carry: (cache [W, k, 2, T, H, D], tokens [W, T] int32, scores [W] float32).
    position: (t scalar, candidates [C] int32, target h_t [d]).
  """
  cache, tokens, scores = carry
  t, candidates, target = position
  width, num_candidates = scores.shape[0], candidates.shape[0]

  def expand(beam_cache):
    step = lambda token: split.client_step_kv(params, cfg, beam_cache, token, t)
    return jax.vmap(step)(candidates)

  h, kv = jax.vmap(expand)(cache)                      # [W, C, d], [W, C, k, 2, H, D]
  cost = jnp.sum((h - target) ** 2, axis=-1)           # [W, C]
  total = (scores[:, None] + cost).reshape(-1)         # beam-major
  neg_best, flat = jax.lax.top_k(-total, width)
  beam, rank = flat // num_candidates, flat % num_candidates
  new_cache = jax.vmap(split.write_cache, in_axes=(0, 0, None))(cache[beam], kv[beam, rank], t)
  new_tokens = tokens[beam].at[:, t].set(candidates[rank])
  return (new_cache, new_tokens, -neg_best), None


def _init_carry(cfg: GPT2Config, k: int, width: int, seq_len: int):
  cache = jnp.zeros((width, k, 2, seq_len, cfg.n_kv_head, cfg.head_dim), jnp.float32)
  tokens = jnp.zeros((width, seq_len), jnp.int32)
  scores = jnp.full((width,), jnp.inf, jnp.float32).at[0].set(0.0)
  return cache, tokens, scores


@functools.partial(jax.jit, static_argnames=("cfg", "k", "width"))
def start(target: jax.Array, cfg: GPT2Config, k: int, width: int):
  """The empty search state of every document: (cache, tokens, scores), batched over
  the documents of target [B, T, d]."""
  seq_len = target.shape[1]
  return jax.vmap(lambda _: _init_carry(cfg, k, width, seq_len))(target[:, 0, 0])


@functools.partial(jax.jit, static_argnames=("cfg",))
def step(params, state, t: jax.Array, candidates_t: jax.Array, target_t: jax.Array,
         cfg: GPT2Config):
  """Position t of every document's search.

  Args:
    state: (cache [B, W, k, 2, T, H, D], tokens [B, W, T], scores [B, W]).
    t: scalar int32 position.
    candidates_t: [B, C] int32 candidates of position t.
    target_t: [B, d] observed h_t.
  """
  one = lambda carry, cand, target: _doc_step(params, cfg, carry, (t, cand, target))[0]
  return jax.vmap(one)(state, candidates_t, target_t)


def search(params, cfg: GPT2Config, k: int, target, candidates, width: int,
           scan=workspace.run_steps, prefix: tuple[int, ...] = ()):
  """Beam search over the documents of one chunk.

  The positions run as one compiled loop of `step` (`scan` is `Workspace.scan` in an
  attack, which meters it), compiled once per (model, cut, W, C, chunk shape).

  Args:
    params: the attacker's GPT-2 parameters (client layers 0..k-1 are used).
    cfg: model config.
    k: the cut.
    target: [B, T, d] observed forward messages.
    candidates: [B, T, C] int32 candidate tokens per position, best first.
    width: beam width W; W > C is allowed (beams without a finite path stay at +inf).
    prefix: the P tokens every document starts with, public (a BOS): positions < P take
      them (one candidate each) and the candidates there are not read.

  Returns:
    (tokens [B, T] of the best beam, score [B] its summed squared distance).
  """
  _validate(cfg, k, target, candidates, width)
  target, candidates = jnp.asarray(target), jnp.asarray(candidates, jnp.int32)
  state = start(target, cfg=cfg, k=k, width=width)
  run = lambda state, inputs: scan(step, (params,), state, inputs, cfg=cfg)
  _, tokens, scores = run_after_prefix(run, state, target, candidates, prefix)
  return tokens[:, 0], scores[:, 0]


def run_after_prefix(run, state, target, candidates, prefix: tuple[int, ...]):
  """The beam loop `run(state, inputs) -> state` over every position of target [B, T, d]:
  the P positions of the public prefix first, each with its one known candidate, then the
  others with their candidates [B, T, C] from the prefix's caches. Returns the state."""
  skip = len(prefix)
  if skip:
    known = jnp.broadcast_to(jnp.asarray(prefix, jnp.int32)[None, :, None],
                             (target.shape[0], skip, 1))
    state = run(state, positions(target[:, :skip], known))
  return run(state, positions(target[:, skip:], jnp.asarray(candidates[:, skip:], jnp.int32),
                              skip))


def positions(target: jax.Array, candidates: jax.Array, first: int = 0) -> tuple:
  """The loop's inputs, position-major, for the positions first, first + 1, ... of
  target [B, T', d] and candidates [B, T', C]: (t [T'], candidates [T', B, C],
  target [T', B, d])."""
  return (jnp.arange(first, first + target.shape[1], dtype=jnp.int32),
          jnp.swapaxes(candidates, 0, 1), jnp.swapaxes(target, 0, 1))


def _validate(cfg: GPT2Config, k: int, target, candidates, width: int) -> None:
  if not 1 <= k < cfg.n_layer:
    raise ValueError(f"cut k={k} must satisfy 1 <= k < n_layer={cfg.n_layer}")
  if target.ndim != 3 or target.shape[-1] != cfg.n_embd:
    raise ValueError(f"activations must be [B, T, {cfg.n_embd}], got {target.shape}")
  if candidates.shape[:2] != target.shape[:2]:
    raise ValueError(f"candidates {candidates.shape} do not match activations {target.shape}")
  if width < 1:
    raise ValueError(f"beam width must be >= 1, got {width}")


def analytic_flops(cfg: GPT2Config, k: int, num_docs: int, width: int, num_candidates: int,
                   seq_len: int, prefix: int = 0) -> float:
  """Matmul FLOPs of the search: W*C one-token client steps per position and document
  (W at each of the `prefix` known positions, whose one candidate every beam runs).

  Per step and block: every weight matrix once, 2 FLOPs an entry (GPT-2: qkv 6d^2, output
  projection 2d^2, MLP 16d^2; a RoPE family: q, k, v with GQA's narrower k and v, o, a
  gated MLP's three matrices), attention over the prefix 4 T H D (scores and values per
  query head, the whole cache length, as computed): lla.model.cost.token_block_flops.
  """
  d = cfg.n_embd
  per_token_block = cost.token_block_flops(cfg, seq_len)
  per_token = k * per_token_block + 2.0 * d  # + the cost's squared distance
  steps = (seq_len - prefix) * num_candidates + prefix
  return float(num_docs) * steps * width * per_token
