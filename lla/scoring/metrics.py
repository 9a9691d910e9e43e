"""Recovery metrics, the frequency baseline and the Wilson-bound scoring rule.

Formulas are PROTOCOL.md section 5 (policy `scorecard-policy.v3`). Counts are
kept as integers (hits, n) so that pooling across seeds sums counts, never
rates.
"""

import dataclasses

import numpy as np

DEFAULT_Z = 2.5392


def position_mask(seq_len: int, scored_positions: str) -> np.ndarray:
  """[T] bool mask of the positions an attack is scored on: "all"; "t>=1" (an attack
  blind at position 0); "after_bos" (every position after a public BOS at position 0)."""
  if scored_positions == "all":
    return np.ones(seq_len, bool)
  if scored_positions in ("t>=1", "after_bos"):
    return np.arange(seq_len) >= 1
  raise ValueError(f"scored_positions {scored_positions!r}: expected 'all', 't>=1' or "
                   "'after_bos'")


def _check(pred: np.ndarray, truth: np.ndarray) -> None:
  if truth.ndim != 2:
    raise ValueError(f"truth has shape {truth.shape}, expected [B, T]")
  if pred.shape != truth.shape:
    raise ValueError(f"predictions have shape {pred.shape}, truth "
                     f"{truth.shape}")


def per_document_hits(pred: np.ndarray, truth: np.ndarray,
                      scored_positions: str = "all") -> np.ndarray:
  """[B] int: correctly predicted scored positions per document."""
  _check(pred, truth)
  mask = position_mask(truth.shape[1], scored_positions)
  return (pred == truth)[:, mask].sum(axis=1).astype(np.int64)


def token_recovery(pred: np.ndarray, truth: np.ndarray,
                   scored_positions: str = "all") -> tuple[int, int]:
  """(hits, n) over the B x |scored positions| evaluated tokens."""
  hits = per_document_hits(pred, truth, scored_positions)
  n = truth.shape[0] * int(position_mask(truth.shape[1],
                                         scored_positions).sum())
  return int(hits.sum()), n


def exact_document_recovery(pred: np.ndarray, truth: np.ndarray,
                            scored_positions: str = "all") -> tuple[int, int]:
  """(documents with every scored position right, number of documents)."""
  hits = per_document_hits(pred, truth, scored_positions)
  per_doc = int(position_mask(truth.shape[1], scored_positions).sum())
  return int((hits == per_doc).sum()), truth.shape[0]


def baseline_hits(truth: np.ndarray, baseline_token: int,
                  scored_positions: str = "all") -> tuple[int, int]:
  """(hits, n) of always guessing `baseline_token` on the scored positions."""
  return token_recovery(np.full_like(truth, baseline_token), truth,
                        scored_positions)


def wilson_upper_rate(p, n, z: float = DEFAULT_Z):
  """One-sided Wilson upper bound for an observed rate `p` over `n` trials.

  U = (p + z^2/(2n) + z sqrt(p(1-p)/n + z^2/(4n^2))) / (1 + z^2/n).
  Broadcasts over arrays; n must be positive.
  """
  p = np.asarray(p, np.float64)
  n = np.asarray(n, np.float64)
  if np.any(n <= 0):
    raise ValueError(f"Wilson bound needs n > 0, got n = {n}")
  if np.any((p < 0) | (p > 1)):
    raise ValueError(f"Wilson bound needs 0 <= p <= 1, got p = {p}")
  z2 = z * z
  u = (p + z2 / (2 * n) + z * np.sqrt(p * (1 - p) / n + z2 / (4 * n * n))) / (
      1 + z2 / n)
  return float(u) if u.ndim == 0 else u


def wilson_upper(successes, n, z: float = DEFAULT_Z):
  """One-sided Wilson upper bound for `successes` out of `n`."""
  s = np.asarray(successes, np.float64)
  if np.any(np.asarray(n) <= 0):
    raise ValueError(f"Wilson bound needs n > 0, got n = {n}")
  if np.any(s < 0) or np.any(s > np.asarray(n)):
    raise ValueError(f"Wilson bound needs 0 <= successes <= n, got "
                     f"{successes} of {n}")
  return wilson_upper_rate(s / np.asarray(n, np.float64), n, z)


def excess_pp(successes: int, n: int, p0: float,
              z: float = DEFAULT_Z) -> float:
  """100 (U(p_a, n_a) - p0_a): the attack's excess over the baseline, in pp."""
  return 100.0 * (wilson_upper(successes, n, z) - p0)


def floor_pp(p0: float, n: int, z: float = DEFAULT_Z) -> float:
  """100 (U(p0, n) - p0): the smallest excess a sample of n allows."""
  return 100.0 * (wilson_upper_rate(p0, n, z) - p0)


@dataclasses.dataclass(frozen=True)
class Counts:
  """Integer counts of one attack on one (pooled) sample.

  Attributes:
    hits: correct scored tokens; n: scored tokens.
    docs_exact: documents with every scored position right; docs: documents.
    baseline_hits: scored tokens equal to the calibration's top token.
  """
  hits: int
  n: int
  docs_exact: int
  docs: int
  baseline_hits: int

  def __add__(self, other: "Counts") -> "Counts":
    return Counts(*(a + b for a, b in zip(dataclasses.astuple(self),
                                          dataclasses.astuple(other))))


def count(pred: np.ndarray, truth: np.ndarray, baseline_token: int,
          scored_positions: str) -> Counts:
  """All counts the scoring rule needs for predictions [B, T] vs truth [B, T]."""
  hits, n = token_recovery(pred, truth, scored_positions)
  docs_exact, docs = exact_document_recovery(pred, truth, scored_positions)
  b_hits, _ = baseline_hits(truth, baseline_token, scored_positions)
  return Counts(hits, n, docs_exact, docs, b_hits)


def summarize(c: Counts, z: float = DEFAULT_Z) -> dict:
  """Rates, Wilson bound, excess and floor (pp) of one set of counts."""
  p0 = c.baseline_hits / c.n
  return {
      "hits": c.hits, "n": c.n, "docs_exact": c.docs_exact, "docs": c.docs,
      "baseline_hits": c.baseline_hits,
      "token_recovery": c.hits / c.n,
      "exact_doc_recovery": c.docs_exact / c.docs,
      "baseline_p0": p0,
      "wilson_upper": wilson_upper(c.hits, c.n, z),
      "excess_pp": excess_pp(c.hits, c.n, p0, z),
      "floor_pp": floor_pp(p0, c.n, z),
  }


def envelope(rows: dict[str, dict]) -> dict:
  """L_run = max_a excess_a and the floor (max over attacks) of summarized rows.

  Args:
    rows: attack name -> `summarize` output, measured attacks only.
  Returns:
    {"envelope_pp", "argmax", "floor_pp", "floor_argmax"}; ties go to the
    lexicographically first attack so that attack order never matters.
  """
  if not rows:
    raise ValueError("envelope of no measured attacks is undefined")
  names = sorted(rows)
  arg = max(names, key=lambda a: (rows[a]["excess_pp"], -names.index(a)))
  farg = max(names, key=lambda a: (rows[a]["floor_pp"], -names.index(a)))
  return {"envelope_pp": rows[arg]["excess_pp"], "argmax": arg,
          "floor_pp": rows[farg]["floor_pp"], "floor_argmax": farg}
