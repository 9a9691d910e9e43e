"""`projection_adaptive`: the secret projection y = h R of the forward message, undone.

Threat model: the attacker is the server (or an eavesdropper) of a capture defended by
`lla.defenses.SecretProjection`; it knows the mechanism and its public parameters (the
kind, Haar-orthogonal or Gaussian), holds the client layers its knowledge grants and
public calibration text, and never sees R or the seed it came from.

Why it works: an orthogonal R preserves every inner product, within and across documents
(`<y_i, y_j> = <h_i, h_j>`), and the client is causal, so row t depends on the tokens up
to t only. Rows can therefore be recognised by rotation-invariant costs before R is
known; once the recognised rows span R^d, R follows by orthogonal Procrustes and every
document is inverted as if undefended. A Gaussian R preserves inner products only up to
O(1/sqrt(d)), so there the recognition is approximate and R comes from least squares on
the recovered pairs, iterated over the decoded documents.

Algorithm (PROTOCOL section 5a; design note adaptive-attacks.md section 5):
  0. Tolerance: on the first positions of two calibration documents and a projection of
     its own draw (the same kind), the attacker measures the invariant residual of the
     true rows recomputed the way the search will recompute them;
     `projection_tolerance_factor` times its maximum is the acceptance threshold.
  1. Position 0: the client's row of every vocabulary token at position 0 (one batched
     forward). Each document's first row is matched by its norm and its inner products
     with the rows already recognised, the least ambiguous documents first.
  2. Positions t >= 1, all documents whose prefix is recognised, one compiled step per
     position: `projection_candidates` proposals from a ridge decoder of the partial view
     y_t Y_k^+ H_k (= h_t P, P the projector on the recognised rows' span, for any
     orthogonal R), fitted on calibration activations projected alike; each is run
     through the KV-cached client from the document's prefix and scored by the relative
     invariant residual ((|a|^2 - |y_t|^2) / |y_t|^2 and (<a, h_s> - <y_t, y_s>) /
     (|y_t| |y_s|) over every recognised row s). Accepted below tolerance; at a position
     where no proposal is, the whole vocabulary is searched instead (at most
     `projection_fallback_rows` rows in all); a document without an accepted row pauses.
     Until the recognised rows span R^d.
  3. R_hat: Procrustes (Haar) or least squares (Gaussian) on the recognised pairs.
  4. The undefended attack (ridge candidates, beam search of width W) on y R_hat^-1.
  5. Up to `projection_refits` times, while R_hat does not reproduce its pairs to float
     precision: the decoded documents' client rows are paired with y where they agree
     with the reconstruction, R_hat is refitted on them, and step 4 runs again.
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
from lla.model import split

budget_lib.declare("projection_candidates", 64, int, low=1, high=budget_lib.VOCAB,
                   doc="projection_adaptive: partial-view ridge proposals per row", source="lla")
budget_lib.declare("projection_fallback_rows", 8, int, low=0,
                   doc="projection_adaptive: rows searched over the whole vocabulary when the "
                   "proposals fail", source="lla")
budget_lib.declare("projection_tolerance_factor", 10.0, float, low=1.0,
                   doc="projection_adaptive: acceptance threshold over the calibrated "
                   "residual of true rows", source="lla")
budget_lib.declare("projection_refits", 1, int, low=0,
                   doc="projection_adaptive: refits of the map on decoded documents",
                   source="lla")

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


class ProjectionAdaptive:
  """The registered attack (see the module docstring)."""

  spec = registry.AttackSpec(
      "projection_adaptive", "beam_inversion", ("activations",),
      budget_fields=("candidates", "beam_width", "ridge_alpha", "projection_candidates",
                     "projection_fallback_rows", "projection_tolerance_factor",
                     "projection_refits"),
      adapts_to=("projection",), reference_attack="activation",
      description="rotation-invariant row recognition, Procrustes / least-squares estimate "
      "of the secret projection, then the undefended attack on the un-projected messages",
      reference="../shared/notes/adaptive-attacks.md section 5; Thomas et al. 2505.18332 "
      "(vocab matching); Giannella et al. 0911.2942; ALGEN 2502.11308",
      threat_model="knows that h is multiplied by a secret d x d projection and its kind "
      "(Haar or Gaussian), holds the client layers its knowledge grants and public "
      "calibration text; never the projection or its seed",
      capabilities=("Haar-orthogonal projection (exact invariants)",
                    "Gaussian projection (approximate invariants, least squares)",
                    "one projection shared by all documents of a capture"),
      checks=(("synthetic", "tests/test_attacks_adaptive.py::test_gram_is_rotation_invariant",
               "Gram matrices of h and h Q within float tolerance (numpy, float64)"),
              ("adaptation",
               "tests/test_attacks_adaptive.py::test_projection_adaptive_breaks_the_projection",
               "recovery on a Haar-projection-defended tiny model against activation "
               "undefended")))

  def __call__(self, ws: Workspace, budget, key: jax.Array) -> registry.AttackResult:
    return _Run(ws, budget, key).result()


class _Run:
  """One run of the attack on one workspace (its state and analytic FLOPs)."""

  def __init__(self, ws: Workspace, budget, key: jax.Array):
    self.ws, self.budget, self.key = ws, budget, key
    self.kind = str(adaptive.public_params(ws).get("kind", "haar"))
    if self.kind not in ("haar", "gaussian"):
      raise ValueError(f"projection kind {self.kind!r} is not 'haar' or 'gaussian'")
    self.analytic = 0.0
    cfg = ws.cfg
    self.d = cfg.n_embd
    self.num = min(int(budget.projection_candidates), cfg.vocab_size)
    self.per_token = ws.cut * (24.0 * self.d * self.d + 4.0 * ws.seq_len * self.d)
    self.empty_cache = np.zeros((ws.num_docs, ws.cut, 2, ws.seq_len, cfg.n_head, cfg.head_dim),
                                np.float32)

  def result(self) -> registry.AttackResult:
    ws, budget = self.ws, self.budget
    # Every vocabulary token's row at position 0 (step 1, and the tolerance's position 0).
    self.table = ws.map_call(first_rows, (np.arange(ws.cfg.vocab_size, dtype=np.int32),),
                             64.0 * self.d, consts=(ws.params,), cfg=ws.cfg, k=ws.cut)
    self.analytic += ws.cfg.vocab_size * self.per_token
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
        **stats, "kind": self.kind, "true_row_residual": residual, "tolerance": tolerance,
        "refits": refits})

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
          cost = invariant_cost(jnp.asarray(self.table[token:token + 1]), known_h, scale,
                                gram[i], norm2[i])
          worst = max(worst, float(cost[0]))
      candidates = np.repeat(pad(tokens[:, t])[:, None], self.num, 1)
      cost, _, kv = self.score(known, cache, candidates, pad(rows), t)
      worst = max(worst, float(cost[:len(tokens), 0].max()))
      cache[:, :, :, t] = kv
    return max(math.sqrt(worst / (known.count + 1)), 1e-7)

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
    # Step 1: position 0 against the table, least ambiguous documents first.
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
