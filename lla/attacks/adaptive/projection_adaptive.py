"""`projection_adaptive`: the secret projection y = h R of the forward message, undone.

Threat model: the attacker is the server (or an eavesdropper) of a capture defended by
`lla.defenses.SecretProjection`; it knows the mechanism and its public parameters (the
kind, Haar-orthogonal or Gaussian), holds the client layers its knowledge grants and
public calibration text, and never sees R or the seed it came from.

Haar route (an orthogonal R): the Gram matrix of a document's messages is the Gram matrix
of its client rows, <y_s, y_t> = <h_s, h_t>, and the client is causal (row t depends on
the tokens up to t only). So the Gram row of position t, the norm |y_t| and the inner
products <y_t, y_s> with the positions s < t, identifies token t given the tokens before
it, exactly as h_t does for SipIt, with any number of documents and without estimating R.
Position by position, every document at once (one compiled call per candidate chunk,
vmapped over documents, beams and candidates):
  G0. Tolerance: on two calibration documents under the attacker's own draw of a Haar
      projection, the Gram-row residual of the true tokens recomputed exactly as the
      search recomputes them (the KV-cached client step); `projection_tolerance_factor`
      times its maximum (at least float32's epsilon) is the acceptance threshold.
  G1. Position 0: the client's row of every vocabulary token at position 0 (one batched
      forward); a document's candidates are all tokens ranked by
      |norm(client(v)_0) - norm(y_0)| (stable: ties to the lower token id). After a public
      BOS (E.C.known_prefix) the only candidate is the BOS.
  G2. Positions t >= 1: the rows already recognised (K: the rows of each document's best
      beam before t whose prefix matched through them, so exact; only while no row has
      matched anywhere, as under inexact weights, every best beam's rows, approximate)
      span a subspace with orthonormal basis B;
      h_t B = (y_t Y_K^T) U S^-1 (H_K = U S V^T, B = V) is known exactly from inner
      products, and so is the norm of the rest, |h_t (I - B B^T)|. Candidates are ranked
      by the distance (the bound of G3) from a linear surrogate of their client row to
      the vectors with those invariants: row(v) ~ (wte[v] - mu) A + o, A a ridge
      regression of calibration rows on their tokens' embeddings, o the calibration
      residual's mean at position t; a document that widens its search refits its own o
      and a shrunk correction to A on the rows it has verified, each time they double.
  G3. Each (beam, candidate) is one KV-cached client step a = client(prefix, v)_t, scored
      by its squared relative Gram-row residual (the match: ((|a|^2 - |y_t|^2) / |y_t|^2)^2
      + sum_{s<t} ((<a, a_s> - <y_t, y_s>) / (|y_t| |y_s|))^2 with a_s the beam's own
      rows) plus the squared relative distance from a to the set of vectors with h_t's
      invariants against K (|a B - h_t B|^2 + (|a (I - B B^T)| - |h_t (I - B B^T)|)^2,
      over |y_t|^2: zero for the true row, and a nearest-row distance for an inexact
      prefix, which becomes the activation attack's distance once K spans R^d). A
      candidate matches when its RMS match, sqrt(match / (t + 1)), is within the
      tolerance. `projection_candidates` candidates first; a document with no match
      widens in the same order (from its beams whose prefix matched) up to
      `projection_max_candidates`, then (at most
      `projection_fallback_rows` document positions per capture) over the rest of the
      vocabulary, the scan that guarantees exact recovery with exact weights.
  G4. A beam of width `beam_width` per document keeps the lowest summed scores, beams
      whose every position matched first: it carries the norm ties of position 0 to
      position 1, where two invariants separate them. A document none of whose beams
      matched at some position (inexact weights, e.g. trained knowledge, or a token beyond
      the search's reach) has an inexact prefix from there on: its later positions verify
      only the first `projection_candidates` and keep the lowest scores.

Estimate route (a Gaussian R, which preserves inner products only up to O(1/sqrt(d))):
rows are recognised approximately by the same invariants against the rows recognised in
every document, R is estimated by least squares on the recognised pairs, and the
undefended attack runs on y R_hat^-1:
  E0. Tolerance: on the first positions of two calibration documents and a projection of
      its own draw (the same kind), the attacker measures the invariant residual of the
      true rows recomputed the way the search will recompute them;
      `projection_tolerance_factor` times its maximum is the acceptance threshold.
  E1. Position 0: the client's row of every vocabulary token at position 0 (one batched
      forward). Each document's first row is matched by its norm and its inner products
      with the rows already recognised, the least ambiguous documents first.
  E2. Positions t >= 1, all documents whose prefix is recognised, one compiled step per
      position: `projection_candidates` proposals from a ridge decoder of the partial view
      y_t Y_k^+ H_k, fitted on calibration activations projected alike; each is run
      through the KV-cached client from the document's prefix and scored by the relative
      invariant residual over every recognised row. Accepted below tolerance; at a
      position where no proposal is, the whole vocabulary is searched instead (at most
      `projection_fallback_rows` rows in all); a document without an accepted row pauses.
      Until the recognised rows span R^d.
  E3. R_hat: least squares (Procrustes for a Haar kind, which the Gram route replaces) on
      the recognised pairs.
  E4. The undefended attack (ridge candidates, beam search of width W) on y R_hat^-1.
  E5. Up to `projection_refits` times, while R_hat does not reproduce its pairs to float
      precision: the decoded documents' client rows are paired with y where they agree
      with the reconstruction, R_hat is refitted on them, and E4 runs again.
The estimate route needs rows spanning R^d, so many documents at a large d; the Gram
route needs none of that.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from lla.attacks.adaptive import common as adaptive
from lla.attacks import budget as budget_lib
from lla.attacks import candidates as cand_lib
from lla.attacks import registry
from lla.attacks import ridge
from lla.attacks.workspace import Workspace
from lla.defenses import random_projection
from lla.model import cost
from lla.model import split

budget_lib.declare("projection_candidates", 64, int, low=1, high=budget_lib.VOCAB,
                   doc="projection_adaptive: candidates verified first at each position "
                   "(Haar: the first chunk; Gaussian: partial-view ridge proposals per row)",
                   source="lla")
budget_lib.declare("projection_max_candidates", 1024, int, low=1,
                   doc="projection_adaptive (Haar): the most candidates verified at one "
                   "position of a document whose prefix still matches, in ranking order "
                   "(at most the vocabulary)", source="lla")
budget_lib.declare("projection_fallback_rows", 8, int, low=0,
                   doc="projection_adaptive: rows searched over the whole vocabulary when the "
                   "ranked candidates fail (in all, per capture)", source="lla")
budget_lib.declare("projection_tolerance_factor", 10.0, float, low=1.0,
                   doc="projection_adaptive: acceptance threshold over the calibrated "
                   "residual of true rows", source="lla")
budget_lib.declare("projection_refits", 1, int, low=0,
                   doc="projection_adaptive (Gaussian): refits of the map on decoded "
                   "documents", source="lla")

# --- the estimate route (Gaussian), and the position-0 table shared with mixup_adaptive ---

_RANK_RTOL = 1e-6  # singular values below this fraction of the largest: not spanned
_CALIBRATION_POSITIONS = 8  # positions of the tolerance's calibration documents
_EXACT_FIT = 1e-5  # relative fit residual at which a refit cannot improve the map
_RANK_MARGIN = 4  # aim for d + d / margin rows: some recognised rows are dependent


def invariant_cost(rows, known_h, known_scale, gram, norm2):
  """Squared relative invariant residuals of candidate rows.

  Args:
    rows: [C, d] candidate client rows a.
    known_h: [N, d] recognised client rows h_s (zero rows: padding).
    known_scale: [N] |y_s| (1 on padding).
    gram: [N] <y_t, y_s> (0 on padding).
    norm2: scalar |y_t|^2.
  Returns:
    [C] ((|a|^2 - |y_t|^2) / |y_t|^2)^2 + sum_s ((<a, h_s> - <y_t, y_s>) / (|y_t| |y_s|))^2.
  """
  rel_norm = (jnp.sum(rows * rows, -1) - norm2) / norm2
  rel = (rows @ known_h.T - gram) / (jnp.sqrt(norm2) * known_scale)
  return rel_norm**2 + jnp.sum(rel**2, -1)


def _document_scores(params, cfg, known_h, known_scale, t, cache, candidates, gram, norm2):
  step = lambda token: split.client_step_kv(params, cfg, cache, token, t)
  rows, kv = jax.vmap(step)(candidates)                 # [C, d], [C, k, 2, H, D]
  cost = invariant_cost(rows, known_h, known_scale, gram, norm2)
  best = jnp.argmin(cost)
  return cost, rows[best], kv[best]


@functools.partial(jax.jit, static_argnames=("cfg",))
def score_documents(params, known_h, known_scale, t, cache, candidates, gram, norm2, cfg):
  """Every document's candidates at position t from its prefix cache.

  Args:
    cache: [n, k, 2, T, H, D] each document's recognised prefix.
    candidates: [n, C] int32.
    gram: [n, N], norm2: [n] the targets of `invariant_cost`.
  Returns:
    (cost [n, C], best row [n, d], its cache entry [n, k, 2, H, D]).
  """
  one = lambda c, cand, g, n2: _document_scores(params, cfg, known_h, known_scale, t, c, cand,
                                                g, n2)
  return jax.vmap(one)(cache, candidates, gram, norm2)


@jax.jit
def table_costs(table, known_h, known_scale, gram, norm2):
  """`invariant_cost` of every row of table [V, d] (the vocabulary at position 0)."""
  return invariant_cost(table, known_h, known_scale, gram, norm2)


@functools.partial(jax.jit, static_argnames=("cfg", "k"))
def first_rows(params, tokens, cfg, k):
  """[n, d] the client's position-0 row of each token in tokens [n]."""
  return split.client(params, cfg, tokens[:, None], k)[:, 0]


def capacity(ws: Workspace) -> int:
  """Rows the recognised set can hold: every row of the capture (at least two documents,
  the tolerance's calibration)."""
  return max(ws.num_docs, 2) * ws.seq_len


class Known:
  """Recognised (h, y) row pairs, in fixed-capacity padded arrays (one compile)."""

  def __init__(self, capacity: int, d: int):
    self.h = np.zeros((capacity, d), np.float32)
    self.y = np.zeros((capacity, d), np.float32)
    self.count = 0

  def add(self, h_row: np.ndarray, y_row: np.ndarray) -> None:
    self.h[self.count], self.y[self.count] = h_row, y_row
    self.count += 1

  def targets(self, y_rows: np.ndarray):
    """(known_h, known_scale, gram [n, N], norm2 [n]) for rows y_rows [n, d]."""
    scale = np.linalg.norm(self.y, axis=-1)
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    gram = (y_rows.astype(np.float64) @ self.y.T.astype(np.float64)).astype(np.float32)
    norm2 = np.sum(y_rows.astype(np.float64) ** 2, -1).astype(np.float32)
    return self.h, scale, gram, norm2

  def rank(self) -> int:
    if not self.count:
      return 0
    s = np.linalg.svd(self.h[:self.count].astype(np.float64), compute_uv=False)
    return int((s > _RANK_RTOL * s[0]).sum())


def fit_map(h: np.ndarray, y: np.ndarray, kind: str) -> np.ndarray:
  """R_hat [d, d] with y ~ h R_hat from row pairs h, y [n, d]: orthogonal Procrustes for a
  Haar projection (U V^T of the SVD of h^T y), least squares for a Gaussian one."""
  h, y = np.asarray(h, np.float64), np.asarray(y, np.float64)
  if kind == "haar":
    u, _, vt = np.linalg.svd(h.T @ y)
    return u @ vt
  return np.linalg.lstsq(h, y, rcond=None)[0]


def partial_view(known: Known) -> tuple[np.ndarray, np.ndarray]:
  """(M [d, d], P [d, d]): y M = y Y_k^+ H_k is the attacker's view of h, equal to h P (P
  the projector on the recognised rows' span) for an orthogonal projection and its
  least-squares estimate otherwise; and P itself."""
  h = known.h[:known.count].astype(np.float64)
  y = known.y[:known.count].astype(np.float64)
  return (np.linalg.pinv(y, rcond=_RANK_RTOL) @ h,
          np.linalg.pinv(h, rcond=_RANK_RTOL) @ h)


# --- the Gram route (Haar): position by position through rotation invariants -------------

_BASIS_RTOL = 1e-4  # singular values of H_K below this fraction of the largest: left out of B
_WIDE = 8  # widening chunks hold this many times projection_candidates
_CALIBRATION_DOCS = 2  # calibration documents of the Gram route's tolerance
_TOLERANCE_FLOOR = float(np.finfo(np.float32).eps)
_REFIT_SHRINK = 1.0  # ridge strength of a position's own correction, x trace(X^T X) / d


def _beam_costs(params, cfg, basis, t, cache, rows, candidates, gram, scale, norm2, view, rest):
  """One document's (match [W, C], bound [W, C], client rows of beam 0 [C, d]) (step G3).

  Args:
    basis: [d, d] orthonormal columns B spanning the recognised rows K (zero columns
      beyond its rank).
    t: scalar int32 position.
    cache: [W, k, 2, T, H, D] each beam's prefix; rows: [W, T, d] its client rows (zero
      from t on).
    candidates: [C] int32.
    gram: [T] <y_t, y_s> (0 from t on); scale: [T] |y_t| |y_s| (1 from t on).
    norm2: scalar |y_t|^2; view: [d] h_t B; rest: scalar |h_t (I - B B^T)|.
  """
  def one_beam(beam_cache, beam_rows):
    step = lambda v: split.client_step_kv(params, cfg, beam_cache, v, t)[0]
    a = jax.vmap(step)(candidates)                                       # [C, d]
    sq = jnp.sum(a * a, -1)
    rel = (a @ beam_rows.T - gram) / scale                               # [C, T]
    match = ((sq - norm2) / norm2) ** 2 + jnp.sum(rel * rel, -1)
    z = a @ basis
    perp = jnp.sqrt(jnp.maximum(sq - jnp.sum(z * z, -1), 0.0))
    bound = (jnp.sum((z - view) ** 2, -1) + (perp - rest) ** 2) / norm2
    return match, bound, a

  match, bound, a = jax.vmap(one_beam)(cache, rows)
  return match, bound, a[0]


@functools.partial(jax.jit, static_argnames=("cfg",))
def gram_costs(params, basis, t, cache, rows, candidates, gram, scale, norm2, view, rest, cfg):
  """`_beam_costs` of n documents: every array argument after t has a leading [n] axis.
  Returns (match [n, W, C], bound [n, W, C], rows of beam 0 [n, C, d])."""
  one = lambda *doc: _beam_costs(params, cfg, basis, t, *doc)
  return jax.vmap(one)(cache, rows, candidates, gram, scale, norm2, view, rest)


@functools.partial(jax.jit, static_argnames=("cfg",))
def advance(params, t, cache, rows, parents, tokens, cfg):
  """The new beams of n documents at position t: beam w continues beam parents[w] with
  tokens[w]. cache [n, W, k, 2, T, H, D], rows [n, W, T, d], parents and tokens [n, W]
  int32 -> (cache, rows) with position t written."""
  def one_doc(cache_d, rows_d, parents_d, tokens_d):
    def one(parent, token):
      a, kv = split.client_step_kv(params, cfg, cache_d[parent], token, t)
      return split.write_cache(cache_d[parent], kv, t), rows_d[parent].at[t].set(a)
    return jax.vmap(one)(parents_d, tokens_d)

  return jax.vmap(one_doc)(cache, rows, parents, tokens)


def invariant_view(h_known: np.ndarray, y_known: np.ndarray, y_rows: np.ndarray,
                   norm2: np.ndarray):
  """What inner products alone say about the client rows behind y_rows (step G2).

  Args:
    h_known, y_known: [m, d] recognised pairs (client row, its message).
    y_rows: [n, d] messages; norm2: [n] their squared norms.
  Returns:
    (basis [d, d]: orthonormal columns B spanning h_known, zero beyond its rank r;
     view [n, d]: h B, which is y Y_K^T U S^-1 for H_K = U S V^T and any orthogonal R;
     rest [n]: |h (I - B B^T)| = sqrt(|y|^2 - |h B|^2); r).
  """
  d = y_rows.shape[-1]
  basis, view = np.zeros((d, d)), np.zeros((len(y_rows), d))
  r = 0
  if len(h_known):
    u, s, vt = np.linalg.svd(np.asarray(h_known, np.float64), full_matrices=False)
    r = int(np.sum(s > _BASIS_RTOL * s[0])) if s[0] > 0 else 0
    basis[:, :r] = vt[:r].T
    gram = np.asarray(y_rows, np.float64) @ np.asarray(y_known, np.float64).T
    view[:, :r] = gram @ u[:, :r] / s[:r]
  rest = np.sqrt(np.maximum(norm2 - np.sum(view**2, -1), 0.0))
  return basis, view, rest, r


def _bucket(docs: np.ndarray, total: int) -> np.ndarray:
  """docs padded (repeating the first) to a power of two, at most total: few shapes, few
  compiles."""
  size = min(total, 1 << max(0, int(math.ceil(math.log2(len(docs))))))
  return np.concatenate([docs, np.repeat(docs[:1], size - len(docs))]).astype(np.int64)


class _Record:
  """Per document, the `width` best (beam, candidate) pairs verified at one position:
  pairs that match on an exact prefix first, then by total score (ties: verified first,
  beam-major)."""

  def __init__(self, num_docs: int, width: int):
    self.total = np.full((num_docs, width), np.inf)
    self.parent = np.zeros((num_docs, width), np.int32)
    self.token = np.zeros((num_docs, width), np.int32)
    self.rms = np.full((num_docs, width), np.inf)
    self.ok = np.zeros((num_docs, width), bool)

  def merge(self, docs, total, parent, token, rms, ok) -> None:
    """Pairs [n, P] of documents docs [n] (rows in self) into the record."""
    width = self.total.shape[1]
    cat = lambda mine, new: np.concatenate([mine[docs], new], 1)
    total, parent = cat(self.total, total), cat(self.parent, parent)
    token, rms, ok = cat(self.token, token), cat(self.rms, rms), cat(self.ok, ok)
    order = np.argsort(total, axis=1, kind="stable")
    order = np.take_along_axis(order, np.argsort(~np.take_along_axis(ok, order, 1), axis=1,
                                                 kind="stable"), 1)[:, :width]
    take = lambda a: np.take_along_axis(a, order, 1)
    self.total[docs], self.parent[docs], self.token[docs] = take(total), take(parent), take(token)
    self.rms[docs], self.ok[docs] = take(rms), take(ok)

  def matched(self, docs=slice(None)) -> np.ndarray:
    return self.ok[docs].any(1)


class ForwardMap:
  """The attacker's linear surrogate of its client, row(v) ~ (wte[v] - mu) A + o (step G2):
  A by ridge regression of calibration rows on their tokens' embeddings, o per position
  (the calibration residual's mean there); a document position refits its own o and a
  correction D, row(v) ~ (wte[v] - mu) (A + D) + o, on the rows it verified."""

  def __init__(self, ws: Workspace, h_cal: np.ndarray, alpha: float):
    d, cal = ws.cfg.n_embd, ws.calibration_tokens
    wte = np.asarray(ws.wte, np.float64)
    fit = ridge.fit_ridge(wte[cal].reshape(-1, d), h_cal.reshape(-1, d), alpha)
    mu, a = fit.mu_h.astype(np.float64), fit.weights.astype(np.float64)
    self.x = (wte - mu).astype(np.float32)                       # [V, d]
    self.wa = (self.x.astype(np.float64) @ a).astype(np.float32)  # [V, d]
    self.wa2 = np.sum(self.wa * self.wa, -1)
    residual = h_cal.astype(np.float64) - (wte[cal] - mu) @ a    # [N, T, d]
    self.offsets = residual.mean(0)                              # [T, d]
    self.mean_offset = residual.reshape(-1, d).mean(0)
    vocab, rows = wte.shape[0], cal.size
    ws.count_host(ridge.ridge_flops(rows, d, d) + 2.0 * vocab * d * d + 2.0 * rows * d * d)

  def offset(self, t: int) -> np.ndarray:
    return self.offsets[t] if t < len(self.offsets) else self.mean_offset


class _Surrogate:
  """One position's candidate ranking for every document: the vocabulary by the bound
  (the G3 distance of step G2) of its predicted rows, unverified tokens only; each
  document's map refitted on the rows it verified, whenever they have doubled."""

  def __init__(self, ws: Workspace, forward: ForwardMap, t: int, basis, view, rest):
    self.ws, self.forward = ws, forward
    self.basis = basis.astype(np.float32)                       # [d, r]
    self.view, self.rest = view.astype(np.float32), rest.astype(np.float32)
    self.wab = forward.wa @ self.basis                           # [V, r]
    self.wab2 = np.sum(self.wab * self.wab, -1)
    num_docs, d = len(view), forward.wa.shape[1]
    self.offsets = np.repeat(forward.offset(t)[None], num_docs, 0)
    self.maps: dict[int, np.ndarray] = {}
    self.samples: dict[int, list] = {b: [] for b in range(num_docs)}
    self.fitted = np.zeros(num_docs, np.int64)
    ws.count_host(2.0 * self.wab.size * d)

  def add(self, docs, candidates, rows, valid) -> None:
    for i, b in enumerate(docs):
      self.samples[int(b)].append((candidates[i][valid[i]], rows[i][valid[i]]))

  def refit(self, docs) -> None:
    """Each document's o and D, when its verified rows have doubled since the last fit."""
    f, d = self.forward, self.forward.wa.shape[1]
    for b in map(int, docs):
      if not self.samples[b]:
        continue
      tokens = np.concatenate([s[0] for s in self.samples[b]])
      if len(tokens) < 2 * max(self.fitted[b], 1):
        continue
      rows = np.concatenate([s[1] for s in self.samples[b]]).astype(np.float64)
      x = f.x[tokens].astype(np.float64)
      r = rows - f.wa[tokens]
      xm, rm = x.mean(0), r.mean(0)
      xc, rc = x - xm, r - rm
      gram = xc.T @ xc
      lam = _REFIT_SHRINK * max(np.trace(gram), 1e-30) / d
      correction = np.linalg.solve(gram + lam * np.eye(d), xc.T @ rc)
      self.maps[b] = correction.astype(np.float32)
      self.offsets[b] = rm - xm @ correction
      self.fitted[b] = len(tokens)
      self.ws.count_host(4.0 * len(tokens) * d * d + d**3)

  def rank(self, docs, verified, num: int):
    """([n, num] tokens, [n, num] valid): each document's `num` best unverified tokens by
    the bound of their predicted rows (ties: the lower token id); valid is False past the
    unverified ones."""
    f, vocab = self.forward, self.forward.wa.shape[0]
    d, r = self.basis.shape
    docs = np.asarray(docs)
    score = np.empty((len(docs), vocab))
    plain = np.array([int(b) not in self.maps for b in docs], bool)
    if plain.any():
      # Every document without a map of its own at once: z = W A B + o B, expanded.
      o = self.offsets[docs[plain]].astype(np.float32)                 # [m, d]
      ob = o @ self.basis                                               # [m, r]
      diff = ob - self.view[docs[plain]]
      par = self.wab2[:, None] + 2.0 * (self.wab @ diff.T) + np.sum(diff * diff, -1)
      zz = self.wab2[:, None] + 2.0 * (self.wab @ ob.T) + np.sum(ob * ob, -1)
      sq = f.wa2[:, None] + 2.0 * (f.wa @ o.T) + np.sum(o * o, -1)
      perp = np.sqrt(np.maximum(sq - zz, 0.0))
      score[plain] = (np.maximum(par, 0.0) + (perp - self.rest[docs[plain]]) ** 2).T
      self.ws.count_host(2.0 * vocab * len(o) * (2 * r + d) + 12.0 * vocab * len(o))
    for i in np.flatnonzero(~plain):
      b = int(docs[i])
      rows = f.wa + f.x @ self.maps[b] + self.offsets[b].astype(np.float32)
      z = rows @ self.basis
      perp = np.sqrt(np.maximum(np.sum(rows * rows, -1) - np.sum(z * z, -1), 0.0))
      score[i] = np.sum((z - self.view[b]) ** 2, -1) + (perp - self.rest[b]) ** 2
      self.ws.count_host(2.0 * vocab * d * (d + r) + 4.0 * vocab * (d + r))
    score[verified[docs]] = np.inf
    # The `num` lowest, ordered by (score, token id): those below the num-th value, then
    # the lowest ids of those equal to it.
    num = min(num, vocab)
    kth = np.partition(score, num - 1, axis=1)[:, num - 1]
    out = np.zeros((len(docs), num), np.int32)
    valid = np.zeros((len(docs), num), bool)
    for i in range(len(docs)):
      below = np.flatnonzero(score[i] < kth[i])
      chosen = np.concatenate([below, np.flatnonzero(score[i] == kth[i])[:num - len(below)]])
      chosen = chosen[np.lexsort((chosen, score[i, chosen]))]
      out[i, :len(chosen)] = chosen
      valid[i, :len(chosen)] = np.isfinite(score[i, chosen])
    self.ws.count_host(len(docs) * vocab * 4.0)
    return out, valid


class _GramRun:
  """The Gram route (Haar projections): one run on one workspace, its state and analytic
  FLOPs (steps G0-G4 of the module docstring)."""

  def __init__(self, ws: Workspace, budget, key: jax.Array):
    self.ws, self.budget, self.key = ws, budget, key
    cfg = ws.cfg
    self.d, self.vocab = cfg.n_embd, cfg.vocab_size
    self.width = int(budget.beam_width)
    self.first = min(int(budget.projection_candidates), self.vocab)
    self.limit = min(max(int(budget.projection_max_candidates), self.first), self.vocab)
    self.wide = min(_WIDE * self.first, self.vocab)
    self.per_token = ws.cut * cost.token_block_flops(ws.cfg, ws.seq_len)  # a client step
    # A (beam, candidate) pair: the client step, its Gram row, its coordinates in B.
    self.pair_flops = self.per_token + 2.0 * ws.seq_len * self.d + 2.0 * self.d**2
    self.analytic = 0.0

  # --- compiled calls, metered -----------------------------------------------------------

  def bytes_per_doc(self, num_candidates: int, beams: int) -> float:
    ws, d = self.ws, self.d
    per_pair = 17 * d + 2 * ws.cut * d + ws.seq_len * (ws.cfg.n_head + 2)
    state = 2 * ws.cut * ws.seq_len * d + ws.seq_len * d
    return 4.0 * beams * (num_candidates * per_pair + state)

  def costs(self, docs, basis, t, state, candidates, targets, beams: int):
    """(match, bound [n, beams, C], beam 0's rows [n, C, d]) of the first `beams` beams of
    the documents docs [n] (their rows in state and targets), in one executable per
    (bucket, beams, C)."""
    ws = self.ws
    idx = _bucket(docs, max(ws.num_docs, len(docs)))
    cands = np.concatenate([candidates, np.repeat(candidates[:1], len(idx) - len(docs), 0)])
    gram, scale, norm2, view, rest = (a[idx] for a in targets)
    match, bound, rows = ws.map_call(
        gram_costs, (state["cache"][idx, :beams], state["rows"][idx, :beams],
                     cands.astype(np.int32), gram, scale, norm2, view, rest),
        self.bytes_per_doc(cands.shape[1], beams),
        consts=(ws.params, jnp.asarray(basis, jnp.float32), jnp.int32(t)),
        real_fraction=len(docs) / len(idx), cfg=ws.cfg)
    # The bucket's padding shares executables; the attack is charged its documents alone.
    self.analytic += len(docs) * beams * cands.shape[1] * self.pair_flops
    n = len(docs)
    return (np.asarray(match, np.float64)[:n], np.asarray(bound, np.float64)[:n],
            np.asarray(rows)[:n])

  def advance(self, t, state, parents, tokens):
    ws = self.ws
    cache, rows = ws.map_call(advance, (state["cache"], state["rows"], parents.astype(np.int32),
                                        tokens.astype(np.int32)),
                              self.bytes_per_doc(1, self.width),
                              consts=(ws.params, jnp.int32(t)),
                              cfg=ws.cfg)
    self.analytic += parents.size * self.per_token
    state["cache"], state["rows"] = np.asarray(cache), np.asarray(rows)

  def empty_state(self, num_docs: int) -> dict:
    ws, cfg = self.ws, self.ws.cfg
    return {
        "cache": np.zeros((num_docs, self.width, ws.cut, 2, ws.seq_len, cfg.n_kv_head,
                           cfg.head_dim), np.float32),
        "rows": np.zeros((num_docs, self.width, ws.seq_len, self.d), np.float32)}

  def targets(self, y, norm2, t, view=None, rest=None):
    """(gram, scale, norm2, view, rest) of position t, float32 [n, ...]."""
    n, seq_len = y.shape[:2]
    gram, scale = np.zeros((n, seq_len)), np.ones((n, seq_len))
    gram[:, :t] = np.einsum("nd,nsd->ns", y[:, t], y[:, :t])
    scale[:, :t] = np.sqrt(norm2[:, t, None] * norm2[:, :t])
    self.ws.count_host(2.0 * n * t * self.d)
    if view is None:
      view, rest = np.zeros((n, self.d)), np.sqrt(norm2[:, t])
    f32 = lambda a: np.asarray(a, np.float32)
    return f32(gram), f32(scale), f32(norm2[:, t]), f32(view), f32(rest)

  # --- the run ---------------------------------------------------------------------------

  def calibrate(self) -> float:
    """Step G0: the largest RMS Gram-row residual of true tokens on calibration documents
    under the attacker's own Haar projection, recomputed as the search recomputes them."""
    ws = self.ws
    n = min(_CALIBRATION_DOCS, len(ws.calibration_tokens))
    tokens = np.asarray(ws.calibration_tokens[:n], np.int32)
    h = ws.calibration_activations()[:n]
    own = random_projection(jax.random.fold_in(self.key, 7), self.d, "haar")
    # The defense's own arithmetic (lla.defenses.SecretProjection.transform).
    y = np.asarray(jnp.einsum("btd,de->bte", jnp.asarray(h), own), np.float64)
    norm2 = np.maximum(np.sum(y * y, -1), np.finfo(np.float32).tiny)
    state, worst = self.empty_state(n), 0.0
    basis = np.zeros((self.d, self.d))
    parents = np.zeros((n, self.width), np.int32)
    for t in range(min(ws.seq_len, tokens.shape[1])):
      match, _, _ = self.costs(np.arange(n), basis, t, state, tokens[:, t:t + 1],
                               self.targets(y, norm2, t), 1)
      worst = max(worst, float(np.sqrt(np.maximum(match[:, 0, 0], 0.0) / (t + 1)).max()))
      self.advance(t, state, parents, np.repeat(tokens[:, t:t + 1], self.width, 1))
    return max(worst, _TOLERANCE_FLOOR)

  def result(self) -> registry.AttackResult:
    ws, budget = self.ws, self.budget
    num_docs, seq_len, d, width, vocab = (ws.num_docs, ws.seq_len, self.d, self.width,
                                          self.vocab)
    residual = self.calibrate()
    tolerance = float(budget.projection_tolerance_factor) * residual
    y = ws.activations.astype(np.float64)
    norm2 = np.maximum(np.sum(y * y, -1), np.finfo(np.float32).tiny)
    # G1: every token's row at position 0; each document's tokens by norm distance. After
    # a public BOS, position 0 is that token (one candidate, verified like any other).
    if ws.known_prefix:
      first_order = np.full((num_docs, 1), ws.known_prefix[0], np.int32)
    else:
      table = ws.map_call(first_rows, (np.arange(vocab, dtype=np.int32),), 64.0 * d,
                          consts=(ws.params,), cfg=ws.cfg, k=ws.cut)
      self.analytic += vocab * self.per_token
      distance = np.abs(np.linalg.norm(table.astype(np.float64), axis=-1)[None]
                        - np.sqrt(norm2[:, 0])[:, None])
      first_order = np.argsort(distance, axis=1, kind="stable").astype(np.int32)
      ws.count_host(2.0 * vocab * d + 3.0 * num_docs * vocab * math.log2(vocab))
    h_cal = ws.calibration_activations()
    self.analytic += adaptive.client_flops(ws, ws.calibration_tokens.size)
    forward = ForwardMap(ws, h_cal, float(budget.ridge_alpha))

    state = self.empty_state(num_docs)
    tokens = np.zeros((num_docs, width, seq_len), np.int32)
    score = np.full((num_docs, width), np.inf)
    score[:, 0] = 0.0
    exact = np.zeros((num_docs, width), bool)
    exact[:, 0] = True                                  # every position so far matched
    matched = np.zeros((num_docs, width, seq_len), bool)
    fallback_left = int(budget.projection_fallback_rows)
    stats = {"first_chunk_hits": 0, "widened_rows": 0, "widened_hits": 0, "fallback_rows": 0,
             "fallback_hits": 0, "rejected_rows": 0, "candidates_verified": 0}
    max_rms, runner = 0.0, math.inf  # runner: the smallest RMS at t >= 1 that did not match
    everyone = np.arange(num_docs)
    for t in range(seq_len):
      # G2: the partial view through K: the best beams' rows before t whose prefix
      # matched through them, exact pairs with their messages. A position-0 match is one
      # norm, so it counts once position 1 has matched too. Only where no row has matched
      # (inexact weights) do the approximate rows stand in: paired with messages they were
      # not computed from, they bend every document's view (on SmolLM2 at 48 documents the
      # few that failed early stopped every other by position 4).
      exact_rows = np.logical_and.accumulate(matched[:, 0, :t], axis=1)
      if t > 1:
        exact_rows[~exact_rows[:, 1]] = False
      exact_rows = exact_rows.reshape(-1)
      pairs = exact_rows if exact_rows.any() else np.ones_like(exact_rows)
      basis, view, rest, r = invariant_view(state["rows"][:, 0, :t].reshape(-1, d)[pairs],
                                            y[:, :t].reshape(-1, d)[pairs], y[:, t],
                                            norm2[:, t])
      known = int(pairs.sum())
      ws.count_host(4.0 * known * d * min(known, d) + 2.0 * num_docs * known * d)
      targets = self.targets(y, norm2, t, view, rest)
      live = exact.any(1)
      record = _Record(num_docs, width)
      verified = np.zeros((num_docs, vocab), bool)
      surrogate = _Surrogate(ws, forward, t, basis[:, :r], view[:, :r], rest) if t else None

      def verify(docs, cands, valid, beams=width):
        """G3 on candidates [n, C] (valid [n, C]) of docs [n] from their first `beams`
        beams, into the record."""
        nonlocal runner
        match, bound, rows = self.costs(docs, basis, t, state, cands, targets, beams)
        rms = np.sqrt(np.maximum(match, 0.0) / (t + 1))
        total = score[docs][:, :beams, None] + match + bound
        total = np.where(np.isfinite(total) & valid[:, None], total, np.inf)
        prefix = exact[docs][:, :beams, None]
        ok = prefix & (rms <= tolerance) & np.isfinite(total)
        parent = np.broadcast_to(np.arange(beams)[None, :, None], match.shape)
        flat = lambda a: np.ascontiguousarray(a).reshape(len(docs), -1)
        record.merge(docs, flat(total), flat(parent),
                     flat(np.broadcast_to(cands[:, None], match.shape)), flat(rms), flat(ok))
        miss = prefix & valid[:, None] & (rms > tolerance)
        if t and miss.any():
          runner = min(runner, float(rms[miss].min()))
        verified[docs[:, None], cands] |= valid
        stats["candidates_verified"] += int(valid.sum())
        if surrogate is not None:
          surrogate.add(docs, cands, rows, valid)

      # The first chunk, every document.
      if t == 0:
        cands = first_order[:, :self.first]
        verify(everyone, cands, np.ones(cands.shape, bool))
      else:
        verify(everyone, *surrogate.rank(everyone, verified, self.first))
      stats["first_chunk_hits"] += int(record.matched().sum())
      # Widening, then the rest of the vocabulary, while the prefix matches (G3).
      for stage, stop in (("widened", self.limit), ("fallback", vocab)):
        if t == 0 or stop <= self.first or (stage == "fallback" and stop <= self.limit):
          continue
        docs = everyone[live & ~record.matched()]
        if stage == "fallback":
          docs = docs[:fallback_left]
          fallback_left -= len(docs)
        stats[f"{stage}_rows"] += len(docs)
        while docs.size:
          open_ = docs[~record.matched(docs) & (verified[docs].sum(1) < stop)]
          if not open_.size:
            break
          surrogate.refit(open_)
          left = stop - verified[open_].sum(1)
          # One width for every widening chunk (one executable); past `stop`: invalid.
          cands, valid = surrogate.rank(open_, verified, self.wide)
          valid &= np.arange(cands.shape[1])[None] < left[:, None]
          # Only a beam whose prefix matched can match: the best one, unless a tie of
          # position 0 still leaves several (beams whose prefix matched come first).
          verify(open_, cands, valid, width if exact[open_, 1:].any() else 1)
        stats[f"{stage}_hits"] += int(record.matched(docs).sum())
      stats["rejected_rows"] += int((~record.matched()).sum())
      if record.matched().any():
        max_rms = max(max_rms, float(record.rms[record.matched(), 0].max()))
      # G4: the new beams.
      parents = record.parent
      self.advance(t, state, parents, record.token)
      tokens = np.take_along_axis(tokens, parents[:, :, None], 1)
      tokens[:, :, t] = record.token
      matched = np.take_along_axis(matched, parents[:, :, None], 1)
      matched[:, :, t] = record.rms <= tolerance
      exact, score = record.ok, record.total
    predictions = tokens[:, 0]
    best = matched[:, 0]
    rank = 0
    if best.any():
      s = np.linalg.svd(state["rows"][:, 0][best].astype(np.float64), compute_uv=False)
      rank = int(np.sum(s > _BASIS_RTOL * s[0])) if s[0] > 0 else 0
    positions = num_docs * seq_len
    details = {
        "route": "gram", "kind": "haar", "true_row_residual": residual,
        "tolerance": tolerance, "rows_recognised": int(best.sum()),
        "acceptance_rate": float(best.mean()), "exact": bool(best.all()),
        "inexact_documents": int((~best.all(1)).sum()),
        "proposal_hits": stats["first_chunk_hits"],
        "mean_candidates_verified_per_position": stats["candidates_verified"] / positions,
        "accepted_max_rms": max_rms,
        "runner_up_min_rms": runner if math.isfinite(runner) else None,
        "positions": seq_len, "rank": rank, "refits": [], **stats}
    return registry.AttackResult(predictions.astype(np.int32), self.analytic, details)


class ProjectionAdaptive:
  """The registered attack (see the module docstring)."""

  spec = registry.AttackSpec(
      "projection_adaptive", "beam_inversion", ("activations",),
      budget_fields=("candidates", "beam_width", "ridge_alpha", "projection_candidates",
                     "projection_max_candidates", "projection_fallback_rows",
                     "projection_tolerance_factor", "projection_refits"),
      adapts_to=("projection",), reference_attack="activation",
      # 2 (6cf3f3a): the subspace that ranks every document's candidates is built from
      # exact pairs only; revision 1 let a failed document's rows bend the others' view.
      revision=2,
      description="Haar: position-by-position inversion through rotation invariants (each "
      "row's norm and inner products with the positions before it, matched by the "
      "KV-cached client's candidates, beam search); Gaussian: approximate invariants, a "
      "least-squares estimate of the projection, then the undefended attack",
      reference="../shared/notes/adaptive-attacks.md section 5; SipIt (Nikolaou et al. "
      "2510.15511); Thomas et al. 2505.18332 (vocab matching); ALGEN 2502.11308",
      threat_model="knows that h is multiplied by a secret d x d projection and its kind "
      "(Haar or Gaussian), holds the client layers its knowledge grants and public "
      "calibration text; never the projection or its seed. The Haar route reads only "
      "inner products within each document (exact for any number of documents, even a "
      "fresh rotation per document); candidates are ranked with inner products across "
      "the capture's documents, one projection being shared by all of them",
      capabilities=("Haar-orthogonal projection (exact invariants, any number of documents)",
                    "Gaussian projection (approximate invariants, least squares)",
                    "one projection shared by all documents of a capture",
                    "nearest-invariant fallback under inexact weights"),
      checks=(("synthetic", "tests/test_attacks_adaptive.py::test_gram_is_rotation_invariant",
               "Gram matrices of h and h Q within float tolerance (numpy, float64)"),
              ("reference_consistency",
               "tests/test_attacks_adaptive.py::test_projection_adaptive_equals_gram_brute_force",
               "a float64 numpy brute force of the Gram-row residual over the whole "
               "vocabulary at every position; it recovers the text exactly"),
              ("adaptation",
               "tests/test_attacks_adaptive.py::test_projection_adaptive_breaks_the_projection",
               "recovery on a Haar-projection-defended tiny model against activation "
               "undefended, with the default (ranked, capped) search"),
              ("synthetic",
               "tests/test_attacks_adaptive.py::test_projection_adaptive_one_document",
               "a capture of one document, and a rotation per document: exact recovery"),
              ("synthetic",
               "tests/test_attacks_adaptive.py::"
               "test_projection_adaptive_inexact_weights_take_the_nearest",
               "perturbed attacker weights: nothing matches, no search widens")))

  def __call__(self, ws: Workspace, budget, key: jax.Array) -> registry.AttackResult:
    kind = str(adaptive.public_params(ws).get("kind", "haar"))
    if kind == "haar":
      return _GramRun(ws, budget, key).result()
    return _EstimateRun(ws, budget, key).result()


class _EstimateRun:
  """The estimate route (Gaussian projections): one run on one workspace, its state and
  analytic FLOPs (steps E0-E5 of the module docstring)."""

  def __init__(self, ws: Workspace, budget, key: jax.Array):
    self.ws, self.budget, self.key = ws, budget, key
    self.kind = str(adaptive.public_params(ws).get("kind", "haar"))
    if self.kind not in ("haar", "gaussian"):
      raise ValueError(f"projection kind {self.kind!r} is not 'haar' or 'gaussian'")
    self.analytic = 0.0
    cfg = ws.cfg
    self.d = cfg.n_embd
    self.num = min(int(budget.projection_candidates), cfg.vocab_size)
    self.per_token = ws.cut * cost.token_block_flops(ws.cfg, ws.seq_len)  # a client step
    self.empty_cache = np.zeros((ws.num_docs, ws.cut, 2, ws.seq_len, cfg.n_kv_head,
                                 cfg.head_dim), np.float32)

  def result(self) -> registry.AttackResult:
    ws, budget = self.ws, self.budget
    # Every vocabulary token's row at position 0 (step 1, and the tolerance's position 0);
    # after a public BOS only the BOS's, the one row any document starts with.
    self.first_tokens = (np.asarray(ws.known_prefix[:1], np.int32) if ws.known_prefix
                         else np.arange(ws.cfg.vocab_size, dtype=np.int32))
    self.table = ws.map_call(first_rows, (self.first_tokens,), 64.0 * self.d,
                             consts=(ws.params,), cfg=ws.cfg, k=ws.cut)
    self.analytic += len(self.first_tokens) * self.per_token
    self.h_cal = ws.calibration_activations()
    self.analytic += adaptive.client_flops(ws, ws.calibration_tokens.size)
    residual = self.true_row_residual()
    tolerance = float(budget.projection_tolerance_factor) * residual
    known, stats = self.bootstrap(tolerance)
    if known.count == 0:
      raise ValueError("projection_adaptive recognised no row; nothing to fit the map on")
    pairs_h, pairs_y = known.h[:known.count], known.y[:known.count]
    refits = []
    for round_ in range(int(budget.projection_refits) + 1):
      r_hat = fit_map(pairs_h, pairs_y, self.kind)
      ws.count_host(4.0 * len(pairs_h) * self.d**2 + 12.0 * self.d**3)
      unprojected = self.unproject(r_hat)
      predictions, flops = adaptive.undefended_attack(ws, unprojected, int(budget.candidates),
                                                      int(budget.beam_width))
      self.analytic += flops
      entry = {"pairs": int(len(pairs_h)), "fit_residual": float(
          np.linalg.norm(pairs_h @ r_hat - pairs_y) / np.linalg.norm(pairs_y))}
      refits.append(entry)
      # A map fitted exactly on pairs that span R^d cannot improve.
      if round_ == int(budget.projection_refits) or (
          entry["fit_residual"] < _EXACT_FIT and stats["rank"] == self.d):
        break
      # Decoded rows that reproduce the un-projected messages pair with y for the refit.
      decoded = adaptive.client_rows(ws, predictions)
      self.analytic += adaptive.client_flops(ws, predictions.size)
      err = (np.linalg.norm(decoded - unprojected, axis=-1)
             / np.maximum(np.linalg.norm(unprojected, axis=-1), 1e-30))
      agree = err <= max(float(np.quantile(err, 0.5)), 1e-3)
      entry["decoded_rows_agreeing"] = int(agree.sum())
      pairs_h = np.concatenate([known.h[:known.count], decoded[agree]])
      pairs_y = np.concatenate([known.y[:known.count], ws.activations[agree]])
    return registry.AttackResult(predictions, self.analytic, {
        **stats, "route": "estimate", "kind": self.kind, "true_row_residual": residual,
        "tolerance": tolerance, "refits": refits})

  # --- the compiled step, on every document at once --------------------------------------

  def score(self, known: Known, cache, candidates, y_rows, t: int):
    """`score_documents` of candidates [B, C] from caches [B, ...] against rows y_rows
    [B, d] (fixed shapes: one executable for every step of every run)."""
    known_h, scale, gram, norm2 = known.targets(y_rows)
    ws = self.ws
    out = ws.map_call(
        score_documents, (cache, candidates.astype(np.int32), gram, norm2),
        4.0 * (self.num * (2 * ws.cut * self.d + 2 * self.d + known.h.shape[0])
               + 2 * ws.cut * ws.seq_len * self.d),
        consts=(ws.params, known_h, scale, jnp.int32(t)), cfg=ws.cfg)
    self.analytic += candidates.size * (self.per_token + 2.0 * known.h.shape[0] * self.d)
    return out

  def true_row_residual(self) -> float:
    """Max RMS invariant residual of true rows, recomputed as the search recomputes them
    (position 0 from the table, later ones by the KV-cached step), on two calibration
    documents under the attacker's own draw of the projection (step 0)."""
    ws, num_docs = self.ws, self.ws.num_docs
    tokens = ws.calibration_tokens[:2]
    h = self.h_cal[:2]
    r_own = np.asarray(random_projection(jax.random.fold_in(self.key, 7), self.d, self.kind))
    y = (h.astype(np.float64) @ r_own).astype(np.float32)
    known = Known(capacity(ws), self.d)
    for h_row, y_row in zip(h.reshape(-1, self.d), y.reshape(-1, self.d)):
      known.add(h_row, y_row)
    pad = lambda a: np.concatenate([a, np.repeat(a[-1:], num_docs - len(a), 0)]) \
        if len(a) < num_docs else a[:num_docs]
    worst = 0.0
    cache = pad(np.zeros((len(tokens),) + self.empty_cache.shape[1:], np.float32))
    for t in range(min(ws.seq_len, _CALIBRATION_POSITIONS)):
      rows = y[:, t]
      if t == 0:
        known_h, scale, gram, norm2 = known.targets(rows)
        for i, token in enumerate(tokens[:, 0]):
          cost = invariant_cost(jnp.asarray(self.first_row(token)), known_h, scale, gram[i],
                                norm2[i])
          worst = max(worst, float(cost[0]))
      candidates = np.repeat(pad(tokens[:, t])[:, None], self.num, 1)
      cost, _, kv = self.score(known, cache, candidates, pad(rows), t)
      worst = max(worst, float(cost[:len(tokens), 0].max()))
      cache[:, :, :, t] = kv
    return max(math.sqrt(worst / (known.count + 1)), 1e-7)

  def first_row(self, token: int) -> np.ndarray:
    """[1, d] the client's row of `token` at position 0, from the table."""
    return self.table[np.flatnonzero(self.first_tokens == token)[:1]]

  def unproject(self, r_hat: np.ndarray) -> np.ndarray:
    """y R_hat^-1: R_hat^T for an orthogonal estimate, a solve otherwise."""
    y = self.ws.activations.reshape(-1, self.d).astype(np.float64)
    h = y @ r_hat.T if self.kind == "haar" else np.linalg.solve(r_hat.T, y.T).T
    self.ws.count_host(2.0 * y.shape[0] * r_hat.size + 2.0 * self.d**3)
    return h.reshape(self.ws.activations.shape).astype(np.float32)

  def bootstrap(self, tolerance: float):
    """Steps 1 and 2: recognised (h, y) pairs until they span R^d; statistics."""
    ws, d, vocab = self.ws, self.d, self.ws.cfg.vocab_size
    num_docs, seq_len, y_all = ws.num_docs, ws.seq_len, ws.activations
    known = Known(capacity(ws), d)
    stats = {"rows_recognised": 0, "fallback_rows": 0, "fallback_hits": 0,
             "proposal_hits": 0, "rejected_rows": 0, "positions": 0}
    active = np.ones(num_docs, bool)
    cache = self.empty_cache.copy()
    fallbacks_left = int(self.budget.projection_fallback_rows)
    if ws.known_prefix:
      # Every document starts with the public BOS's row: one pair, whatever its count
      # (identical rows add no rank), and no search.
      tokens0 = np.full(num_docs, ws.known_prefix[0], np.int32)
      known.add(self.table[0], y_all[0, 0])
      stats["position0_pairs"] = 1
    else:
      tokens0 = self.match_first_rows(known, active, stats, tolerance)
      stats["position0_pairs"] = known.count
    # The prefix caches of position 0 (the same compiled step, each token as every
    # candidate).
    _, _, kv = self.score(known, cache, np.repeat(tokens0[:, None], self.num, 1), y_all[:, 0], 0)
    cache[:, :, :, 0] = kv
    # Step 2: later positions, every active document together.
    h_cal = self.h_cal.reshape(-1, d).astype(np.float64)
    e_cal = np.asarray(ws.wte)[ws.calibration_tokens].reshape(-1, d)
    attempts = 0
    for t in range(1, seq_len):
      if known.rank() >= d or not active.any():
        break
      stats["positions"] = t
      view, projector = partial_view(known)
      decoder = ridge.fit_ridge(h_cal @ projector, e_cal, float(self.budget.ridge_alpha))
      ws.count_host(2.0 * known.count * d * d + 4.0 * h_cal.shape[0] * d * d + 10.0 * d**3)
      views = (y_all[:, t].astype(np.float64) @ view).astype(np.float32)
      proposals = np.asarray(ws.call(
          cand_lib.decoded_nearest_tokens, decoder.weights, decoder.mu_h, decoder.mu_e,
          ws.wte, jnp.asarray(views), num=self.num))
      self.analytic += cand_lib.candidate_flops(num_docs, vocab, d)
      cost, rows, kv = self.score(known, cache, proposals, y_all[:, t], t)
      rms = np.sqrt(cost.min(-1).astype(np.float64) / (known.count + 1))
      hits = active & (rms <= tolerance)
      stats["proposal_hits"] += int(hits.sum())
      attempts += int(active.sum())
      accepted = [(b, rows[b], kv[b]) for b in np.flatnonzero(hits)]
      # A document that pauses yields no more rows. Where the documents still going are
      # not expected to span R^d (each keeps going with the proposals' success rate so
      # far), a paused row is searched over the whole vocabulary instead, within budget.
      rate = stats["proposal_hits"] / attempts
      remaining = seq_len - t - 1
      per_doc = remaining if rate >= 1 else rate * (1 - rate**remaining) / (1 - rate)
      for b in np.flatnonzero(active & ~hits):
        if fallbacks_left <= 0 or (known.count + len(accepted) * (1 + per_doc)
                                   >= d + d // _RANK_MARGIN):
          break
        fallbacks_left -= 1
        stats["fallback_rows"] += 1
        row, entry, found = self.search_vocabulary(known, cache[b], y_all[b, t], t)
        if found <= tolerance:
          stats["fallback_hits"] += 1
          accepted.append((b, row, entry))
      found = {b for b, _, _ in accepted}
      for b in np.flatnonzero(active):
        if b not in found:
          active[b] = False
          stats["rejected_rows"] += 1
      for b, row, entry in accepted:
        cache[b, :, :, t] = entry
        known.add(row, y_all[b, t])
    stats["rows_recognised"] = known.count
    stats["rank"] = known.rank()
    return known, stats

  def match_first_rows(self, known: Known, active: np.ndarray, stats: dict,
                       tolerance: float) -> np.ndarray:
    """Step 1: each document's first row against the table, least ambiguous documents
    first; a row matched within tolerance joins `known`, a document without one stops
    (`active`). Returns the position-0 tokens [B]."""
    ws, d, vocab = self.ws, self.d, self.ws.cfg.vocab_size
    num_docs, y_all = ws.num_docs, ws.activations
    first = Known(num_docs, d)
    norms = np.sum(self.table.astype(np.float64) ** 2, -1)
    y0 = np.sum(y_all[:, 0].astype(np.float64) ** 2, -1)
    rel = np.abs(norms[None, :] - y0[:, None]) / y0[:, None]
    two = np.sort(np.partition(rel, 1, axis=-1)[:, :2], axis=-1)
    order = np.argsort(two[:, 0] / np.maximum(two[:, 1], 1e-30), kind="stable")
    ws.count_host(3.0 * num_docs * vocab)
    tokens0 = np.zeros(num_docs, np.int32)
    for b in order:
      known_h, scale, gram, norm2 = first.targets(y_all[b:b + 1, 0])
      cost = np.asarray(ws.call(table_costs, self.table, known_h, scale, gram[0], norm2[0]))
      self.analytic += 2.0 * vocab * (num_docs + 1) * d
      token = int(np.argmin(cost))
      if math.sqrt(cost[token] / (first.count + 1)) > tolerance:
        active[b] = False
        stats["rejected_rows"] += 1
        continue
      first.add(self.table[token], y_all[b, 0])
      known.add(self.table[token], y_all[b, 0])
      tokens0[b] = token
    return tokens0

  def search_vocabulary(self, known: Known, cache, y_row, t: int):
    """The whole vocabulary at position t from one document's prefix, B x C tokens per
    compiled step: (row, cache entry, RMS residual) of the best."""
    ws = self.ws
    block = ws.num_docs * self.num
    caches = np.repeat(cache[None], ws.num_docs, 0)
    rows = np.repeat(y_row[None], ws.num_docs, 0)
    best = (None, None, math.inf)
    for start in range(0, ws.cfg.vocab_size, block):
      tokens = (np.arange(start, start + block) % ws.cfg.vocab_size).reshape(ws.num_docs, -1)
      cost, row, entry = self.score(known, caches, tokens, rows, t)
      b = int(np.argmin(cost.min(-1)))
      rms = math.sqrt(float(cost[b].min()) / (known.count + 1))
      if rms < best[2]:
        best = (row[b], entry[b], rms)
    return best


registry.register(ProjectionAdaptive())
