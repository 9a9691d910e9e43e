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
`sipit_tolerance_factor`. Under `trained` knowledge (the attacker's weights differ from the
client's) nothing matches: such a position takes the nearest candidate verified (the whole
vocabulary's nearest with `sipit_brute_force`), and the record counts these fallbacks.

Vectorisation: documents go through `Workspace.map_documents` in memory-bounded chunks.
Within a chunk each step is one compiled call, vmapped over the documents still searching
(compacted to a power-of-two bucket, so that documents that accepted cost nothing and each
bucket size compiles once), and the loops over positions and iterations run in Python, so
that the metered FLOPs are what ran. The attack draws nothing at random.
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

from kernels import vocab_topk
from lla.attacks.seed import beam
from lla.attacks import budget as budget_lib
from lla.attacks import flops
from lla.attacks import registry
from lla.attacks import ridge
from lla.attacks import workspace as workspace_lib
from lla.attacks.workspace import Workspace
from lla.model import split
from lla.model.gpt2 import GPT2Config

STAGES = ("proposals", "refine", "policy", "brute_force")
# How a position was settled (the `resolved` statistic).
RESOLUTIONS = STAGES + ("shared_position0", "fallback")
_FIRST_BRUTE_CHUNK = 16
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


# --- compiled steps (one position, documents `idx` of a chunk of N) -----------------------


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


@functools.partial(jax.jit, static_argnames=("cfg",))
def verify(params, cache, visited, record, idx, candidates, valid, t, target, cfg: GPT2Config):
  """Verifies candidates of the documents idx at position t.

  Args:
    cache: [N, k, 2, T, H, D] keys/values of each document's recovered prefix.
    visited: [N, V] bool tokens verified at this position.
    record: the position record, {"rel", "runner": [N] float32, "token": [N] int32,
      "kv": [N, k, 2, H, D]}.
    idx: [n] int32 documents to verify (repeats allowed: they compute the same rows).
    candidates, valid: [n, c] int32 tokens and which of them count.
    t: scalar int32 position.
    target: [N, d] observed h_t.

  Returns:
    (visited, record) with the rows of idx updated.
  """
  def one(cache_d, visited_d, record_d, cand, val, target_d):
    rel, kv = _verify_one(params, cfg, cache_d, cand, t, target_d)
    return _mark(visited_d, cand, val), _merge(record_d, rel, cand, kv, val)

  new_visited, new_record = jax.vmap(one)(cache[idx], visited[idx], _rows(record, idx),
                                          candidates, valid, target[idx])
  return visited.at[idx].set(new_visited), _set_rows(record, idx, new_record)


@functools.partial(jax.jit, static_argnames=("cfg", "num"))
def policy_step(params, cache, visited, record, e, idx, t, target, snap, step_size, clip,
                cfg: GPT2Config, num: int):
  """One iteration of the gradient policy for the documents idx at position t.

  Projects e [N, d] onto its `num` nearest unvisited vocabulary rows and verifies them;
  if `snap`, e first jumps to the nearest of them (as published, that row is the one
  verified in the iteration); then one SGD step on mean((client(prefix, e)_t - h_t)^2)
  with the gradient rescaled to norm `clip` when longer. Other arguments as in `verify`.

  Returns:
    (visited, record, e, loss [n] at the pre-step e).
  """
  wte = split.wte(params)

  def one(cache_d, visited_d, record_d, e_d, target_d):
    cand, valid = _nearest_unvisited(wte, visited_d, e_d, num)
    e_d = jnp.where(snap, wte[cand[0]], e_d)
    rel, kv = _verify_one(params, cfg, cache_d, cand, t, target_d)

    def loss_fn(e_):
      h, _ = split.client_step_embedding(params, cfg, cache_d, e_, t)
      return jnp.mean((h - target_d) ** 2)

    loss, grad = jax.value_and_grad(loss_fn)(e_d)
    norm = jnp.sqrt(jnp.sum(grad**2))
    grad = jnp.where(norm > clip, grad * (clip / norm), grad)
    return (_mark(visited_d, cand, valid), _merge(record_d, rel, cand, kv, valid),
            e_d - step_size * grad, loss)

  new_visited, new_record, new_e, loss = jax.vmap(one)(
      cache[idx], visited[idx], _rows(record, idx), e[idx], target[idx])
  return (visited.at[idx].set(new_visited), _set_rows(record, idx, new_record),
          e.at[idx].set(new_e), loss)


def _nearest_unvisited(wte, visited, e, num):
  """The `num` nearest unvisited rows of wte [V, d] to e [d]: (ids [num], valid [num])."""
  neg_dist, ids = vocab_topk.topk(e, wte, num, "neg_sq_dist", mask=visited)
  return ids, jnp.isfinite(neg_dist)


@functools.partial(jax.jit, static_argnames=("cfg", "num"))
def refine_step(params, cache, visited, record, e, idx, t, target, inverse, cfg: GPT2Config,
                num: int):
  """One ridge-preconditioned refinement step for the documents idx at position t.

  The ridge decoder's weights W [d, d] are a global linear inverse of the client, used
  here as an approximate inverse Jacobian: e <- e + (h_t - client(prefix, e)_t) W, a
  Newton-like step that needs one forward and no gradient. The `num` nearest unvisited
  rows to the new e are verified. Other arguments as in `verify`.

  Returns:
    (visited, record, e, residual [n] = ||h_t - client(prefix, e)_t|| at the old e).
  """
  wte = split.wte(params)

  def one(cache_d, visited_d, record_d, e_d, target_d):
    out, _ = split.client_step_embedding(params, cfg, cache_d, e_d, t)
    residual = target_d - out
    e_d = e_d + residual @ inverse
    cand, valid = _nearest_unvisited(wte, visited_d, e_d, num)
    rel, kv = _verify_one(params, cfg, cache_d, cand, t, target_d)
    return (_mark(visited_d, cand, valid), _merge(record_d, rel, cand, kv, valid), e_d,
            jnp.sqrt(jnp.sum(residual**2)))

  new_visited, new_record, new_e, residual = jax.vmap(one)(
      cache[idx], visited[idx], _rows(record, idx), e[idx], target[idx])
  return (visited.at[idx].set(new_visited), _set_rows(record, idx, new_record),
          e.at[idx].set(new_e), residual)


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
  """`Workspace.call` that also tallies FLOPs (XLA and analytic) per SipIt stage."""

  def __init__(self, ws: Workspace):
    self.ws = ws
    self.xla = collections.defaultdict(float)
    self.analytic = collections.defaultdict(float)

  def __call__(self, stage: str, analytic: float, jitted, *args, **kwargs):
    out = self.ws.call(jitted, *args, **kwargs)
    # A cache hit now (ws.call compiled it): the FLOPs of the call that just ran.
    flops = workspace_lib.compiled(jitted, *args, **kwargs)[2]
    self.xla[stage] += flops or 0.0
    self.analytic[stage] += analytic
    return out


def token_step_flops(cfg: GPT2Config, k: int, seq_len: int) -> float:
  """Analytic FLOPs of one KV-cached client step (beam search's per-token count)."""
  return beam.analytic_flops(cfg, k, 1, 1, 1, seq_len) / seq_len


def _bucket(active: np.ndarray, limit: int) -> jax.Array:
  """active [n] document indices padded (repeating the last) to min(limit, 2^ceil(log2 n))."""
  size = min(limit, 1 << max(len(active) - 1, 0).bit_length())
  return jnp.asarray(np.concatenate([active, np.repeat(active[-1:], size - len(active))]),
                     jnp.int32)


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
    tolerance: the acceptance tolerance on the relative distance.
    discrepancy: the largest relative distance between the batched client and the
      KV-cached recomputation of the true prefixes.
    contraction: the median over calibration positions of the residual ratio after one
      refinement step from the ridge decode (None when refinement is off); the
      refinement stage runs only where it is below 1.
  """

  tolerance: float
  discrepancy: float
  contraction: float | None

  @property
  def refine(self) -> bool:
    return self.contraction is not None and self.contraction < 1.0


def calibrate(ws: Workspace, settings: Settings, meter: Meter,
              decoder: ridge.RidgeDecoder) -> Calibration:
  """Recomputes the first calibration documents position by position with the KV cache:
  the tolerance is the largest relative distance to the batched client (at least float32's
  epsilon) times the safety factor; the refinement's contraction is measured on the way."""
  cfg, k, params = ws.cfg, ws.cut, ws.params
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
  worst, contractions = 0.0, []
  for t in range(seq_len):
    tt = jnp.int32(t)
    if settings.refine_iters:
      contractions.append(np.asarray(meter(
          "calibration", 2 * n * step, refine_contraction, params, cache, tt, batched[:, t],
          e_hat[:, t], jnp.asarray(decoder.weights), cfg=cfg)))
    _, record = meter("calibration", n * step, verify, params, cache, visited,
                      empty_record(cfg, k, n), idx, jnp.asarray(tokens[:, t:t + 1]), ones,
                      tt, batched[:, t], cfg=cfg)
    worst = max(worst, float(np.max(np.asarray(record["rel"]))))
    cache = meter("calibration", 0.0, commit, cache, record, tt)
  if not math.isfinite(worst):
    raise FloatingPointError("sipit: the calibration documents give a non-finite discrepancy")
  discrepancy = max(worst, float(np.finfo(np.float32).eps))
  contraction = float(np.median(np.concatenate(contractions))) if contractions else None
  return Calibration(settings.tolerance_factor * discrepancy, worst, contraction)


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


class ChunkSearch:
  """SipIt over one chunk of documents (all arrays [n, ...]) at `positions`.

  `search` [n] bool marks the documents to search (the others keep an empty record);
  `brute` [n] bool the documents whose open positions end in the brute force;
  `prefix_kv` [n, k, 2, H, D], the keys/values of position 0, is given when the positions
  start at 1 (position 0 is searched in a pass of its own).
  """

  def __init__(self, ws: Workspace, settings: Settings, tolerance: float, meter: Meter,
               positions, inverse):
    self.ws, self.s, self.tol, self.meter = ws, settings, tolerance, meter
    self.inverse = jnp.asarray(inverse)
    self.positions = tuple(positions)
    self.step_flops = token_step_flops(ws.cfg, ws.cut, ws.seq_len)
    d, vocab = ws.cfg.n_embd, ws.cfg.vocab_size
    # d JVPs (a forward each, twice over) and the [V, d] x [d, d] prediction.
    self.linearise_flops = (2 * d + 1) * self.step_flops + 2.0 * vocab * d * d

  def __call__(self, h, proposals, counts, e_hat, doc_index, search, brute, prefix_kv=None):
    cfg, k = self.ws.cfg, self.ws.cut
    n, seq_len = h.shape[:2]
    h, e_hat = jnp.asarray(h), jnp.asarray(e_hat)
    proposals, counts, doc_index = np.asarray(proposals), np.asarray(counts), np.asarray(doc_index)
    self.n, self.search, self.brute = n, np.asarray(search), np.asarray(brute)
    cache = jnp.zeros((n, k, 2, seq_len, cfg.n_kv_head, cfg.head_dim), jnp.float32)
    if prefix_kv is not None:
      cache = self.meter("commit", 0.0, commit, cache, {"kv": jnp.asarray(prefix_kv)},
                         jnp.int32(0))
    width = len(self.positions)
    out = {"tokens": np.zeros((n, width), np.int32),
           "rel": np.zeros((n, width), np.float32),
           "runner": np.zeros((n, width), np.float32),
           "verified": np.zeros((n, width, len(STAGES)), np.int32),
           "iterations": np.zeros((n, width, 2), np.int32),
           "resolved": np.zeros((n, width), np.int8)}
    for j, t in enumerate(self.positions):
      record, stats = self._position(t, cache, h[:, t], proposals[:, t], counts[:, t],
                                     e_hat[:, t], doc_index)
      cache = self.meter("commit", 0.0, commit, cache, record, jnp.int32(t))
      out["tokens"][:, j] = np.asarray(record["token"])
      out["rel"][:, j] = np.asarray(record["rel"])
      out["runner"][:, j] = np.asarray(record["runner"])
      for key in ("verified", "iterations", "resolved"):
        out[key][:, j] = stats[key]
    out["kv"] = np.asarray(record["kv"])  # the last position's
    return out

  def _position(self, t, cache, target, proposals, counts, e, doc_index):
    """Searches position t for every document of the chunk: (record, statistics)."""
    ws, s, n = self.ws, self.s, self.n
    vocab = ws.cfg.vocab_size
    record = empty_record(ws.cfg, ws.cut, n)
    visited = jnp.zeros((n, vocab), jnp.bool_)
    seen = np.zeros(n, np.int64)
    verified = np.zeros((n, len(STAGES)), np.int32)
    iterations = np.zeros((n, 2), np.int32)  # refinement, policy
    resolved = np.full(n, RESOLUTIONS.index("fallback"), np.int8)
    tt = jnp.int32(t)

    def open_docs(candidates_left):
      return np.flatnonzero(self.search & (np.asarray(record["rel"]) > self.tol)
                            & candidates_left)

    def settle(stage):
      accepted = np.asarray(record["rel"]) <= self.tol
      fresh = self.search & accepted & (resolved == RESOLUTIONS.index("fallback"))
      resolved[fresh] = RESOLUTIONS.index(stage)

    # 1. Proposals, in batches.
    for j in range(0, proposals.shape[-1], s.batch):
      active = open_docs(counts > j)
      if not active.size:
        break
      idx = _bucket(active, n)
      # A fixed width (the last batch padded) so that one executable serves every batch.
      cands = np.pad(proposals[np.asarray(idx), j:j + s.batch],
                     ((0, 0), (0, max(0, j + s.batch - proposals.shape[-1]))))
      valid = np.arange(j, j + s.batch)[None] < counts[np.asarray(idx)][:, None]
      visited, record = self.meter(
          "proposals", len(idx) * cands.shape[1] * self.step_flops, verify, ws.params, cache,
          visited, record, idx, jnp.asarray(cands), jnp.asarray(valid), tt, target, cfg=ws.cfg)
      got = valid[:len(active)].sum(-1)
      verified[active, 0] += got
      seen[active] += got
    settle("proposals")

    def checked(stage, residual, active, i):
      residual = np.asarray(residual)[:len(active)]
      if not np.all(np.isfinite(residual)):
        bad = int(doc_index[active[np.flatnonzero(~np.isfinite(residual))[0]]])
        raise FloatingPointError(f"sipit: non-finite {stage} residual at position {t}, "
                                 f"iteration {i}, document {bad}")
      return residual

    d, num = ws.cfg.n_embd, min(s.batch, vocab)
    nearest_flops = 2.0 * vocab * d
    # 2. Ridge-preconditioned refinement from the ridge decode, while the residual falls.
    e_refined, last = e, np.full(n, np.inf)
    falling = np.ones(n, bool)
    refine_flops = (1 + num) * self.step_flops + nearest_flops + 2.0 * d * d
    for i in range(s.refine_iters):
      active = open_docs((seen < vocab) & falling)
      if not active.size:
        break
      idx = _bucket(active, n)
      visited, record, e_refined, residual = self.meter(
          "refine", len(idx) * refine_flops, refine_step, ws.params, cache, visited, record,
          e_refined, idx, tt, target, self.inverse, cfg=ws.cfg, num=num)
      residual = checked("refinement", residual, active, i)
      falling[active] = residual < last[active]
      last[active] = residual
      got = np.minimum(num, vocab - seen[active])
      verified[active, 1] += got
      seen[active] += got
      iterations[active, 0] += 1
    settle("refine")

    # 3. The paper's gradient policy, from the ridge decode.
    reset = s.reset_every * (1 + (vocab // _VOCAB_SCALE) * (t == 0))
    e_policy = e
    step = jnp.float32(s.step_size), jnp.float32(s.grad_clip)
    policy_flops = (num + 3) * self.step_flops + nearest_flops
    for i in range(s.max_iters):
      active = open_docs(seen < vocab)
      if not active.size:
        break
      idx = _bucket(active, n)
      snap = jnp.bool_(i > 0 and i % reset == 0)
      visited, record, e_policy, loss = self.meter(
          "policy", len(idx) * policy_flops, policy_step, ws.params, cache, visited, record,
          e_policy, idx, tt, target, snap, *step, cfg=ws.cfg, num=num)
      checked("policy loss", loss, active, i)
      got = np.minimum(num, vocab - seen[active])
      verified[active, 2] += got
      seen[active] += got
      iterations[active, 1] += 1
    settle("policy")

    # 4. Brute force: every token not yet verified, ranked by the linearised client.
    if s.brute_force:
      lists = {}
      for doc in open_docs((seen < vocab) & self.brute):
        order = np.asarray(self.meter(
            "brute_force", self.linearise_flops, linearised_order, ws.params, cache, visited,
            e, jnp.asarray([doc], jnp.int32), tt, target, cfg=ws.cfg))
        lists[int(doc)] = order[:vocab - seen[doc]]
      # Chunks double from 16 up to sipit_brute_chunk: the ranking puts the token near the
      # top where the linearisation holds, and the scan still ends in few calls where not.
      j, width = 0, min(_FIRST_BRUTE_CHUNK, s.brute_chunk, vocab)
      while True:
        active = open_docs(np.array([len(lists.get(doc, ())) > j for doc in range(n)]))
        if not active.size:
          break
        idx = _bucket(active, n)
        rows = [lists[int(doc)][j:j + width] for doc in np.asarray(idx)]
        cands = np.stack([_padded(r, width, 0) for r in rows])
        valid = np.stack([np.arange(width) < len(r) for r in rows])
        visited, record = self.meter(
            "brute_force", len(idx) * width * self.step_flops, verify, ws.params, cache,
            visited, record, idx, jnp.asarray(cands), jnp.asarray(valid), tt, target,
            cfg=ws.cfg)
        verified[active, 3] += valid[:len(active)].sum(-1)
        j, width = j + width, min(2 * width, s.brute_chunk, vocab)
      settle("brute_force")
    return record, {"verified": verified, "iterations": iterations, "resolved": resolved}


def search_documents(ws: Workspace, settings: Settings, tolerance: float, meter: Meter,
                     proposals: np.ndarray, counts: np.ndarray, e_hat: np.ndarray,
                     inverse: np.ndarray) -> dict:
  """Every document searched, in chunks: statistics [B, T, ...] (see ChunkSearch).

  Position 0 depends on its token alone, so it is searched once per distinct h_0 (in a
  pass of its own, so that the sharing does not depend on the chunking); its result is
  the prefix of every document with that h_0. A document whose position 0 no token
  reproduces after the brute force has tried the whole vocabulary has messages that the
  attacker's client cannot produce exactly (inexact weights, or a defense that altered h);
  without `brute_force_inexact` its later positions take the nearest candidate that the
  proposals, refinement and policy verified, skipping a brute force that could not end in
  an acceptance either.
  """
  h, doc_index = ws.activations, ws.doc_index
  per_doc = bytes_per_doc(ws, settings, proposals.shape[-1])
  rows = np.ascontiguousarray(h[:, 0]).view(np.dtype((np.void, h.dtype.itemsize * h.shape[-1])))
  _, first, group = np.unique(rows.reshape(-1), return_index=True, return_inverse=True)
  source = first[group.reshape(-1)]        # each document's first document with its h_0
  shared = source != np.arange(ws.num_docs)
  everyone = np.ones(ws.num_docs, bool)
  head = ws.map_documents(ChunkSearch(ws, settings, tolerance, meter, (0,), inverse),
                          (h, proposals, counts, e_hat, doc_index, ~shared, everyone), per_doc)
  out = {key: value[source] for key, value in head.items() if key != "kv"}
  out["verified"][shared] = 0
  out["iterations"][shared] = 0
  fallback = RESOLUTIONS.index("fallback")
  inexact = (out["resolved"][:, 0] == fallback) & settings.brute_force
  brute = ~inexact | settings.brute_force_inexact
  out["resolved"][shared] = np.where(out["resolved"][shared] == fallback, fallback,
                                     RESOLUTIONS.index("shared_position0"))
  if ws.seq_len > 1:
    tail = ws.map_documents(
        ChunkSearch(ws, settings, tolerance, meter, range(1, ws.seq_len), inverse),
        (h, proposals, counts, e_hat, doc_index, everyone, brute, head["kv"][source]),
        per_doc)
    out = {key: np.concatenate([out[key], tail[key]], axis=1) for key in out}
  out["inexact_documents"] = inexact
  return out


def bytes_per_doc(ws: Workspace, settings: Settings, num_proposals: int) -> float:
  """A document's working set: its cache, visited mask, inputs, and the widest verify call
  (candidates' keys/values and per-block activations), plus the policy's distance row."""
  d, k, t, vocab = ws.cfg.n_embd, ws.cut, ws.seq_len, ws.cfg.vocab_size
  widest = max(settings.batch, num_proposals,
               min(settings.brute_chunk, vocab) if settings.brute_force else 0)
  state = 4.0 * (2 * 2 * k * t * d + 3 * t * d + t * num_proposals) + 2 * vocab
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
    out = search_documents(ws, settings, calibration.tolerance, meter, proposals, counts, e_hat,
                           decoder.weights)
    details = _details(out, settings, calibration, meter, ws, shared, gradient is not None)
    return registry.AttackResult(out["tokens"].astype(np.int32),
                                 float(sum(meter.analytic.values())), details)


def _details(out, settings, calibration, meter, ws, shared, used_gradients) -> dict:
  """The record's statistics: acceptance, where the candidates and the FLOPs went."""
  tolerance = calibration.tolerance
  positions = out["tokens"].size
  accepted = out["rel"] <= tolerance
  resolved = {name: int(np.sum(out["resolved"] == i)) for i, name in enumerate(RESOLUTIONS)}
  runner = out["runner"][accepted]
  runner = runner[np.isfinite(runner)]
  verified = out["verified"]
  iterations = out["iterations"]
  own = {stage: meter.xla[stage] for stage in ("calibration", "decode") + STAGES + ("commit",)}
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
      "runner_up_margin": _finite(runner.min() / tolerance) if runner.size else None,
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
