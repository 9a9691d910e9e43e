"""`mixup_adaptive`: the documents inside secret mixup rows, recovered without the secret.

Threat model: the attacker observes forward messages defended by `lla.defenses.SecretMixup`
and knows the mechanism and its public parameters (m documents per mixed row, mixed within
a capture batch, coefficients on the simplex, one mixture for every position of a row); it
holds the client layers its knowledge grants and public calibration text, never the
partners or the coefficients.

Why it works: a mixed row is y_{b,t} = sum_j lam_{b,j} h_{pi_j(b),t}, a convex combination
of m rows the attacker can compute, with the same coefficients at every position, and the
client is causal. So (adaptive-attacks.md section 4):
  1. Position 0. h_{.,0} depends on one token: the client's position-0 row of every
     vocabulary token (one batched forward) is a dictionary, and each mixed first row is
     an m-sparse convex combination of its entries. After a public BOS (E.C.known_prefix)
     every document's row 0 is the BOS's and says nothing: the first position is then 1,
     whose dictionary is client([BOS, v])_1 (one KV-cached step from the BOS's cache per
     token), and "first token" below means the token at position 1. Greedy simplex
     pursuit (add the entry whose least-squares fit with the chosen ones, coefficients
     summing to one, leaves the least residual; then swaps while they help; from the
     `mixup_starts` entries nearest the row, in order, until a fit is exact) gives the m
     first tokens and lam_b. A true
     entry need not be among the few nearest: a row mixed half and half lies between its
     two entries, and on a tiny random Llama they ranked 9th and 12th.
  2. Unmixing. Within a capture batch every document sits in m slots (row, partner), so
     the slots sharing a first token are one document, or, where several documents share
     that token, are split among them (the split whose unmixed position-1 rows lie closest
     to client rows of that token and a ridge candidate wins; documents that share more
     than their first token have the same unmixed rows there under every split, and the
     splits tied there are decided by the undefended attack on each one's unmixed
     documents, which are client rows at every position only for the right split). With
     the documents known,
     Y_t = Lam H_t at every position with the same Lam [n, n] (the coefficients in the
     documents' columns): H = Lam^-1 Y are the documents' own client rows, which the
     undefended attack (ridge candidates, beam search of width 2) inverts.
     Batches whose slots do not link (a first token the pursuit got wrong) fall back to
     the rows one by one, position by position: each of the row's m partner prefixes
     proposes `mixup_candidates` tokens from the ridge decoding of its share of the row
     (y_t - sum_{i != j} lam_i a_i) / lam_j (the decoder is affine and the weights sum to
     one), every proposal runs through the KV-cached client from that prefix, and
     coordinate descent over partners picks the tokens whose mixture is closest to y_t;
     `mixup_rounds` rounds refresh the shares and proposals.
  3. Attribution. A row holds m texts with exchangeable coefficients: nothing in the
     messages says which is the row's own. The row's prediction is its heaviest partner's
     text, right for about 1/m of the rows, the most any attacker gets without the secret
     partners. The texts themselves are the attack's per-document claims
     (`details["documents"]`, lla.scoring.per_document): each unmixed document with the
     rows it was unmixed from, and in a batch that did not link, each row's prediction
     with its own row; the scorecard scores them per document beside the per-row score.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lla.attacks.adaptive import common as adaptive
from lla.attacks import budget as budget_lib
from lla.attacks import candidates as cand_lib
from lla.attacks import registry
from lla.attacks.adaptive.projection_adaptive import first_rows
from lla.attacks.workspace import Workspace
from lla.model import cost
from lla.model import split

budget_lib.declare("mixup_candidates", 16, int, low=1, high=budget_lib.VOCAB,
                   doc="mixup_adaptive: proposals per partner and position", source="lla")
budget_lib.declare("mixup_rounds", 2, int, low=1,
                   doc="mixup_adaptive: proposal rounds per position", source="lla")
budget_lib.declare("mixup_starts", 32, int, low=1, high=budget_lib.VOCAB,
                   doc="mixup_adaptive: pursuit starts per mixed first row (the nearest "
                   "entries, tried until a fit is exact)", source="lla")


@functools.partial(jax.jit, static_argnames=("cfg",))
def rows_after(params, cache, t, tokens, cfg):
  """[n, d] the client's row at position t of each token in tokens [n], after the prefix
  whose keys/values cache [k, 2, T, H, D] holds."""
  return jax.vmap(lambda token: split.client_step_kv(params, cfg, cache, token, t)[0])(tokens)


@functools.partial(jax.jit, static_argnames=("cfg",))
def partner_rows(params, t, cache, candidates, cfg):
  """Client rows of every partner's candidates at position t from its prefix.

  Args:
    cache: [n, m, k, 2, T, H, D] each row's m partner prefixes.
    candidates: [n, m, C] int32.
  Returns:
    (rows [n, m, C, d], cache entries [n, m, C, k, 2, H, D]).
  """
  step = lambda c, token: split.client_step_kv(params, cfg, c, token, t)
  per_prefix = lambda c, cands: jax.vmap(lambda token: step(c, token))(cands)
  return jax.vmap(jax.vmap(per_prefix))(cache, candidates)


def simplex_fit(gram: np.ndarray, corr: np.ndarray, yy: float) -> tuple[np.ndarray, np.ndarray]:
  """Least squares y ~ sum_j w_j a_j with sum_j w_j = 1, batched, from inner products.

  Args:
    gram: [..., s, s] <a_i, a_j>.
    corr: [..., s] <a_i, y>.
    yy: <y, y>.
  Returns:
    (w [..., s], squared residual [...] = |y - sum_j w_j a_j|^2).
  """
  s = gram.shape[-1]
  system = np.zeros(gram.shape[:-2] + (s + 1, s + 1))
  system[..., :s, :s] = gram
  system[..., :s, s] = 1.0
  system[..., s, :s] = 1.0
  rhs = np.concatenate([corr, np.ones(corr.shape[:-1] + (1,))], -1)
  # A tiny ridge keeps repeated atoms (the same token twice) solvable.
  scale = np.maximum(np.abs(np.diagonal(gram, axis1=-2, axis2=-1)).max(-1), 1e-30)
  ridge = 1e-10 * scale[..., None, None] * np.diag(np.r_[np.ones(s), 0.0])
  w = np.linalg.solve(system + ridge, rhs[..., None])[..., :s, 0]
  residual = yy - 2 * np.sum(w * corr, -1) + np.einsum("...i,...ij,...j->...", w, gram, w)
  return w, np.maximum(residual, 0.0)


def _with_each(table: np.ndarray, norms2: np.ndarray, fixed: list[int], y: np.ndarray,
               table_y: np.ndarray) -> np.ndarray:
  """Squared residual of the simplex fit of y on `fixed` plus each table entry: [V].

  The fit's system K z = r (`simplex_fit`: K = [[G, 1], [1^T, 0]], r = [<a_i, y>, 1]) has
  residual |y|^2 - r^T K^-1 r. Bordering K by one entry v (b_v = [<a_i, a_v>, 1]) adds
  (<a_v, y> - b_v^T K^-1 r)^2 / (|a_v|^2 - b_v^T K^-1 b_v) to r^T K^-1 r, so every entry
  costs O(s^2) after one solve with the fixed atoms, instead of a batched solve per entry
  (most of the attack's time on a 50,257-token vocabulary).
  """
  yy = float(y @ y)
  if not fixed:
    residual = yy - 2 * table_y + norms2  # the entry alone, weight 1
  else:
    s = len(fixed)
    atoms = table[fixed]
    kkt = np.zeros((s + 1, s + 1))
    kkt[:s, :s] = atoms @ atoms.T
    kkt[:s, s] = kkt[s, :s] = 1.0
    # The same tiny ridge as simplex_fit's keeps repeated atoms solvable.
    scale = max(float(np.max(np.diagonal(kkt)[:s])), 1e-30)
    kkt[:s, :s] += 1e-10 * scale * np.eye(s)
    fixed_rhs = np.r_[table_y[fixed], 1.0]
    border = np.concatenate([table @ atoms.T, np.ones((len(table), 1))], 1)  # [V, s + 1]
    solved = np.linalg.solve(kkt, np.concatenate([fixed_rhs[:, None], border.T], 1))
    z, border_solved = solved[:, 0], solved[:, 1:].T
    schur = np.maximum(norms2 - np.sum(border * border_solved, 1), 1e-10 * scale)
    residual = yy - fixed_rhs @ z - (table_y - border @ z) ** 2 / schur
  residual = np.maximum(residual, 0.0)
  residual[fixed] = np.inf
  return residual


_EXACT = 1e-5  # relative residual of a position-0 fit that is exact up to float rounding
# Splits whose closeness (a sum of relative distances, one per document) is within this
# per document of the best's tie: their rows at that position agree up to float rounding.
_TIED = 1e-4


class Unmixing(NamedTuple):
  """Step 2a's result (`MixupAdaptive._unmix`)."""

  unmixed: np.ndarray  # [B, T, d] float64 the documents' rows, NaN in unlinked batches
  owner: np.ndarray    # [B] the document (index into unmixed) of each row's heaviest partner
  ambiguous: int       # first tokens shared by several documents
  decoded: int         # of those, splits that only the undefended attack could decide
  flops: float         # analytic FLOPs of the split choices
  rows_of: list        # [B] the rows whose mixtures hold each unmixed document ([] unlinked)


def pursuit(table: np.ndarray, norms2: np.ndarray, y: np.ndarray, m: int,
            starts: int) -> tuple[list[int], np.ndarray, int]:
  """The m entries of table [V, d] (float64; norms2 [V] their squared norms) whose convex
  combination is y [d]: greedy simplex pursuit from the entries that fit y best alone (up to
  `starts` of them, until a fit is exact), then sweeps of swaps until none helps; the best
  fit. Returns the entries, their coefficients and the starts tried."""
  table_y = table @ y
  alone = _with_each(table, norms2, [], y, table_y)
  best, best_residual, tried = None, np.inf, 0
  for start in np.argsort(alone, kind="stable")[:starts if m > 1 else 1]:
    tried += 1
    chosen = [int(start)]
    while len(chosen) < m:
      chosen.append(int(np.argmin(_with_each(table, norms2, chosen, y, table_y))))
    residual = np.inf
    for _ in range(2 * m):
      for i in range(m if m > 1 else 0):
        others = chosen[:i] + chosen[i + 1:]
        fits = _with_each(table, norms2, others, y, table_y)
        chosen[i] = int(np.argmin(fits))
      atoms = table[chosen]
      _, now = simplex_fit(atoms @ atoms.T, atoms @ y, float(y @ y))
      if now >= residual:
        break
      residual = float(now)
    if residual < best_residual:
      best, best_residual = list(chosen), residual
    if best_residual <= _EXACT**2 * float(y @ y):
      break  # exact up to float rounding: no other start can do better
  atoms = table[best]
  w, _ = simplex_fit(atoms @ atoms.T, atoms @ y, float(y @ y))
  return best, w, tried


def first_token_of(group, chosen) -> int:
  """The first token of a document (a group of slots) in a `chosen` split."""
  return next(v for v, groups in chosen.items() if any(g is group for g in groups))


def batches_of(batch_docs: np.ndarray) -> list[np.ndarray]:
  """Capture batches as index arrays: documents in capture order, batch_docs[b] in b's."""
  out, start = [], 0
  while start < len(batch_docs):
    out.append(np.arange(start, start + int(batch_docs[start])))
    start += int(batch_docs[start])
  return out


def groupings(slots: list[tuple[int, int]], m: int, limit: int = 64):
  """The ways to split slots (row, partner) sharing one first token into documents: groups
  of m slots of distinct rows. At most `limit` (None: more, or none at all)."""
  if len(slots) % m:
    return None
  out = []

  def split(rest, groups):
    if len(out) > limit:
      return
    if not rest:
      out.append(list(groups))
      return
    first, others = rest[0], rest[1:]
    rows = {first[0]}
    for combo in _combinations(others, m - 1):
      if len({r for r, _ in combo} | rows) == m:
        left = [s for s in others if s not in combo]
        split(left, groups + [[first, *combo]])

  split(list(slots), [])
  return out if 0 < len(out) <= limit else None


def claims(texts: np.ndarray, rows_of: list) -> dict:
  """The attack's per-document claims as its record's details (lla.scoring.per_document):
  texts [n, T] and, per text, the rows whose mixtures hold it."""
  return {"documents": {"texts": np.asarray(texts, np.int64).tolist(),
                        "rows": [list(map(int, r)) for r in rows_of]}}


def _combinations(items, r):
  import itertools  # pylint: disable=g-import-not-at-top
  return itertools.combinations(items, r)


class MixupAdaptive:
  """The registered attack (see the module docstring)."""

  spec = registry.AttackSpec(
      "mixup_adaptive", "beam_inversion", ("activations",),
      budget_fields=("ridge_alpha", "mixup_candidates", "mixup_rounds", "mixup_starts"),
      adapts_to=("mixup",), reference_attack="activation",
      # 2: splits of a shared first token that tie at the next position (documents sharing
      # more than one token) are decided by decoding; revision 1 let float rounding pick.
      # 3: its record carries the per-document claims (details["documents"]).
      revision=3,
      description="position-0 simplex pursuit over the vocabulary's rows, documents linked "
      "across rows by their first tokens, the mixing inverted, then the undefended attack",
      reference="../shared/notes/adaptive-attacks.md section 4; Carlini et al. S&P'21 "
      "(arXiv 2011.05315); Huang et al. InstaHide / TextHide",
      threat_model="knows that each row mixes m documents of its capture batch with "
      "coefficients on the simplex, the same at every position, and m; holds the client "
      "layers its knowledge grants and public calibration text; never the partners or "
      "the coefficients",
      capabilities=("m mixed documents per row (any m, greedy pursuit)",
                    "attribution by the heaviest coefficient (1/m of the rows)",
                    "per-document claims: every unmixed document with its rows"),
      checks=(("synthetic", "tests/test_attacks_adaptive.py::test_mixup_rows_are_convex_combinations",
               "each mixed row equals sum_j lam_j h_partner_j (numpy, float64)"),
              ("adaptation", "tests/test_attacks_adaptive.py::test_mixup_adaptive_recovers_the_texts",
               "the mixed texts recovered on a mixup-defended tiny model")))

  def __call__(self, ws: Workspace, budget, key: jax.Array) -> registry.AttackResult:
    del key  # deterministic
    m = int(adaptive.public_params(ws).get("m", 1))
    if m < 1:
      raise ValueError(f"mixup m={m} must be >= 1")
    cfg, d, vocab, seq_len = ws.cfg, ws.cfg.n_embd, ws.cfg.vocab_size, ws.seq_len
    per_token = ws.cut * cost.token_block_flops(cfg, seq_len)  # a client forward
    first = len(ws.known_prefix)  # the first position whose token is not public
    analytic = (vocab + first) * per_token  # the dictionary, after the prefix's own step
    table = self._dictionary(ws).astype(np.float64)
    norms2 = np.sum(table**2, -1)
    y = ws.activations.astype(np.float64)
    # Step 1: the m first tokens and the coefficients of every row.
    texts = np.zeros((ws.num_docs, m, seq_len), np.int32)
    texts[:, :, :first] = np.asarray(ws.known_prefix, np.int32)
    lam = np.zeros((ws.num_docs, m))
    residual0, starts_tried = [], 0
    for b in range(ws.num_docs):
      chosen, w, tried = pursuit(table, norms2, y[b, first], m, int(budget.mixup_starts))
      texts[b, :, first], lam[b] = chosen, w
      starts_tried += tried
      residual0.append(float(np.linalg.norm(y[b, first] - w @ table[chosen])
                             / np.linalg.norm(y[b, first])))
    # Each start: m - 1 additions and up to 2m sweeps of m swaps, a simplex fit per entry.
    ws.count_host(starts_tried * (m + 2 * m * m) * vocab
                  * (2.0 * d * (m + 1) + 10.0 * (m + 1)**3))
    # Step 2a: per batch, unmix all positions at once where the rows' partners link up.
    unmixing = self._unmix(ws, budget, texts[:, :, first], lam, y)
    unmixed, owner = unmixing.unmixed, unmixing.owner
    analytic += unmixing.flops
    linked = ~np.isnan(unmixed[:, 0, 0])
    stats = {"m": m, "first_position": first,
             "first_row_residual_median": float(np.median(residual0)),
             "pursuit_starts_mean": starts_tried / ws.num_docs,
             "rows_unmixed": int(linked.sum()),
             "ambiguous_first_tokens": unmixing.ambiguous,
             "splits_decided_by_decoding": unmixing.decoded,
             "coefficients_mean_max": float(lam.max(1).mean())}
    if linked.all():
      texts_of_docs, flops = adaptive.undefended_attack(
          ws, unmixed, int(budget.mixup_candidates), 2)
      return registry.AttackResult(texts_of_docs[owner].astype(np.int32), analytic + flops, {
          **stats, **claims(texts_of_docs, unmixing.rows_of)})
    # Step 2b: rows of batches that do not link, position by position.
    num = min(int(budget.mixup_candidates), vocab)
    cache = self._prefix_cache(ws, texts[:, :, :first + 1])
    analytic += ws.num_docs * m * per_token * (first + 1)
    decoder = ws.decoder
    safe = np.maximum(lam, 1e-3)[..., None]
    residuals = []
    for t in range(first + 1, seq_len):
      target = y[:, t]
      current = None
      for _ in range(int(budget.mixup_rounds)):
        if current is None:
          # The ridge decoder is affine and the weights sum to one: the decoded row is the
          # mixture of the partners' decodings, whose nearest tokens propose for all.
          shares = np.repeat(target[:, None], m, 1)
        else:
          mixed = np.einsum("bj,bjd->bd", lam, current)
          shares = (target[:, None] - mixed[:, None] + lam[..., None] * current) / safe
        proposals = np.asarray(ws.call(
            cand_lib.decoded_nearest_tokens, decoder.weights, decoder.mu_h, decoder.mu_e,
            ws.wte, jnp.asarray(shares.astype(np.float32)), num=num))
        analytic += cand_lib.candidate_flops(ws.num_docs * m, vocab, d)
        rows, kv = ws.map_call(partner_rows, (cache, proposals), self._bytes(ws, m, num),
                               consts=(ws.params, jnp.int32(t)), cfg=cfg)
        analytic += ws.num_docs * m * num * per_token
        rows = rows.astype(np.float64)
        choice = self._descend(rows, lam, target)
        picked = np.take_along_axis(rows, choice[..., None, None], 2)[:, :, 0]
        if current is None:
          better = np.ones(ws.num_docs, bool)
        else:
          error = lambda a: np.linalg.norm(np.einsum("bj,bjd->bd", lam, a) - target, axis=-1)
          better = error(picked) < error(current)
        for b in np.flatnonzero(better):
          texts[b, :, t] = proposals[b, np.arange(m), choice[b]]
          cache[b, :, :, :, t] = kv[b, np.arange(m), choice[b]]
        current = picked if current is None else np.where(better[:, None, None], picked,
                                                          current)
      residuals.append(float(np.median(
          np.linalg.norm(np.einsum("bj,bjd->bd", lam, current) - target, axis=-1)
          / np.linalg.norm(target, axis=-1))))
    # Step 3: each row's heaviest partner.
    own = np.argmax(lam, axis=1)
    predictions = texts[np.arange(ws.num_docs), own]
    # The claims: every unmixed document; in a batch that did not link, each row's own
    # prediction, tied to that row alone (its per-document score is its per-row one).
    claimed = predictions.copy()
    if linked.any():
      filled = np.where(linked[:, None, None], unmixed, 0.0).astype(np.float32)
      texts_of_docs, flops = adaptive.undefended_attack(
          ws, filled, int(budget.mixup_candidates), 2)
      analytic += flops
      predictions = np.where(linked[owner][:, None], texts_of_docs[owner], predictions)
      claimed = np.where(linked[:, None], texts_of_docs, claimed)
    rows_of = [r if linked[b] else [b] for b, r in enumerate(unmixing.rows_of)]
    return registry.AttackResult(predictions.astype(np.int32), analytic, {
        **stats, "mixture_residual_median_by_position": residuals,
        **claims(claimed, rows_of)})

  def _dictionary(self, ws: Workspace) -> np.ndarray:
    """[V, d] every token's client row at the first position after the known prefix."""
    vocab, d = ws.cfg.vocab_size, ws.cfg.n_embd
    tokens = np.arange(vocab, dtype=np.int32)
    if not ws.known_prefix:
      return ws.map_call(first_rows, (tokens,), 64.0 * d, consts=(ws.params,), cfg=ws.cfg,
                         k=ws.cut)
    prefix = np.broadcast_to(np.asarray(ws.known_prefix, np.int32), (1, 1, len(ws.known_prefix)))
    cache = self._prefix_cache(ws, prefix)[0, 0]
    return ws.map_call(rows_after, (tokens,), 64.0 * d,
                       consts=(ws.params, cache, jnp.int32(len(ws.known_prefix))), cfg=ws.cfg)

  def _prefix_cache(self, ws: Workspace, tokens: np.ndarray) -> np.ndarray:
    """[n, m, k, 2, T, H, D] the keys/values of tokens [n, m, L] at positions < L."""
    cfg = ws.cfg
    n, m, length = tokens.shape
    cache = np.zeros((n, m, ws.cut, 2, ws.seq_len, cfg.n_kv_head, cfg.head_dim), np.float32)
    for t in range(length):
      _, kv = ws.map_call(partner_rows, (cache, np.ascontiguousarray(tokens[:, :, t:t + 1])),
                          self._bytes(ws, m, 1), consts=(ws.params, jnp.int32(t)), cfg=cfg)
      cache[:, :, :, :, t] = kv[:, :, 0]
    return cache

  def _unmix(self, ws: Workspace, budget, first: np.ndarray, lam: np.ndarray, y: np.ndarray):
    """Step 2a. A document is the m slots (row, partner) holding it; within a capture batch
    the slots sharing a first token (first [B, m], the tokens at the first position after
    the known prefix) are split into documents (where several documents share it,
    `_split` chooses). Then Y_t = Lam H_t for every t: H = Lam^-1 Y.

    Returns an `Unmixing`."""
    m = first.shape[1]
    unmixed = np.full(y.shape, np.nan)
    owner = np.arange(ws.num_docs)
    rows_of = [[] for _ in range(ws.num_docs)]
    ambiguous = decoded = 0
    flops = 0.0
    for rows in batches_of(ws.batch_docs):
      slots: dict[int, list] = {}
      for b in rows:
        for j in range(m):
          slots.setdefault(int(first[b, j]), []).append((int(b), j))
      options = {v: groupings(s, m) for v, s in slots.items()}
      if any(o is None for o in options.values()):
        continue
      ambiguous += sum(len(o) > 1 for o in options.values())
      chosen = {v: o[0] for v, o in options.items()}
      for v, opts in options.items():
        if len(opts) > 1:
          chosen[v], by_decoding, split_flops = self._split(ws, budget, chosen, v, opts,
                                                             rows, lam, y)
          decoded += by_decoding
          flops += split_flops
      docs = [g for v in sorted(chosen) for g in chosen[v]]
      mixing = self._mixing(docs, rows, lam)
      solved = np.linalg.solve(mixing, y[rows].reshape(len(rows), -1))
      unmixed[rows] = solved.reshape(len(rows), *y.shape[1:])
      ws.count_host(2.0 * len(rows) ** 2 * y[0].size + len(rows) ** 3)
      for i, b in enumerate(rows):
        heaviest = (int(b), int(np.argmax(lam[b])))
        owner[b] = rows[next(n for n, g in enumerate(docs) if heaviest in g)]
        rows_of[b] = sorted({int(row) for row, _ in docs[i]})
    return Unmixing(unmixed, owner, ambiguous, decoded, flops, rows_of)

  def _split(self, ws: Workspace, budget, chosen, token: int, options, rows, lam, y):
    """Step 2a's choice among the splits (`options`) of the slots sharing first token
    `token`: the one whose unmixed rows at the next position are closest to client rows
    (`_closeness`). Documents that share more than their first token have the same rows
    there under every split (any split unmixes rows that agree into the same rows), and
    the closeness ties up to float rounding, which would then pick the split: the tied
    splits are decided by the undefended attack on each one's unmixed documents, whose
    rows are client rows at every position only for the right split (`_decoded_residual`).

    Returns (the split, whether decoding decided it, analytic FLOPs)."""
    near, flops = zip(*(self._closeness(ws, budget, {**chosen, token: option}, rows, lam, y,
                                        token) for option in options))
    near, flops = np.asarray(near), sum(flops)
    tied = np.flatnonzero(near <= near.min() + _TIED * len(options[0]))
    if len(tied) == 1:
      return options[int(tied[0])], False, flops
    residual, decode_flops = zip(*(self._decoded_residual(
        ws, budget, {**chosen, token: options[i]}, rows, lam, y, token) for i in tied))
    return options[int(tied[int(np.argmin(residual))])], True, flops + sum(decode_flops)

  def _decoded_residual(self, ws: Workspace, budget, chosen, rows, lam, y,
                        token: int) -> tuple[float, float]:
    """The undefended attack (ridge candidates, beam width 2) on the unmixed rows of the
    documents whose first token is `token` in the split `chosen`: (the sum over those
    documents of the best beam's squared distance over their squared norm, its analytic
    FLOPs)."""
    docs = [g for v in sorted(chosen) for g in chosen[v]]
    solved = np.linalg.solve(self._mixing(docs, rows, lam), y[rows].reshape(len(rows), -1))
    ws.count_host(2.0 * len(rows) ** 2 * y[0].size + len(rows) ** 3)
    mine = [n for n, g in enumerate(docs) if first_token_of(g, chosen) == token]
    targets = solved.reshape(len(rows), *y.shape[1:])[mine]
    num = min(int(budget.mixup_candidates), ws.cfg.vocab_size)
    _, distances, flops = adaptive.undefended_search(ws, targets.astype(np.float32), num, 2)
    return float(np.sum(distances / np.sum(targets**2, axis=(1, 2)))), flops

  def _mixing(self, docs, rows, lam) -> np.ndarray:
    """Lam [n, n]: row i of the batch takes lam[b, j] of document g for its slot (b, j)."""
    index = {int(b): i for i, b in enumerate(rows)}
    mixing = np.zeros((len(rows), len(docs)))
    for g, slots in enumerate(docs):
      for b, j in slots:
        mixing[index[b], g] += lam[b, j]
    return mixing

  def _closeness(self, ws: Workspace, budget, chosen, rows, lam, y,
                 token: int) -> tuple[float, float]:
    """How far the unmixed rows at position p + 1 (p the first position after the known
    prefix) of the documents whose token p is `token` are from the client's rows of
    (prefix, token, c) for their ridge candidates c: (the sum over those documents of the
    nearest candidate's distance over the row's norm, analytic FLOPs)."""
    first = len(ws.known_prefix)
    docs = [g for v in sorted(chosen) for g in chosen[v]]
    mixing = self._mixing(docs, rows, lam)
    h1 = np.linalg.solve(mixing, y[rows, first + 1])
    mine = [n for n, g in enumerate(docs) if first_token_of(g, chosen) == token]
    targets = h1[mine].astype(np.float32)
    num = min(int(budget.mixup_candidates), ws.cfg.vocab_size)
    decoder = ws.decoder
    proposals = np.asarray(ws.call(cand_lib.decoded_nearest_tokens, decoder.weights,
                                   decoder.mu_h, decoder.mu_e, ws.wte, jnp.asarray(targets),
                                   num=num))
    prefix = np.broadcast_to(np.asarray((*ws.known_prefix, token), np.int32),
                             (len(mine), 1, first + 1))
    cache = self._prefix_cache(ws, prefix)
    candidate_rows, _ = ws.call(partner_rows, ws.params, jnp.int32(first + 1), cache,
                                proposals[:, None], cfg=ws.cfg)
    err = np.linalg.norm(np.asarray(candidate_rows)[:, 0] - targets[:, None], axis=-1)
    per_token = ws.cut * cost.token_block_flops(ws.cfg, ws.seq_len)
    flops = (cand_lib.candidate_flops(len(mine), ws.cfg.vocab_size, ws.cfg.n_embd)
             + len(mine) * (first + 1 + num) * per_token)
    return float(np.sum(err.min(-1) / np.linalg.norm(targets, axis=-1))), flops

  def _bytes(self, ws: Workspace, m: int, num: int) -> float:
    d, kv, k, t = ws.cfg.n_embd, cost.kv_width(ws.cfg), ws.cut, ws.seq_len
    return 4.0 * m * (2 * k * t * kv + num * (2 * k * kv + d))

  def _descend(self, rows: np.ndarray, lam: np.ndarray, target: np.ndarray) -> np.ndarray:
    """[B, m] candidate indices minimising |sum_j lam_j rows[b, j, c_j] - y_t| by
    coordinate descent over partners (exhaustive for m = 1)."""
    n, m, num, _ = rows.shape
    choice = np.zeros((n, m), np.int64)
    for _ in range(3):
      for j in range(m):
        picked = np.take_along_axis(rows, choice[..., None, None], 2)[:, :, 0]
        rest = np.einsum("bi,bid->bd", lam, picked) - lam[:, j, None] * picked[:, j]
        cost = np.sum((rest[:, None] + lam[:, j, None, None] * rows[:, j] - target[:, None])**2,
                      -1)
        choice[:, j] = np.argmin(cost, -1)
    return choice


registry.register(MixupAdaptive())
