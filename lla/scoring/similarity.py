"""Similarity metrics that make lla's numbers comparable with the published attacks' papers.

Every metric is computed from token ids, per document, on the positions the attack is
scored on, and then averaged over documents (pooling sums per-document values, so a
pooled mean weighs every document once):

  * `rouge_l_tokens`: ROUGE-L F1 (longest common subsequence) over the token-id sequences.
    SplitLLM (BiSR, TAG, EIA numbers) decodes each id separately, joins them with spaces and
    applies the `rouge` package; on ids this is the same LCS measure without that package's
    word splitting of multi-word tokens.
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
import math

import numpy as np
from rouge_score import rouge_scorer
from rouge_score import tokenizers

from lla.scoring import metrics

NAMES = ("rouge_l_tokens", "rouge_l_text", "token_set_f1")


class _IdTokenizer(tokenizers.Tokenizer):
  """Token ids written as space-separated integers, split back into ids: ROUGE over ids."""

  def tokenize(self, text):
    return text.split()


_ID_SCORER = rouge_scorer.RougeScorer(["rougeL"], tokenizer=_IdTokenizer())
_TEXT_SCORER = rouge_scorer.RougeScorer(["rougeL"])


def _ids_text(ids) -> str:
  return " ".join(str(int(i)) for i in ids)


def rouge_l_tokens(pred: np.ndarray, truth: np.ndarray) -> float:
  """ROUGE-L F1 of two 1-D token-id sequences (the package's LCS)."""
  return _ID_SCORER.score(_ids_text(truth), _ids_text(pred))["rougeL"].fmeasure


def rouge_l_text(pred: np.ndarray, truth: np.ndarray, tokenizer) -> float:
  """ROUGE-L F1 of the decoded texts of two 1-D token-id sequences."""
  return _TEXT_SCORER.score(tokenizer.decode(truth), tokenizer.decode(pred))["rougeL"].fmeasure


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
  values = {"rouge_l_tokens": [rouge_l_tokens(p, t) for p, t in zip(pred, truth)],
            "token_set_f1": [token_set_f1(p, t) for p, t in zip(pred, truth)]}
  if tokenizer is not None:
    values["rouge_l_text"] = [rouge_l_text(p, t, tokenizer) for p, t in zip(pred, truth)]
  # fsum is correctly rounded, so the sums (and the scorecard) do not depend on the
  # order of the documents.
  return Sums(tuple(sorted((k, math.fsum(v)) for k, v in values.items())), truth.shape[0])
