"""Rows that mix documents, scored per document: what the attacker recovers of each one.

Under a defense whose rows mix documents (mixup: row b = sum_j lam_{b,j} h_{pi_j(b)} with
pi_0 the identity, so row b holds its own document b and m - 1 secret partners), a row's
prediction is one text, and PROTOCOL section 5's per-row score credits it only when it is
the row's own document. An attacker who unmixes every document exactly still cannot say
which of a row's m texts is its own (the coefficients are exchangeable and the partners
secret), so the per-row score caps it near 1/m of the rows, while it has learned every
text. The per-document score measures the texts:

  1. The attack commits to its claims before scoring: its record's `details["documents"]`
     = {"texts": [C][T] token ids, "rows": [C][rows]}, one reconstruction per document it
     claims (C <= B), each naming the rows whose mixture it was unmixed from.
  2. Original document i (truth row i) can be credited only by a claim that names row i,
     and each claim credits at most one document, each document at most one claim.
  3. Among those pairings, the one with the most correct scored tokens (scipy's
     linear_sum_assignment); a document left unpaired scores 0.

What the truth chooses, exactly: which of the claims the attack ties to row i is document i,
one claim per document. It cannot add claims (C <= B) nor credit a text to a document
whose row the claim does not name; with one claim per row, each naming its own row alone,
the per-document score is the per-row score. It does credit the attribution that the
attacker cannot make without the secret partners (for m = 2, the choice per cycle of rows
between its two pairings), so it is the leak of the documents' content, not of which row
holds which; the scorecard reports it beside the per-row score, with the verdicts under
each (docs/attacks.md).
"""

import numpy as np
import scipy.optimize

from lla.scoring import metrics

FIELD = "documents"


def claims(details: dict | None, truth_shape: tuple[int, int], where: str):
  """(texts [C, T] int, rows [C] lists of row indices) of a record's claims, or None.

  Raises:
    ValueError (one line, naming `where`): claims that are not C <= B texts of length T,
      or rows outside [0, B), or a claim naming no row.
  """
  entry = (details or {}).get(FIELD)
  if entry is None:
    return None
  b, t = truth_shape
  texts = np.asarray(entry.get("texts", []), np.int64)
  rows = entry.get("rows", [])
  if texts.ndim != 2 or texts.shape[1] != t or not 0 < len(texts) <= b or (
      len(rows) != len(texts)):
    raise ValueError(f"{where}: details.{FIELD} must hold 1 to {b} texts of {t} tokens, "
                     f"each with its rows, got texts {list(texts.shape)} and {len(rows)} rows")
  if any(not r or min(r) < 0 or max(r) >= b for r in rows):
    raise ValueError(f"{where}: details.{FIELD}: every claim names rows in [0, {b})")
  return texts, [sorted({int(x) for x in r}) for r in rows]


def pairing(texts: np.ndarray, rows: list[list[int]], truth: np.ndarray,
            scored_positions: str) -> np.ndarray:
  """[B] the claim paired with each original document (-1: none), by the module's rule."""
  mask = metrics.position_mask(truth.shape[1], scored_positions)
  hits = (texts[None, :, mask] == truth[:, None, mask]).sum(-1)  # [B, C]
  eligible = np.zeros(hits.shape, bool)
  for c, named in enumerate(rows):
    eligible[named, c] = True
  # An ineligible pair weighs nothing, like no pair: every pairing of eligible pairs
  # extends to a full assignment of the C <= B claims at the same weight, and the
  # ineligible pairs are dropped below.
  weight = np.where(eligible, hits, 0)
  docs, chosen = scipy.optimize.linear_sum_assignment(weight, maximize=True)
  out = np.full(truth.shape[0], -1)
  keep = eligible[docs, chosen]
  out[docs[keep]] = chosen[keep]
  return out


def documents(texts: np.ndarray, rows: list[list[int]], truth: np.ndarray,
              scored_positions: str, fill: np.ndarray) -> np.ndarray:
  """[B, T] each original's paired claim (`fill`'s row where none is paired; scoring
  passes a row that matches nothing)."""
  paired = pairing(texts, rows, truth, scored_positions)
  return np.where((paired >= 0)[:, None], texts[np.maximum(paired, 0)], fill)


def count(details: dict, truth: np.ndarray, baseline_token: int, scored_positions: str,
          where: str) -> metrics.Counts | None:
  """The per-document counts of a record's claims (None: it makes none), as `metrics.count`
  of each original document against its paired claim."""
  found = claims(details, truth.shape, where)
  if found is None:
    return None
  # An unpaired document scores 0: its stand-in differs from it everywhere.
  miss = (truth + 1) % (int(truth.max()) + 2)
  return metrics.count(documents(*found, truth, scored_positions, miss), truth,
                       baseline_token, scored_positions)
