"""SipIt: exact sequential inversion of the forward message h (arXiv 2510.15511).

With the exact client weights, h_t identifies token t given the tokens before it (the
client is injective on prefixes in practice). SipIt recovers a document's tokens in order:
at position t it verifies candidate tokens v with one KV-cached client step over the
recovered prefix and accepts the first whose output matches h_t. What makes it fast is
the order in which candidates are proposed, cheapest first:

  1. proposals: where the capture holds g, the tokens ranked by <-g[t-1], wte[v]> (the
     backward message of position t-1 points at token t), interleaved with the ridge
     ranking of h_t (PROTOCOL section 4), duplicates removed;
  2. refinement (lla): the ridge decoder's weights W are a linear inverse of the client,
     so e <- e + (h_t - client(prefix, e)_t) W is a Newton-like step with W as the inverse
     Jacobian, one forward and no gradient per step, from the ridge decode; each step
     verifies the nearest unvisited vocabulary rows to e, and a document leaves the stage
     once its residual stops falling. The stage runs only where one step contracts the
     residual at most calibration positions (the median ratio, measured on the attacker's
     calibration documents, is below 1): on a trained model the ridge map is a good local
     inverse, on random weights it is not;
  3. the paper's gradient policy (official code `SIPIT.find_token`): SGD on a continuous
     input embedding e for mean((client(prefix, e)_t - h_t)^2) with the gradient norm
     clipped, each iteration verifying the nearest unvisited rows to e, and every
     `reset_every` iterations (times 1 + V // 25000 at position 0) snapping e to the
     nearest of them. lla starts e at the ridge decode of h_t where the official code
     starts at a random token: at position 0 of a random-weight GPT-2 124M cut at k = 6 the
     ridge ranks run into the thousands, yet a few steps from the decode identify the token;
  4. brute force over the rest of the vocabulary, in chunks, so that every position ends,
     in the order of the error predicted by the client's linearisation at the ridge decode
     (one Jacobian, d JVPs): on the fine-tuned embedded model the rare tokens that the
     ridge ranks in the thousands and the policy misses come first in that order.

Position 0's message depends on its token alone, so documents with bit-identical h_0 share
one search. A visited mask keeps any token from being verified twice at a position.

Acceptance: the relative distance ||client(prefix + [v])_t - h_t|| / ||h_t|| must not exceed
a tolerance calibrated on the attacker's calibration documents, namely the largest relative
discrepancy between the batched client (how a capture is computed) and the KV-cached
recomputation of their true prefixes (at least float32's epsilon), times
`sipit_tolerance_factor`. Position 0 has a tolerance of its own, calibrated on position 0
alone: it is the attention sink, whose row carries the massive activations (SmolLM2: norm
~800 against ~80 elsewhere), so its relative rounding is another size, and a tolerance
taken from the other positions would be ~10x laxer there in absolute terms
(model-families.md 4.4). Under `trained` knowledge (the attacker's weights differ from the
client's) nothing matches: such a position takes the nearest candidate verified (the whole
vocabulary's nearest with `sipit_brute_force`), and the record counts these fallbacks.

Execution: documents go through `Workspace.map_documents` in memory-bounded chunks. Within
a chunk, each document's search is the sequence above for that document alone (a Python
generator, `ChunkSearch._document`), and the chunk's documents advance together, each at
its own position: one compiled call runs one kind of step (a proposal batch, a block of
refinement or policy iterations, a commit) for every document that waits for it, wherever
it is, the cheap kinds first, so that the documents that need the iterated stages share
their calls. Those calls are vmapped over the documents (compacted to a power-of-two
bucket of at least `BUCKET_FLOOR` rows, so that documents that accepted cost nothing and a
chunk compiles two or three row counts; the padding rows are not charged, `Meter`);
refinement and policy run `REFINE_BLOCK` / `POLICY_BLOCK` iterations per call as one
`Workspace.scan`, whose executable is the loop alone and is charged its body per trip (a
document that stops inside a block is carried through it unchanged, and that work is
charged too); the brute force runs per document, its chunks in calls of the first chunk's
width, so that one width compiles. The metered FLOPs are what ran for the documents. On the embedded model
(16 documents of 32 tokens, cut 6, warm) the search takes 0.66 s per document where a
position-by-position search took 1.07 s, with identical predictions and 0.97x the XLA
FLOPs (experiments/bench_sipit.py compares the two; docs/benchmarks.md).

Each document's search is the one it would have alone: which documents share a call
changes only the last bits of float32 results (XLA:CPU computes a lone row as a
matrix-vector product, several as a matrix product, and a loop computes what it does not
change once), as the chunking always did. Distances move in their last bits, and where the
refinement has converged its "residual still falls" test can end it a step sooner or later
(on the embedded model: 5.318 refinement steps per refined position against 5.327 for a
position-by-position search); the tokens accepted, far inside the
tolerance against runners-up far outside it, are the same. The attack draws nothing at
random.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import types

import jax
import jax.numpy as jnp
import numpy as np

from lla_kernels import vocab_topk
from lla.attacks.seed import beam
from lla.attacks import budget as budget_lib
from lla.attacks import flops
from lla.attacks import registry
from lla.attacks import ridge
from lla.attacks import workspace as workspace_lib
from lla.attacks.workspace import Workspace
from lla.model import cost
from lla.model import split
from lla.model.gpt2 import GPT2Config

STAGES = ("proposals", "refine", "policy", "brute_force")
# How a position was settled (the `resolved` statistic).
RESOLUTIONS = STAGES + ("shared_position0", "fallback", "known_prefix")
_FIRST_BRUTE_CHUNK = 16
# Iterations per compiled call of the refinement and of the policy (`Workspace.scan`): one
# host round trip per block instead of one per iteration. A document that stops inside a
# block (accepted, or its residual stopped falling) is carried through the rest of it
# unchanged, and that work is metered: short blocks waste little where the stages end
# early (a random small GPT-2, whose policy accepts within 2 iterations), long ones save
# more round trips where they run long (the embedded model: 31 policy iterations per
# policy position).
REFINE_BLOCK = 2
POLICY_BLOCK = 4
_VOCAB_SCALE = 25_000  # official code: the position-0 projection period grows with V // 25000

budget_lib.declare(
    "sipit_gradient_candidates", 1, int, low=0, high=budget_lib.VOCAB,
    doc="SipIt: gradient-ranked proposals per position t >= 1 (captures holding g)",
    source="lla")
budget_lib.declare(
    "sipit_ridge_candidates", 4, int, low=0, high=budget_lib.VOCAB,
    doc="SipIt: ridge-ranked proposals per position", source="lla")
budget_lib.declare(
    "sipit_refine_iters", 16, int, low=0,
    doc="SipIt: ridge-preconditioned refinement steps per position (while the residual falls)",
    source="lla")
budget_lib.declare(
    "sipit_batch", 1, int, low=1, high=budget_lib.VOCAB,
    doc="SipIt: candidates verified per call (a proposal batch; nearest rows per policy "
    "iteration)", source="official code: one token per iteration")
budget_lib.declare(
    "sipit_max_iters", 32, int, low=0,
    doc="SipIt: gradient-policy iterations per position before brute force",
    source="lla; the official loop runs up to V iterations (50,257 for GPT-2), the policy "
    "being its own enumerator, where lla hands over to the batched brute force")
budget_lib.declare(
    "sipit_step_size", 1.0, float, low=0.0, strict_low=True,
    doc="SipIt: SGD step size of the gradient policy", source="official CLI --step_size 1.0")
budget_lib.declare(
    "sipit_grad_clip", 1.0, float, low=0.0, strict_low=True,
    doc="SipIt: the policy's gradient is rescaled to this norm when longer",
    source="official code (grad / ||grad|| when ||grad|| > 1)")
budget_lib.declare(
    "sipit_reset_every", 50, int, low=1,
    doc="SipIt: iterations between snaps of e to the nearest row (x (1 + V // 25000) at t = 0)",
    source="official code projection_iters_base = 50")
budget_lib.declare(
    "sipit_tolerance_factor", 100.0, float, low=1.0,
    doc="SipIt: acceptance tolerance / calibrated batched-vs-cached discrepancy", source="lla")
budget_lib.declare(
    "sipit_calibration_docs", 2, int, low=1,
    doc="SipIt: calibration documents the acceptance tolerance (and the refinement's "
    "contraction) is measured on", source="lla")
budget_lib.declare(
    "sipit_brute_chunk", 512, int, low=1,
    doc="SipIt: the most candidates per document in one brute-force call (chunks double "
    "from 16)", source="lla")
budget_lib.declare(
    "sipit_brute_force", True, bool,
    doc="SipIt: scan the rest of the vocabulary when nothing was accepted (the published "
    "termination guarantee); False takes the nearest candidate verified",
    source="official code (the policy runs up to V iterations)")
budget_lib.declare(
    "sipit_brute_force_inexact", True, bool,
    doc="SipIt: keep the brute force at the later positions of a document whose position 0 "
    "no token reproduces (inexact messages: trained knowledge or a defense), for the "
    "vocabulary's nearest token; False takes the nearest candidate verified there, far "
    "cheaper and weaker", source="lla")

BUDGET_FIELDS = ("sipit_gradient_candidates", "sipit_ridge_candidates", "sipit_refine_iters",
                 "sipit_batch", "sipit_max_iters", "sipit_step_size", "sipit_grad_clip",
                 "sipit_reset_every", "sipit_tolerance_factor", "sipit_calibration_docs",
                 "sipit_brute_chunk", "sipit_brute_force", "sipit_brute_force_inexact",
                 "ridge_alpha")


# --- compiled steps (documents `idx` of a chunk of N, each at its own position t[i]) ------


def _relative_distance(h: jax.Array, target: jax.Array) -> jax.Array:
  """||h - target|| / ||target|| over the last axis; h [..., d], target [d]."""
  scale = jnp.maximum(jnp.sum(target**2), jnp.finfo(jnp.float32).tiny)
  return jnp.sqrt(jnp.sum((h - target) ** 2, axis=-1) / scale)


def _verify_one(params, cfg, cache, candidates, t, target):
  """One document: relative distances [c] and keys/values [c, k, 2, H, D] of candidates [c]."""
  h, kv = jax.vmap(lambda v: split.client_step_kv(params, cfg, cache, v, t))(candidates)
  return _relative_distance(h, target), kv


def _merge(record, rel, candidates, kv, valid):
  """A document's position record after one verified batch: the nearest candidate so far
  (ties: the one verified first) and the runner-up's distance."""
  rel = jnp.where(valid, rel, jnp.inf)
  i = jnp.argmin(rel)
  first = rel[i]
  second = jnp.min(jnp.where(jnp.arange(rel.shape[0]) == i, jnp.inf, rel))
  better = first < record["rel"]
  return {
      "rel": jnp.where(better, first, record["rel"]),
      "runner": jnp.where(better, jnp.minimum(record["rel"], second),
                          jnp.minimum(record["runner"], first)),
      "token": jnp.where(better, candidates[i], record["token"]),
      "kv": jnp.where(better, kv[i], record["kv"]),
  }


def _mark(visited, candidates, valid):
  return visited.at[jnp.where(valid, candidates, visited.shape[0])].set(True, mode="drop")


def _rows(tree, idx):
  return jax.tree_util.tree_map(lambda x: x[idx], tree)


def _set_rows(tree, idx, rows):
  return jax.tree_util.tree_map(lambda x, r: x.at[idx].set(r), tree, rows)


def _where_rows(active, new, old):
  """`new` where active [n], else `old` (pytrees of [n, ...] arrays)."""
  return jax.tree_util.tree_map(
      lambda a, b: jnp.where(active.reshape(active.shape + (1,) * (a.ndim - 1)), a, b),
      new, old)


@functools.partial(jax.jit, static_argnames=("cfg",))
def verify(params, cache, h, visited, record, idx, t, candidates, valid, cfg: GPT2Config):
  """Verifies candidates of the documents idx, each at its own position.

  Args:
    cache: [N, k, 2, T, H, D] keys/values of each document's recovered prefix.
    h: [N, T, d] observed messages (document idx[i]'s target is h[idx[i], t[i]]).
    visited: [N, V] bool tokens verified at each document's current position.
    record: the position records, {"rel", "runner": [N] float32, "token": [N] int32,
      "kv": [N, k, 2, H, D]}.
    idx: [n] int32 documents to verify (repeats allowed: they compute the same rows).
    t: [n] int32 their positions.
    candidates, valid: [n, c] int32 tokens and which of them count.

  Returns:
    (visited, record) with the rows of idx updated.
  """
  def one(cache_d, visited_d, record_d, cand, val, t_d, target_d):
    rel, kv = _verify_one(params, cfg, cache_d, cand, t_d, target_d)
    return _mark(visited_d, cand, val), _merge(record_d, rel, cand, kv, val)

  new_visited, new_record = jax.vmap(one)(cache[idx], visited[idx], _rows(record, idx),
                                          candidates, valid, t, h[idx, t])
  return visited.at[idx].set(new_visited), _set_rows(record, idx, new_record)


def _nearest_unvisited(wte, visited, e, num):
  """The `num` nearest unvisited rows of wte [V, d] to e [d]: (ids [num], valid [num])."""
  neg_dist, ids = vocab_topk.topk(e, wte, num, "neg_sq_dist", mask=visited)
  return ids, jnp.isfinite(neg_dist)


def refine_iteration(params, cache, h, inverse, idx, t, start, tol, state, i, *,
                     cfg: GPT2Config, num: int, iters: int):
  """One ridge-preconditioned refinement step for the documents idx (a `Workspace.scan`
  step: iteration i of a block).

  The ridge decoder's weights W [d, d] (`inverse`) are a global linear inverse of the
  client, used here as an approximate inverse Jacobian: e <- e + (h_t - client(prefix,
  e)_t) W, a Newton-like step that needs one forward and no gradient. The `num` nearest
  unvisited rows to the new e are verified.

  A row takes the step while it is open (record rel > tol, the float32 tolerance), has
  unvisited tokens, its residual fell at its previous step, and start + i < iters (its
  refinement budget at its position); otherwise it is left as it is: the host's rule, so
  that the block's log says which iterations the document took. Arguments as in `verify`;
  start [n] the iterations each row had done at its position before the block.

  state: (visited [N, V], record, e [N, d], seen [n] tokens verified at the position,
  falling [n], last [n] previous residual, log), log["value"] the residual
  ||h_t - client(prefix, e)_t|| at the old e.
  """
  visited, record, e, seen, falling, last, log = state
  vocab = visited.shape[1]
  wte = split.wte(params)
  active = (record["rel"][idx] > tol) & (seen < vocab) & falling & (start + i < iters)

  def one(cache_d, visited_d, record_d, e_d, t_d, target_d):
    out, _ = split.client_step_embedding(params, cfg, cache_d, e_d, t_d)
    residual = target_d - out
    e_d = e_d + residual @ inverse
    cand, valid = _nearest_unvisited(wte, visited_d, e_d, num)
    rel, kv = _verify_one(params, cfg, cache_d, cand, t_d, target_d)
    return (_mark(visited_d, cand, valid), _merge(record_d, rel, cand, kv, valid), e_d,
            jnp.sqrt(jnp.sum(residual**2)))

  old = (visited[idx], _rows(record, idx), e[idx])
  *new, residual = jax.vmap(one)(cache[idx], *old, t, h[idx, t])
  new_visited, new_record, new_e = _where_rows(active, tuple(new), old)
  log = {"active": log["active"].at[i].set(active), "value": log["value"].at[i].set(residual)}
  return (visited.at[idx].set(new_visited), _set_rows(record, idx, new_record),
          e.at[idx].set(new_e), jnp.where(active, seen + jnp.minimum(num, vocab - seen), seen),
          jnp.where(active, residual < last, falling), jnp.where(active, residual, last), log)


def policy_iteration(params, cache, h, idx, t, start, reset, tol, step_size, clip, state, i,
                     *, cfg: GPT2Config, num: int, iters: int):
  """One iteration of the gradient policy for the documents idx (a `Workspace.scan` step:
  iteration i of a block).

  Projects e [N, d] onto its `num` nearest unvisited vocabulary rows and verifies them;
  where the row's iteration j = start + i is a positive multiple of `reset` [n], e first
  jumps to the nearest of them (as published, that row is the one verified in the
  iteration); then one SGD step on mean((client(prefix, e)_t - h_t)^2) with the gradient
  rescaled to norm `clip` when longer. A row iterates while it is open, has unvisited
  tokens and j < iters; otherwise it is left as it is.

  state: (visited, record, e, seen [n], log), log["value"] the loss at the pre-step e.
  Other arguments as in `refine_iteration`.
  """
  visited, record, e, seen, log = state
  vocab = visited.shape[1]
  wte = split.wte(params)
  j = start + i
  active = (record["rel"][idx] > tol) & (seen < vocab) & (j < iters)
  snap = (j > 0) & (j % reset == 0)

  def one(cache_d, visited_d, record_d, e_d, t_d, target_d, snap_d):
    cand, valid = _nearest_unvisited(wte, visited_d, e_d, num)
    e_d = jnp.where(snap_d, wte[cand[0]], e_d)
    rel, kv = _verify_one(params, cfg, cache_d, cand, t_d, target_d)

    def loss_fn(e_):
      out, _ = split.client_step_embedding(params, cfg, cache_d, e_, t_d)
      return jnp.mean((out - target_d) ** 2)

    loss, grad = jax.value_and_grad(loss_fn)(e_d)
    norm = jnp.sqrt(jnp.sum(grad**2))
    grad = jnp.where(norm > clip, grad * (clip / norm), grad)
    return (_mark(visited_d, cand, valid), _merge(record_d, rel, cand, kv, valid),
            e_d - step_size * grad, loss)

  old = (visited[idx], _rows(record, idx), e[idx])
  *new, loss = jax.vmap(one)(cache[idx], *old, t, h[idx, t], snap)
  new_visited, new_record, new_e = _where_rows(active, tuple(new), old)
  log = {"active": log["active"].at[i].set(active), "value": log["value"].at[i].set(loss)}
  return (visited.at[idx].set(new_visited), _set_rows(record, idx, new_record),
          e.at[idx].set(new_e), jnp.where(active, seen + jnp.minimum(num, vocab - seen), seen),
          log)


@functools.partial(jax.jit, static_argnames=("cfg",))
def linearised_order(params, cache, visited, e, doc, t, target, cfg: GPT2Config):
  """[V] token ids of document `doc` (a [1] index), unvisited first, ranked by the error
  predicted by the client's linearisation at e [N, d]:
  ||client(prefix, e)_t + (wte[v] - e) J - h_t||, J the [d, d] Jacobian in e (d JVPs).

  Where neither the ridge map nor gradient steps find a token (rare tokens, far from the
  ridge decode in embedding space), the local linearisation still ranks it near the top:
  the output-space error, not the embedding distance, is what identifies it.
  """
  wte = split.wte(params)
  cache_d, visited_d, e_d, target_d = cache[doc[0]], visited[doc[0]], e[doc[0]], target[doc[0]]
  out, jvp = jax.linearize(
      lambda e_: split.client_step_embedding(params, cfg, cache_d, e_, t)[0], e_d)
  jacobian = jax.vmap(jvp)(jnp.eye(e_d.shape[0], dtype=e_d.dtype))   # [d_in, d_out]
  predicted = (wte - e_d) @ jacobian - (target_d - out)             # [V, d]
  error = jnp.where(visited_d, jnp.inf, jnp.sum(predicted**2, axis=-1))
  return jnp.argsort(error, stable=True).astype(jnp.int32)


@jax.jit
def commit(cache, record, t):
  """Writes each document's chosen token's keys/values at position t: cache [N, ...]."""
  return jax.vmap(split.write_cache, in_axes=(0, 0, None))(cache, record["kv"], t)


@jax.jit
def advance(cache, visited, record, e_refined, e_policy, e_hat, idx, t):
  """Ends the documents idx at their positions t [N]: their records' keys/values are
  written into the cache at t, and their search state is cleared for position t + 1
  (empty record and visited set; refinement and policy start at its ridge decode, e_hat
  [N, T, d]). idx holds N entries, the unused ones N (dropped): one executable for any
  number of documents, and nothing here is arithmetic. Returns the state and the records
  that ended ([N] rows, those of the unused entries meaningless)."""
  get = lambda x: x.at[idx].get(mode="clip")
  ended = jax.tree_util.tree_map(get, record)
  written = jax.vmap(split.write_cache)(get(cache), ended["kv"], t)
  fresh = jax.tree_util.tree_map(jnp.zeros_like, ended)
  fresh["rel"] = fresh["runner"] = jnp.full(idx.shape, jnp.inf, jnp.float32)
  start = e_hat.at[idx, jnp.minimum(t + 1, e_hat.shape[1] - 1)].get(mode="clip")
  put = lambda x, rows: x.at[idx].set(rows, mode="drop")
  return (put(cache, written), put(visited, jnp.zeros_like(get(visited))),
          jax.tree_util.tree_map(put, record, fresh), put(e_refined, start),
          put(e_policy, start), ended)


# --- the search, driven from Python -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Settings:
  """The budget fields SipIt reads, typed."""

  gradient_candidates: int
  ridge_candidates: int
  refine_iters: int
  batch: int
  max_iters: int
  step_size: float
  grad_clip: float
  reset_every: int
  tolerance_factor: float
  calibration_docs: int
  brute_chunk: int
  brute_force: bool
  brute_force_inexact: bool

  @classmethod
  def from_budget(cls, budget) -> "Settings":
    return cls(int(budget.sipit_gradient_candidates), int(budget.sipit_ridge_candidates),
               int(budget.sipit_refine_iters), int(budget.sipit_batch), int(budget.sipit_max_iters),
               float(budget.sipit_step_size), float(budget.sipit_grad_clip),
               int(budget.sipit_reset_every), float(budget.sipit_tolerance_factor),
               int(budget.sipit_calibration_docs), int(budget.sipit_brute_chunk),
               bool(budget.sipit_brute_force), bool(budget.sipit_brute_force_inexact))


class Meter:
  """`Workspace.call` that also tallies FLOPs (XLA and analytic) per SipIt stage.

  real_fraction: as `Workspace.call`'s, the share of a call's rows that are documents'
  own (the rest pads it to a bucket, `_bucket`); the analytic count is the caller's, of
  the real rows alone."""

  def __init__(self, ws: Workspace):
    self.ws = ws
    self.xla = collections.defaultdict(float)
    self.analytic = collections.defaultdict(float)

  def __call__(self, stage: str, analytic: float, jitted, *args, real_fraction: float = 1.0,
               **kwargs):
    out = self.ws.call(jitted, *args, real_fraction=real_fraction, **kwargs)
    # A cache hit now (ws.call compiled it): the FLOPs of the call that just ran.
    flops = workspace_lib.compiled(jitted, *args, **kwargs)[2]
    self.xla[stage] += (flops or 0.0) * real_fraction
    self.analytic[stage] += analytic
    return out

  def scan(self, stage: str, analytic: float, step, consts, state, xs, *,
           real_fraction: float = 1.0, **static):
    """`Workspace.scan`: the loop's executable, charged its body's count per trip."""
    out = self.ws.scan(step, consts, state, xs, real_fraction=real_fraction, **static)
    flops = workspace_lib.compiled(workspace_lib.scan_steps, consts, state, xs, step=step,
                                   static=tuple(sorted(static.items())))[2]
    trips = int(jax.tree_util.tree_leaves(xs)[0].shape[0])
    self.xla[stage] += (flops or 0.0) * trips * real_fraction
    self.analytic[stage] += analytic
    return out


def token_step_flops(cfg: GPT2Config, k: int, seq_len: int) -> float:
  """Analytic FLOPs of one KV-cached client step (beam search's per-token count)."""
  return beam.analytic_flops(cfg, k, 1, 1, 1, seq_len) / seq_len


# The fewest rows a batched call runs (`_bucket`): the documents still searching are padded
# up to a power of two of at least this many (at most the chunk's), so that a chunk meets
# two or three row counts, each compiled once per program, instead of one per power of two
# down to 1. Each count is two to four programs of the client's depth (the refinement's and
# the policy's loops, `verify`), seconds each to compile; at GPT-2 124M's shape on CPU the
# one-token step takes 7.4 ms on 1 row and 13.9 on 8 (docs/benchmarks.md section 16).
BUCKET_FLOOR = 8


def _bucket(active: np.ndarray, limit: int, floor: int = 1) -> np.ndarray:
  """active [n] document indices padded (repeating the last) to
  min(limit, max(floor, 2^ceil(log2 n))), int32: each size compiles once."""
  size = min(limit, max(floor, 1 << max(len(active) - 1, 0).bit_length()))
  return np.concatenate([active, np.repeat(active[-1:], size - len(active))]).astype(np.int32)


def _padded(rows: np.ndarray, size: int, fill) -> np.ndarray:
  return np.concatenate([rows, np.full((size - len(rows),) + rows.shape[1:], fill, rows.dtype)])


def empty_record(cfg: GPT2Config, k: int, num: int) -> dict:
  return {"rel": jnp.full((num,), jnp.inf, jnp.float32),
          "runner": jnp.full((num,), jnp.inf, jnp.float32),
          "token": jnp.zeros((num,), jnp.int32),
          "kv": jnp.zeros((num, k, 2, cfg.n_kv_head, cfg.head_dim), jnp.float32)}


@functools.partial(jax.jit, static_argnames=("cfg",))
def refine_contraction(params, cache, t, target, e, inverse, cfg: GPT2Config):
  """[n] ||residual after one refinement step from e|| / ||residual at e|| (see
  `refine_step`); cache [n, ...] holds true prefixes, target [n, d], e [n, d]."""
  def one(cache_d, target_d, e_d):
    before = target_d - split.client_step_embedding(params, cfg, cache_d, e_d, t)[0]
    after = target_d - split.client_step_embedding(params, cfg, cache_d,
                                                   e_d + before @ inverse, t)[0]
    return jnp.sqrt(jnp.sum(after**2) / jnp.maximum(jnp.sum(before**2),
                                                    jnp.finfo(jnp.float32).tiny))
  return jax.vmap(one)(cache, target, e)


@dataclasses.dataclass(frozen=True)
class Calibration:
  """What SipIt learns from the attacker's calibration documents.

  Attributes:
    tolerance: the acceptance tolerance on the relative distance at positions t >= 1.
    discrepancy: the largest relative distance between the batched client and the
      KV-cached recomputation of the true prefixes at positions t >= 1.
    first_tolerance, first_discrepancy: the same at position 0 (the attention sink).
    contraction: the median over calibration positions of the residual ratio after one
      refinement step from the ridge decode (None when refinement is off); the
      refinement stage runs only where it is below 1.
  """

  tolerance: float
  discrepancy: float
  contraction: float | None
  first_tolerance: float
  first_discrepancy: float

  @classmethod
  def of(cls, worst, factor: float, contraction: float | None) -> "Calibration":
    """From the largest discrepancy at each position, worst [T]: position 0's class and
    the others' (position 0's for both when T = 1), each tolerance `factor` times its
    discrepancy, at least float32's epsilon."""
    worst = np.asarray(worst, np.float64)
    first = float(worst[0])
    rest = float(worst[1:].max()) if len(worst) > 1 else first
    eps = float(np.finfo(np.float32).eps)
    return cls(factor * max(rest, eps), rest, contraction, factor * max(first, eps), first)

  def at(self, positions) -> np.ndarray:
    """The tolerance of each position in `positions`."""
    return np.where(np.asarray(positions) == 0, self.first_tolerance, self.tolerance)

  @property
  def refine(self) -> bool:
    return self.contraction is not None and self.contraction < 1.0


def calibrate(ws: Workspace, settings: Settings, meter: Meter,
              decoder: ridge.RidgeDecoder) -> Calibration:
  """Recomputes the first calibration documents position by position with the KV cache:
  the tolerance is the largest relative distance to the batched client (at least float32's
  epsilon) times the safety factor, at position 0 and at the others separately (a
  calibration document of one token leaves position 0's for both); the refinement's
  contraction is measured on the way."""
  cfg, k, params = ws.cfg, ws.cut, ws.model_params
  tokens = np.asarray(ws.calibration_tokens[:settings.calibration_docs], np.int32)
  n, seq_len = tokens.shape
  step = token_step_flops(cfg, k, seq_len)
  batched = meter("calibration", n * seq_len * step, split.client, params, cfg=cfg,
                  tokens=jnp.asarray(tokens), k=k)
  if settings.refine_iters:
    e_hat = meter("calibration", 2.0 * n * seq_len * cfg.n_embd**2, ridge.decode,
                  decoder.weights, decoder.mu_h, decoder.mu_e, batched)
  cache = jnp.zeros((n, k, 2, seq_len, cfg.n_kv_head, cfg.head_dim), jnp.float32)
  visited = jnp.zeros((n, cfg.vocab_size), jnp.bool_)
  idx, ones = jnp.arange(n, dtype=jnp.int32), jnp.ones((n, 1), jnp.bool_)
  worst, contractions = np.zeros(seq_len), []
  for t in range(seq_len):
    tt = jnp.int32(t)
    if settings.refine_iters:
      contractions.append(np.asarray(meter(
          "calibration", 2 * n * step, refine_contraction, params, cache, tt, batched[:, t],
          e_hat[:, t], jnp.asarray(decoder.weights), cfg=cfg)))
    _, record = meter("calibration", n * step, verify, params, cache, batched, visited,
                      empty_record(cfg, k, n), idx, jnp.full((n,), t, jnp.int32),
                      jnp.asarray(tokens[:, t:t + 1]), ones, cfg=cfg)
    worst[t] = float(np.max(np.asarray(record["rel"])))
    cache = meter("calibration", 0.0, commit, cache, record, tt)
  if not np.all(np.isfinite(worst)):
    raise FloatingPointError("sipit: the calibration documents give a non-finite discrepancy")
  contraction = float(np.median(np.concatenate(contractions))) if contractions else None
  return Calibration.of(worst, settings.tolerance_factor, contraction)


def merge_proposals(gradient: np.ndarray | None, ridge_ranked: np.ndarray | None,
                    seq_len: int, num_docs: int) -> tuple[np.ndarray, np.ndarray]:
  """Proposals [B, T, P] (distinct ones first) and their count [B, T].

  Gradient and ridge ranks interleave, gradient first; position 0 has no gradient
  proposal (g[-1] does not exist); a token already proposed is dropped.
  """
  columns, usable = [], []
  width = max(0 if gradient is None else gradient.shape[-1],
              0 if ridge_ranked is None else ridge_ranked.shape[-1])
  for i in range(width):
    if gradient is not None and i < gradient.shape[-1]:
      columns.append(gradient[..., i])
      usable.append(np.broadcast_to(np.arange(seq_len) >= 1, (num_docs, seq_len)))
    if ridge_ranked is not None and i < ridge_ranked.shape[-1]:
      columns.append(ridge_ranked[..., i])
      usable.append(np.ones((num_docs, seq_len), bool))
  if not columns:
    return np.zeros((num_docs, seq_len, 0), np.int32), np.zeros((num_docs, seq_len), np.int32)
  cands, usable = np.stack(columns, -1).astype(np.int32), np.stack(usable, -1)
  same = (cands[..., :, None] == cands[..., None, :]) & usable[..., None, :]
  keep = usable & ~np.tril(same, -1).any(-1)
  order = np.argsort(~keep, axis=-1, kind="stable")
  return np.take_along_axis(cands, order, -1), keep.sum(-1).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class _Request:
  """A step that a document's search (`ChunkSearch._document`) waits for.

  kind: "verify" (`candidates`, `valid` [width], metered as `stage`: "proposals" or
  "brute_force"), "refine" or "policy" (a block of iterations, from the document's
  `start`-th at its position, with `seen` tokens verified there so far and, refining, the
  `last` residual), "linearise" (the brute force's order) or "commit" (the position ends).
  """

  kind: str
  stage: str = ""
  candidates: np.ndarray | None = None
  valid: np.ndarray | None = None
  start: int = 0
  seen: int = 0
  last: float = math.inf

  @property
  def key(self) -> tuple:
    """Requests with one key run together; the smallest key runs first (`_ORDER`)."""
    width = 0 if self.candidates is None else len(self.candidates)
    return (_ORDER[self.kind], width, self.stage)


# The cheap steps (a commit, a proposal batch, a part of a brute-force chunk) run first:
# they move documents on to the positions where they need the expensive, iterated stages,
# which therefore run only when every document waits for one, each block shared by all the
# documents that need it.
_ORDER = {"commit": 0, "verify": 1, "linearise": 2, "refine": 3, "policy": 4}


def _settled(resolved: int, stage: str, accepted: bool) -> int:
  """How a position is settled after `stage`: the first stage at whose end it is accepted."""
  fallback = RESOLUTIONS.index("fallback")
  return RESOLUTIONS.index(stage) if accepted and resolved == fallback else resolved


class ChunkSearch:
  """SipIt over one chunk of documents (all arrays [n, ...]) at `positions`.

  `search` [n] bool marks the documents to search (the others keep an empty record);
  `brute` [n] bool the documents whose open positions end in the brute force;
  `prefix_kv` [n, k, 2, H, D], the keys/values of position 0, is given when the positions
  start at 1 (position 0 is searched in a pass of its own).

  Each document's search is a generator (`_document`): the sequential search of the module
  docstring for that document alone, position by position and stage by stage, which
  yields each step it needs computed (`_Request`) and is sent the result. `_execute`
  advances them all: it runs the cheapest kind of step that some document waits for as one
  compiled call over every document waiting for it, each at its own position, and sends
  each its result. The documents drift apart in position, and a call serves all those that
  need that step wherever they are, where a position-by-position search serves the few at
  one position (on the embedded model the policy runs at 38 of 512 positions). A
  document's search is the one it would have alone (module docstring).
  """

  def __init__(self, ws: Workspace, settings: Settings, tolerance: float, meter: Meter,
               positions, inverse):
    # Distances are float32 and compared with the tolerance in float32 (as NumPy compares
    # a float32 array with a Python float), on the host and in the blocks alike.
    self.ws, self.s, self.tol, self.meter = ws, settings, np.float32(tolerance), meter
    self.inverse = jnp.asarray(inverse)
    self.positions = tuple(positions)
    self.step_flops = token_step_flops(ws.cfg, ws.cut, ws.seq_len)
    d, vocab = ws.cfg.n_embd, ws.cfg.vocab_size
    self.vocab, self.num = vocab, min(settings.batch, vocab)
    # Derivatives in e only (the weights are constants): a JVP, like a gradient, takes one
    # product per matrix of the step, as the forward does. The linearisation is the
    # forward plus d JVPs, then the [V, d] x [d, d] prediction; a policy iteration
    # verifies `num` candidates, then a forward and its gradient.
    self.linearise_flops = (d + 1) * self.step_flops + 2.0 * vocab * d * d
    nearest_flops = 2.0 * vocab * d
    self.refine_flops = (1 + self.num) * self.step_flops + nearest_flops + 2.0 * d * d
    self.policy_flops = (self.num + 2) * self.step_flops + nearest_flops
    self.blocks = {"refine": min(settings.refine_iters, REFINE_BLOCK),
                   "policy": min(settings.max_iters, POLICY_BLOCK)}

  def __call__(self, h, proposals, counts, e_hat, doc_index, search, brute, prefix_kv=None):
    cfg, k = self.ws.cfg, self.ws.cut
    n, seq_len = h.shape[:2]
    self.n, self.h, self.e_hat = n, jnp.asarray(h), jnp.asarray(e_hat)
    self.proposals, self.counts = np.asarray(proposals), np.asarray(counts)
    self.doc_index, self.brute = np.asarray(doc_index), np.asarray(brute)
    self.t = np.full(n, self.positions[0], np.int32)   # each document's current position
    start = self.e_hat[:, self.positions[0]]
    # The chunk's search state on the device, each document's row for its position.
    self.state = {
        "cache": jnp.zeros((n, k, 2, seq_len, cfg.n_kv_head, cfg.head_dim), jnp.float32),
        "visited": jnp.zeros((n, self.vocab), jnp.bool_),
        "record": empty_record(cfg, k, n), "e_refined": start, "e_policy": start}
    if prefix_kv is not None:
      self.state["cache"] = self.meter("commit", 0.0, commit, self.state["cache"],
                                       {"kv": jnp.asarray(prefix_kv)}, jnp.int32(0))
    width = len(self.positions)
    out = {"tokens": np.zeros((n, width), np.int32),
           "rel": np.full((n, width), np.inf, np.float32),
           "runner": np.full((n, width), np.inf, np.float32),
           "verified": np.zeros((n, width, len(STAGES)), np.int32),
           "iterations": np.zeros((n, width, 2), np.int32),
           "resolved": np.full((n, width), RESOLUTIONS.index("fallback"), np.int8),
           # The last position's keys/values (the tail pass's prefix, after position 0).
           "kv": np.zeros((n, k, 2, cfg.n_kv_head, cfg.head_dim), np.float32)}
    self._execute({d: self._document(d, out) for d in np.flatnonzero(search)})
    return out

  # --- one document ------------------------------------------------------------------

  def _document(self, d: int, out: dict):
    """Document d's search, writing its rows of `out`: a generator of `_Request`s, each
    sent back its result (`_run`)."""
    s, tol, vocab, num = self.s, self.tol, self.vocab, self.num
    for j, t in enumerate(self.positions):
      self.t[d] = t
      verified, iterations = out["verified"][d, j], out["iterations"][d, j]
      resolved, rel, seen = RESOLUTIONS.index("fallback"), np.float32(np.inf), 0

      # 1. Proposals, in batches of a fixed width (the last one padded).
      width = self.proposals.shape[-1]
      for first in range(0, width, s.batch):
        if not (rel > tol and self.counts[d, t] > first):
          break
        cands = np.pad(self.proposals[d, t, first:first + s.batch],
                       (0, max(0, first + s.batch - width)))
        valid = np.arange(first, first + s.batch) < self.counts[d, t]
        rel = yield _Request("verify", "proposals", cands, valid)
        verified[0] += valid.sum()
        seen += int(valid.sum())
      resolved = _settled(resolved, "proposals", rel <= tol)

      # 2. Ridge-preconditioned refinement from the ridge decode, while the residual falls.
      # A block returns which of its iterations the document took (a prefix of them).
      i, last, falling = 0, np.float32(np.inf), True
      while falling and i < s.refine_iters and rel > tol and seen < vocab:
        active, residual, rel = yield _Request("refine", start=i, seen=seen, last=last)
        for r in residual[active]:
          self._check("refinement", r, t, i, d)
          got = min(num, vocab - seen)
          verified[1] += got
          seen += got
          iterations[0] += 1
          i += 1
          falling, last = r < last, r
        falling &= bool(active[-1])
      resolved = _settled(resolved, "refine", rel <= tol)

      # 3. The paper's gradient policy, from the ridge decode.
      i, going = 0, True
      while going and i < s.max_iters and rel > tol and seen < vocab:
        active, loss, rel = yield _Request("policy", start=i, seen=seen)
        for value in loss[active]:
          self._check("policy loss", value, t, i, d)
          got = min(num, vocab - seen)
          verified[2] += got
          seen += got
          iterations[1] += 1
          i += 1
        going = bool(active[-1])
      resolved = _settled(resolved, "policy", rel <= tol)

      # 4. Brute force: every token not yet verified, ranked by the linearised client.
      # Chunks double from 16 up to sipit_brute_chunk: the ranking puts the token near the
      # top where the linearisation holds, and the scan still ends in few chunks where not.
      if s.brute_force:
        if rel > tol and seen < vocab and self.brute[d]:
          order = yield _Request("linearise")
          order = order[:vocab - seen]
          first, width = 0, min(_FIRST_BRUTE_CHUNK, s.brute_chunk, vocab)
          call = width
          while len(order) > first and rel > tol:
            # The chunk in calls of the first chunk's width, the search stopping at the
            # chunk's end only: the record (the nearest, ties to the one verified first,
            # and the runner-up) is that of the chunk in one call, and one width compiles.
            chunk = order[first:first + width]
            for part in range(0, len(chunk), call):
              part = chunk[part:part + call]
              rel = yield _Request("verify", "brute_force", _padded(part, call, 0),
                                   np.arange(call) < len(part))
            verified[3] += len(chunk)
            first, width = first + width, min(2 * width, s.brute_chunk, vocab)
        resolved = _settled(resolved, "brute_force", rel <= tol)

      record = yield _Request("commit")
      out["tokens"][d, j], out["rel"][d, j], out["runner"][d, j] = (
          record["token"], record["rel"], record["runner"])
      out["resolved"][d, j] = resolved
      if j == len(self.positions) - 1:
        out["kv"][d] = record["kv"]

  def _check(self, stage, value, t, i, d):
    if not np.isfinite(value):
      raise FloatingPointError(f"sipit: non-finite {stage} residual at position {t}, "
                               f"iteration {i}, document {int(self.doc_index[d])}")

  # --- all documents together --------------------------------------------------------

  def _execute(self, programs: dict) -> None:
    """Runs the documents' searches to their ends: repeatedly the cheapest kind of step
    (`_ORDER`) that some document waits for, over every document waiting for it."""
    pending = {d: next(program) for d, program in programs.items()}
    while pending:
      key = min(request.key for request in pending.values())
      docs = [d for d in sorted(pending) if pending[d].key == key]
      results = self._run([pending[d] for d in docs], np.asarray(docs, np.int32))
      for d, result in zip(docs, results):
        try:
          pending[d] = programs[d].send(result)
        except StopIteration:
          del pending[d]

  def _run(self, requests: list, docs: np.ndarray) -> list:
    """The requests (one key) of documents `docs`: a result per document."""
    kind = requests[0].kind
    if kind == "linearise":  # Per document: one Jacobian each, no batching to gain.
      return [self._linearise(d) for d in docs]
    if kind == "verify" and requests[0].stage == "brute_force":
      # Per document too: a part of a chunk is work enough for a call (16 client steps on
      # the defaults), and each document count would compile.
      return [self._verify(docs[i:i + 1], requests[i:i + 1], floor=1)[0]
              for i in range(len(docs))]
    if kind == "verify":
      return self._verify(docs, requests, floor=BUCKET_FLOOR)
    if kind == "commit":
      return self._commit(docs)
    return self._block(kind, docs, requests)

  def _rows(self, docs: np.ndarray, requests: list, floor: int) -> tuple:
    """(rows, requests): docs padded to a bucket by repeating the last one (the padding
    computes what the last one does), and their requests."""
    rows = _bucket(docs, self.n, floor)
    return rows, requests + requests[-1:] * (len(rows) - len(docs))

  def _verify(self, docs: np.ndarray, requests: list, floor: int) -> list:
    """One `verify` call: each document's record distance after it."""
    state = self.state
    rows, requests = self._rows(docs, requests, floor)
    cands = np.stack([r.candidates for r in requests])
    valid = np.stack([r.valid for r in requests])
    state["visited"], state["record"] = self.meter(
        requests[0].stage, len(docs) * cands.shape[1] * self.step_flops, verify,
        self.ws.model_params, state["cache"], self.h, state["visited"], state["record"],
        jnp.asarray(rows), jnp.asarray(self.t[rows]), jnp.asarray(cands), jnp.asarray(valid),
        cfg=self.ws.cfg, real_fraction=len(docs) / len(rows))
    return list(np.asarray(state["record"]["rel"])[docs])

  def _linearise(self, d: int) -> np.ndarray:
    ws, state, t = self.ws, self.state, int(self.t[d])
    return np.asarray(self.meter(
        "brute_force", self.linearise_flops, linearised_order, ws.model_params, state["cache"],
        state["visited"], self.e_hat[:, t], jnp.asarray([d], jnp.int32), jnp.int32(t),
        self.h[:, t], cfg=ws.cfg))

  def _commit(self, docs: np.ndarray) -> list:
    """`advance` for docs: each document's record at the position that ended."""
    state = self.state
    idx = np.full(self.n, self.n, np.int32)   # N entries, the unused ones dropped
    idx[:len(docs)] = docs
    (state["cache"], state["visited"], state["record"], state["e_refined"],
     state["e_policy"], ended) = self.meter(
         "commit", 0.0, advance, state["cache"], state["visited"], state["record"],
         state["e_refined"], state["e_policy"], self.e_hat, jnp.asarray(idx),
         jnp.asarray(self.t[np.minimum(idx, self.n - 1)]))
    ended = jax.tree_util.tree_map(np.asarray, ended)
    return [jax.tree_util.tree_map(lambda x: x[i], ended) for i in range(len(docs))]

  def _block(self, kind: str, docs: np.ndarray, requests: list) -> list:
    """A block of refinement or policy iterations as one `Workspace.scan`: for each
    document, (which iterations it took [trips] bool, their residuals or losses, its record
    distance after the block)."""
    ws, s, state = self.ws, self.s, self.state
    rows, requests = self._rows(docs, requests, BUCKET_FLOOR)
    n, trips, real = len(rows), self.blocks[kind], len(docs) / len(rows)
    idx, t = jnp.asarray(rows), jnp.asarray(self.t[rows])
    start = jnp.asarray([r.start for r in requests], jnp.int32)
    seen = jnp.asarray([r.seen for r in requests], jnp.int32)
    log = {"active": jnp.zeros((trips, n), jnp.bool_),
           "value": jnp.zeros((trips, n), jnp.float32)}
    iterations = (jnp.arange(trips, dtype=jnp.int32),)
    if kind == "refine":
      last = jnp.asarray([r.last for r in requests], jnp.float32)
      out = self.meter.scan(
          "refine", len(docs) * trips * self.refine_flops, refine_iteration,
          (ws.model_params, state["cache"], self.h, self.inverse, idx, t, start, self.tol),
          (state["visited"], state["record"], state["e_refined"], seen,
           jnp.ones(n, jnp.bool_), last, log),
          iterations, real_fraction=real, cfg=ws.cfg, num=self.num, iters=s.refine_iters)
      state["visited"], state["record"], state["e_refined"], *_, log = out
    else:
      reset = s.reset_every * (1 + (self.vocab // _VOCAB_SCALE) * (self.t[rows] == 0))
      out = self.meter.scan(
          "policy", len(docs) * trips * self.policy_flops, policy_iteration,
          (ws.model_params, state["cache"], self.h, idx, t, start, jnp.asarray(reset, jnp.int32),
           self.tol, jnp.float32(s.step_size), jnp.float32(s.grad_clip)),
          (state["visited"], state["record"], state["e_policy"], seen, log),
          iterations, real_fraction=real, cfg=ws.cfg, num=self.num, iters=s.max_iters)
      state["visited"], state["record"], state["e_policy"], _, log = out
    active, value = np.asarray(log["active"]), np.asarray(log["value"])
    rel = np.asarray(state["record"]["rel"])
    return [(active[:, i], value[:, i], rel[d]) for i, d in enumerate(docs)]


def search_documents(ws: Workspace, settings: Settings, calibration: Calibration, meter: Meter,
                     proposals: np.ndarray, counts: np.ndarray, e_hat: np.ndarray,
                     inverse: np.ndarray) -> dict:
  """Every document searched, in chunks: statistics [B, T, ...] (see ChunkSearch).

  Position 0 depends on its token alone, so it is searched once per distinct h_0 (in a
  pass of its own, so that the sharing does not depend on the chunking); its result is
  the prefix of every document with that h_0. Documents that start with a public BOS
  (`ws.known_prefix`) search nothing there: every search starts from its cache
  (`known_position0`). A document whose position 0 no token
  reproduces after the brute force has tried the whole vocabulary has messages that the
  attacker's client cannot produce exactly (inexact weights, or a defense that altered h);
  without `brute_force_inexact` its later positions take the nearest candidate that the
  proposals, refinement and policy verified, skipping a brute force that could not end in
  an acceptance either.
  """
  h, doc_index = ws.activations, ws.doc_index
  per_doc = bytes_per_doc(ws, settings, proposals.shape[-1])
  everyone = np.ones(ws.num_docs, bool)
  fallback = RESOLUTIONS.index("fallback")
  if ws.known_prefix:
    out, prefix_kv = known_position0(ws, meter)
    inexact = (out["rel"][:, 0] > calibration.first_tolerance) & settings.brute_force
  else:
    rows = np.ascontiguousarray(h[:, 0]).view(np.dtype((np.void, h.dtype.itemsize * h.shape[-1])))
    _, first, group = np.unique(rows.reshape(-1), return_index=True, return_inverse=True)
    source = first[group.reshape(-1)]        # each document's first document with its h_0
    shared = source != np.arange(ws.num_docs)
    head = ws.map_documents(ChunkSearch(ws, settings, calibration.first_tolerance, meter, (0,),
                                        inverse),
                            (h, proposals, counts, e_hat, doc_index, ~shared, everyone), per_doc)
    out = {key: value[source] for key, value in head.items() if key != "kv"}
    prefix_kv = head["kv"][source]
    out["verified"][shared] = 0
    out["iterations"][shared] = 0
    inexact = (out["resolved"][:, 0] == fallback) & settings.brute_force
    out["resolved"][shared] = np.where(out["resolved"][shared] == fallback, fallback,
                                       RESOLUTIONS.index("shared_position0"))
  brute = ~inexact | settings.brute_force_inexact
  if ws.seq_len > 1:
    tail = ws.map_documents(
        ChunkSearch(ws, settings, calibration.tolerance, meter, range(1, ws.seq_len), inverse),
        (h, proposals, counts, e_hat, doc_index, everyone, brute, prefix_kv), per_doc)
    out = {key: np.concatenate([out[key], tail[key]], axis=1) for key in out}
  out["inexact_documents"] = inexact
  return out


@functools.partial(jax.jit, static_argnames=("cfg", "k", "seq_len"))
def known_row(params, token, cfg: GPT2Config, k: int, seq_len: int):
  """(h_0 [d], its keys/values [k, 2, H, D]): the client's row of `token` at position 0."""
  cache = jnp.zeros((k, 2, seq_len, cfg.n_kv_head, cfg.head_dim), jnp.float32)
  return split.client_step_kv(params, cfg, cache, token, jnp.int32(0))


def known_position0(ws: Workspace, meter: Meter) -> tuple[dict, np.ndarray]:
  """Position 0 of documents that start with a public BOS: (its statistics [B, 1, ...], as
  ChunkSearch's, resolved "known_prefix"; its keys/values [B, k, 2, H, D]).

  The BOS's row is computed once. Its relative distance to each document's h_0 is
  recorded: with exact weights and no defense it is float rounding, and beyond the
  tolerance it says, before any search, that the attacker's client does not reproduce
  the messages (as an unmatched position 0 does without a BOS).
  """
  cfg, k, n = ws.cfg, ws.cut, ws.num_docs
  token = ws.known_prefix[0]
  row, kv = meter("known_prefix", token_step_flops(cfg, k, ws.seq_len), known_row, ws.model_params,
                  jnp.int32(token), cfg=cfg, k=k, seq_len=ws.seq_len)
  h0 = ws.activations[:, 0].astype(np.float64)
  scale = np.maximum(np.sum(h0**2, -1), np.finfo(np.float32).tiny)
  rel = np.sqrt(np.sum((np.asarray(row, np.float64)[None] - h0) ** 2, -1) / scale)
  out = {"tokens": np.full((n, 1), token, np.int32),
         "rel": rel.astype(np.float32)[:, None],
         "runner": np.full((n, 1), np.inf, np.float32),
         "verified": np.zeros((n, 1, len(STAGES)), np.int32),
         "iterations": np.zeros((n, 1, 2), np.int32),
         "resolved": np.full((n, 1), RESOLUTIONS.index("known_prefix"), np.int8)}
  return out, np.broadcast_to(np.asarray(kv), (n, *kv.shape))


def bytes_per_doc(ws: Workspace, settings: Settings, num_proposals: int) -> float:
  """A document's working set: its cache, visited mask, inputs, refinement and policy
  iterates, and the widest verify call (candidates' keys/values and per-block
  activations), plus the policy's distance row."""
  d, k, t, vocab = ws.cfg.n_embd, ws.cut, ws.seq_len, ws.cfg.vocab_size
  kv = cost.kv_width(ws.cfg)  # the cache holds H_kv D wide keys and values (GQA: < d)
  widest = max(settings.batch, num_proposals,
               min(_FIRST_BRUTE_CHUNK, settings.brute_chunk, vocab)
               if settings.brute_force else 0)
  state = 4.0 * (2 * 2 * k * t * kv + 3 * t * d + 2 * d + t * num_proposals) + 2 * vocab
  linearised = 4.0 * (vocab * d + d * k * 14 * d) if settings.brute_force else 0.0
  return state + max(4.0 * widest * k * 14 * d + 8.0 * vocab, linearised)


def _finite(x) -> float | None:
  x = float(x)
  return x if math.isfinite(x) else None


@dataclasses.dataclass(frozen=True)
class SipIt:
  """The registered attack."""

  spec: registry.AttackSpec

  def __call__(self, ws: Workspace, budget, key: jax.Array) -> registry.AttackResult:
    del key  # Nothing is drawn at random (the ridge decode replaces the random start).
    settings = Settings.from_budget(budget)
    meter = Meter(ws)
    # The ridge decode starts the refinement and the policy and orders the brute force.
    shared = ["ridge"]
    decoder = ws.decoder
    calibration = calibrate(ws, settings, meter, decoder)
    e_hat = ws.map_documents(
        lambda h: meter("decode", 2.0 * h.shape[0] * h.shape[1] * ws.cfg.n_embd**2,
                        ridge.decode, decoder.weights, decoder.mu_h, decoder.mu_e, h),
        (ws.activations,), 8.0 * ws.seq_len * ws.cfg.n_embd)
    gradient = ridge_ranked = None
    if settings.gradient_candidates and ws.gradients is not None:
      gradient = ws.gradient_ranked(settings.gradient_candidates, ws.gradients,
                                    "gradient_ranking")
      shared.append("gradient_ranking")
    if settings.ridge_candidates:
      ridge_ranked = ws.activation_ranked(settings.ridge_candidates)
      shared.append("activation_candidates")
    proposals, counts = merge_proposals(gradient, ridge_ranked, ws.seq_len, ws.num_docs)

    if not calibration.refine:
      settings = dataclasses.replace(settings, refine_iters=0)
    out = search_documents(ws, settings, calibration, meter, proposals, counts, e_hat,
                           decoder.weights)
    details = _details(out, settings, calibration, meter, ws, shared, gradient is not None)
    return registry.AttackResult(out["tokens"].astype(np.int32),
                                 float(sum(meter.analytic.values())), details)


def _details(out, settings, calibration, meter, ws, shared, used_gradients) -> dict:
  """The record's statistics: acceptance, where the candidates and the FLOPs went."""
  tolerance = calibration.tolerance
  positions = out["tokens"].size
  tol = calibration.at(np.arange(out["rel"].shape[1]))[None]  # each position's class
  accepted = out["rel"] <= tol
  resolved = {name: int(np.sum(out["resolved"] == i)) for i, name in enumerate(RESOLUTIONS)}
  finite = accepted & np.isfinite(out["runner"])
  runner = out["runner"][finite]
  margin = (out["runner"] / tol)[finite]
  verified = out["verified"]
  iterations = out["iterations"]
  own = {stage: meter.xla[stage]
         for stage in ("calibration", "decode", "known_prefix") + STAGES + ("commit",)}
  stages = {name: ws.costs[name].flops for name in sorted(set(shared))}
  fallbacks = resolved["fallback"]
  inexact = int(out["inexact_documents"].sum())
  note = ""
  if fallbacks:
    note = (f"no candidate within the tolerance at {fallbacks} of {positions} positions: each "
            "took the nearest candidate verified (inexact weights, e.g. trained knowledge, or "
            + ("a budget that stopped the search" if not settings.brute_force
               else "a message that no token reproduces") + ")")
  if inexact and not settings.brute_force_inexact:
    note += (f"; {inexact} of {ws.num_docs} documents: no token reproduces position 0 (the "
             "whole vocabulary tried), so their later positions skipped the brute force")
  return {
      "tolerance": tolerance,
      "calibration_discrepancy": calibration.discrepancy,
      "tolerance_position0": calibration.first_tolerance,
      "calibration_discrepancy_position0": calibration.first_discrepancy,
      "refine_contraction": calibration.contraction,
      "refine_used": calibration.refine,
      "tolerance_factor": settings.tolerance_factor,
      "acceptance_rate": float(accepted.mean()),
      "exact": bool(accepted.all()),
      "fallback_positions": fallbacks,
      "fallback": note,
      "inexact_documents": inexact,
      "resolved_by_stage": resolved,
      "mean_verified_per_position": float(verified.sum() / positions),
      "mean_verified_per_position_by_stage": {
          stage: float(verified[..., i].sum() / positions) for i, stage in enumerate(STAGES)},
      **{f"{stage}_positions": int(np.sum(iterations[..., i] > 0))
         for i, stage in enumerate(("refine", "policy"))},
      **{f"mean_{stage}_iterations": (float(iterations[..., i][iterations[..., i] > 0].mean())
                                      if np.any(iterations[..., i] > 0) else 0.0)
         for i, stage in enumerate(("refine", "policy"))},
      "max_policy_iterations": int(iterations[..., 1].max()),
      "runner_up_margin": _finite(margin.min()) if margin.size else None,
      "runner_up_min_distance": _finite(runner.min()) if runner.size else None,
      "accepted_max_distance": _finite(out["rel"][accepted].max()) if accepted.any() else None,
      "proposals": {"gradient": settings.gradient_candidates if used_gradients else 0,
                    "ridge": settings.ridge_candidates},
      "flops_by_stage": {**own, **{f"shared:{k}": v for k, v in stages.items()}},
      "flops_analytic_by_stage": dict(meter.analytic),
  }


registry.register(SipIt(registry.AttackSpec(
    "sipit", "sequential_inversion", ("activations",), knowledge=("public", "trained"),
    budget_fields=BUDGET_FIELDS,
    description="SipIt exact sequential inversion: ranked proposals, the gradient policy, "
    "brute force; KV-cached verification",
    reference="Nikolaou et al., arXiv 2510.15511",
    threat_model="a passive server that observes h at a known cut, holds the client's "
    "weights (exact under public knowledge; under trained knowledge no candidate matches and "
    "each position takes the nearest one) and public calibration text; where it also "
    "observes g, g[t-1] proposes token t",
    capabilities=("exact recovery with the exact weights", "termination by brute force",
                  "nearest-candidate fallback under inexact weights", "chunking invariance",
                  "gradient proposals where g is observed"),
    checks=(
        ("reference_consistency",
         "tests/test_attacks_sipit.py::test_sipit_equals_brute_force",
         "a float64 numpy brute force over the whole vocabulary at every position"),
        ("synthetic",
         "tests/test_attacks_sipit.py::test_sipit_terminates_through_brute_force",
         "proposals that never hit (deranged gradients, no policy): exact through the fallback"),
        ("synthetic",
         "tests/test_attacks_sipit.py::test_sipit_trained_knowledge_falls_back_to_nearest",
         "perturbed attacker weights: nothing accepted, each position the float64 nearest"),
        ("reference_consistency",
         "tests/test_attacks_sipit.py::test_linearised_order_matches_float64_finite_differences",
         "the brute-force ranking against central differences of a float64 numpy client"),
        ("synthetic",
         "tests/test_attacks_sipit.py::test_sipit_deterministic_and_chunking_invariant",
         "repeated runs and one-document chunks give the same predictions and statistics"),
    ))))


def _lower_bound_flops(s: flops.Shape, budget: dict) -> float:
  """What every run does (lla.attacks.flops, a lower bound): the calibration of the
  tolerance, the ridge decode, the proposal stages and one proposal batch per document and
  position (one document at position 0, whose search documents with the same h_0 share).
  Where a proposal is accepted the search stops; refinement, policy and brute force come
  on top, as the data require."""
  settings = Settings.from_budget(types.SimpleNamespace(**budget))
  d, t = s.cfg.n_embd, s.seq_len
  step = token_step_flops(s.cfg, s.cut, t)
  n = min(settings.calibration_docs, s.n_calibration)
  calibration = 2.0 * n * t * step
  if settings.refine_iters:
    calibration += 2.0 * n * t * d * d + 2.0 * n * t * step
  # The ridge fit (`ridge`, which the ridge ranking includes) and the decode.
  total = calibration + 2.0 * s.num_docs * t * d * d + (
      flops.activation_ranking(s) if settings.ridge_candidates else flops.ridge_fit(s))
  gradient = bool(settings.gradient_candidates) and s.gradients
  if gradient:
    total += flops.gradient_ranking(s)
  if settings.ridge_candidates:  # position 0 has ridge proposals only
    total += settings.batch * step
  if (gradient or settings.ridge_candidates) and t > 1:
    total += (t - 1) * s.num_docs * settings.batch * step
  return total


flops.declare_flops("sipit", _lower_bound_flops, lower_bound=True)
