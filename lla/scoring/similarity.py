"""Similarity metrics that make lla's numbers comparable with the published attacks' papers.

Every metric is computed from token ids, per document, on the positions the attack is
scored on, and then averaged over documents (pooling sums per-document values, so a
pooled mean weighs every document once):

  * `rouge_l_tokens`: ROUGE-L F1 (longest common subsequence) over the token-id sequences.
    SplitLLM (BiSR, TAG, EIA numbers) decodes each id separately, joins them with spaces and
    applies the `rouge` package; on ids this is the same LCS measure without that package's
    word splitting of multi-word tokens. Computed for every document at once (the
    `rouge-score` package's own LCS is a Python loop per document: a quarter of a minute
    per scoring of the tiny main job), bit for bit equal to that package's F1 on the ids.
  * `rouge_l_text`: ROUGE-L F1 of the decoded texts with Google's `rouge-score` package and
    its default tokenizer (lower-cased alphanumeric words), as LAMP's HF `rouge` metric.
    It needs the GPT-2 tokenizer; without one it is not computed and the scorecard says so.
  * `token_set_f1`: F1 of the sets of predicted and true token ids (SplitLLM's "TOKACC",
    VFLAIR-LLM's bag-of-ids precision and recall).

Positional token accuracy and exact-document recovery stay in `metrics` (PROTOCOL
section 5): they decide the gates; these only report.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from lla.scoring import metrics

NAMES = ("rouge_l_tokens", "rouge_l_text", "token_set_f1")


@functools.cache
def _text_scorer():
  # Imported on first use: rouge-score imports nltk, 1.2 s of every binary's start-up
  # (the replay CLI's 3.3 s) for a metric only a scoring with a tokenizer computes.
  from rouge_score import rouge_scorer  # pylint: disable=g-import-not-at-top
  return rouge_scorer.RougeScorer(["rougeL"])


def lcs_lengths(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """[B] int lengths of the longest common subsequences of the rows of a [B, n] and b [B, m].

  The textbook table, filled one anti-diagonal at a time for all rows together: cell (i, j)
  reads (i-1, j-1), (i-1, j) and (i, j-1), which all lie on earlier anti-diagonals, so
  n + m - 1 vector steps replace B n m scalar ones.
  """
  a, b = np.asarray(a), np.asarray(b)
  if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[0]:
    raise ValueError(f"lcs_lengths takes [B, n] and [B, m], got {a.shape} and {b.shape}")
  n, m = a.shape[1], b.shape[1]
  table = np.zeros((a.shape[0], n + 1, m + 1), np.int32)
  for diagonal in range(2, n + m + 1):
    i = np.arange(max(1, diagonal - m), min(n, diagonal - 1) + 1)
    j = diagonal - i
    table[:, i, j] = np.where(a[:, i - 1] == b[:, j - 1], table[:, i - 1, j - 1] + 1,
                              np.maximum(table[:, i - 1, j], table[:, i, j - 1]))
  return table[:, n, m]


def rouge_l_tokens(pred: np.ndarray, truth: np.ndarray) -> np.ndarray:
  """[B] float64 ROUGE-L F1 of the rows of pred [B, T_p] and truth [B, T_t] (token ids).

  The operations and their order are `rouge-score`'s (`_score_lcs`, `scoring.fmeasure`):
  precision = LCS / T_p, recall = LCS / T_t, F1 = 2 P R / (P + R), 0 when P + R = 0 or a
  sequence is empty.
  """
  lcs = lcs_lengths(truth, pred).astype(np.float64)
  pred_len, truth_len = np.shape(pred)[1], np.shape(truth)[1]
  if pred_len == 0 or truth_len == 0:
    return np.zeros_like(lcs)
  precision, recall = lcs / pred_len, lcs / truth_len
  total = precision + recall
  with np.errstate(invalid="ignore"):  # 0 / 0 where P + R = 0, replaced by 0
    return np.where(total > 0, 2 * precision * recall / total, 0.0)


def rouge_l_text(pred: np.ndarray, truth: np.ndarray, tokenizer) -> float:
  """ROUGE-L F1 of the decoded texts of two 1-D token-id sequences."""
  return _text_scorer().score(tokenizer.decode(truth), tokenizer.decode(pred))["rougeL"].fmeasure


def token_set_f1(pred: np.ndarray, truth: np.ndarray) -> float:
  """F1 of the sets of token ids (1 when both are empty)."""
  p, t = set(np.asarray(pred).tolist()), set(np.asarray(truth).tolist())
  if not p and not t:
    return 1.0
  common = len(p & t)
  if common == 0:
    return 0.0
  precision, recall = common / len(p), common / len(t)
  return 2 * precision * recall / (precision + recall)


@dataclasses.dataclass(frozen=True)
class Sums:
  """Per-metric sums over documents and the number of documents (additive over seeds)."""

  sums: tuple[tuple[str, float], ...]
  docs: int

  def __add__(self, other: "Sums") -> "Sums":
    if {k for k, _ in self.sums} != {k for k, _ in other.sums}:
      raise ValueError("cannot pool similarity sums of different metric sets")
    theirs = dict(other.sums)
    return Sums(tuple((k, v + theirs[k]) for k, v in self.sums), self.docs + other.docs)

  def means(self) -> dict[str, float | None]:
    have = dict(self.sums)
    return {name: (have[name] / self.docs if name in have else None) for name in NAMES}


def document_sums(pred: np.ndarray, truth: np.ndarray, scored_positions: str = "all",
                  tokenizer=None) -> Sums:
  """Sums over the documents of pred/truth [B, T] of each metric on the scored positions.

  `rouge_l_text` is included only when a tokenizer is given.
  """
  metrics.per_document_hits(pred, truth, scored_positions)  # shape and position checks
  mask = metrics.position_mask(truth.shape[1], scored_positions)
  pred, truth = np.asarray(pred)[:, mask], np.asarray(truth)[:, mask]
  values = {"rouge_l_tokens": rouge_l_tokens(pred, truth).tolist(),
            "token_set_f1": [token_set_f1(p, t) for p, t in zip(pred, truth)]}
  if tokenizer is not None:
    values["rouge_l_text"] = [rouge_l_text(p, t, tokenizer) for p, t in zip(pred, truth)]
  # fsum is correctly rounded, so the sums (and the scorecard) do not depend on the
  # order of the documents.
  return Sums(tuple(sorted((k, math.fsum(v)) for k, v in values.items())), truth.shape[0])
