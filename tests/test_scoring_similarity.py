"""The papers' similarity metrics against hand-made cases and an independent LCS."""

import subprocess
import sys

import numpy as np
import pytest
from rouge_score import rouge_scorer
from rouge_score import tokenizers as rouge_tokenizers

from lla.data.tokenizer import load_tokenizer
from lla.scoring import similarity


def lcs_length(a, b) -> int:
  """Textbook dynamic programme, independent of rouge-score."""
  table = np.zeros((len(a) + 1, len(b) + 1), int)
  for i in range(1, len(a) + 1):
    for j in range(1, len(b) + 1):
      table[i, j] = (table[i - 1, j - 1] + 1 if a[i - 1] == b[j - 1]
                     else max(table[i - 1, j], table[i, j - 1]))
  return int(table[-1, -1])


def _f1(pred, truth) -> float:
  (value,) = similarity.rouge_l_tokens(np.array([pred]), np.array([truth]))
  return float(value)


def test_token_rouge_l_hand_made_cases():
  # LCS of [1, 2, 3, 4] and [1, 3, 4, 5] is [1, 3, 4]: P = R = 3/4.
  assert _f1([1, 2, 3, 4], [1, 3, 4, 5]) == 0.75
  # Precision 2/2 (prediction), recall 2/4 (truth): F1 = 2/3.
  assert _f1([7, 9], [7, 8, 9, 10]) == pytest.approx(2 / 3)
  assert _f1([5, 5], [6, 6]) == 0.0
  # Ids are compared as ids: 12 is not 1 followed by 2.
  assert _f1([12], [1, 2]) == 0.0
  assert similarity.rouge_l_tokens(np.zeros((3, 0), int), np.ones((3, 4), int)).tolist() == [0.0] * 3


def test_lcs_lengths_equal_the_textbook_table_row_by_row():
  rng = np.random.default_rng(1)
  for n, m in [(1, 1), (1, 7), (7, 1), (5, 9), (12, 12), (32, 32)]:
    a, b = rng.integers(0, 4, (20, n)), rng.integers(0, 4, (20, m))
    assert similarity.lcs_lengths(a, b).tolist() == [lcs_length(x, y) for x, y in zip(a, b)]
  with pytest.raises(ValueError, match=r"\[B, n\] and \[B, m\]"):
    similarity.lcs_lengths(np.zeros((2, 3)), np.zeros((3, 3)))


def test_token_rouge_l_equals_independent_lcs():
  rng = np.random.default_rng(0)
  for _ in range(50):
    n, m = rng.integers(1, 12, 2)
    a, b = rng.integers(0, 6, (4, n)), rng.integers(0, 6, (4, m))
    got = similarity.rouge_l_tokens(a, b)
    for row, (x, y) in enumerate(zip(a, b)):
      lcs = lcs_length(list(y), list(x))
      want = 0.0 if lcs == 0 else 2 * (lcs / n) * (lcs / m) / (lcs / n + lcs / m)
      assert got[row] == pytest.approx(want, abs=1e-12)


class _Ids(rouge_tokenizers.Tokenizer):
  def tokenize(self, text):
    return text.split()


def test_token_rouge_l_is_the_rouge_score_packages_bit_for_bit():
  """Each document's F1 is the float `rouge-score` itself computes on the ids written as
  words (what SplitLLM's numbers use), not just close to it."""
  scorer = rouge_scorer.RougeScorer(["rougeL"], tokenizer=_Ids())
  rng = np.random.default_rng(2)
  for n, m in [(32, 32), (31, 31), (3, 17), (17, 3)]:
    truth, pred = rng.integers(0, 5, (64, n)), rng.integers(0, 5, (64, m))
    pred[:8, :min(n, m)] = truth[:8, :min(n, m)]  # some exact or near-exact documents
    got = similarity.rouge_l_tokens(pred, truth)
    want = [scorer.score(" ".join(map(str, t)), " ".join(map(str, p)))["rougeL"].fmeasure
            for p, t in zip(pred, truth)]
    assert got.tolist() == want


def test_token_set_f1_hand_made_cases():
  # Sets {1, 2, 3} and {2, 3, 4}: P = R = 2/3.
  assert similarity.token_set_f1(np.array([1, 2, 3, 3]), np.array([2, 3, 4])) == pytest.approx(2 / 3)
  assert similarity.token_set_f1(np.array([1]), np.array([2])) == 0.0
  assert similarity.token_set_f1(np.array([4, 4]), np.array([4])) == 1.0


def test_text_rouge_l_on_decoded_gpt2_tokens(data_dir):
  tokenizer = load_tokenizer(data_dir)
  truth = tokenizer.encode("the cat sat on the mat")
  pred = tokenizer.encode("The cat, sat")
  # rouge-score lower-cases and keeps alphanumeric words: LCS "the cat sat" = 3 words,
  # P = 3/3, R = 3/6.
  assert similarity.rouge_l_text(pred, truth, tokenizer) == pytest.approx(2 * 0.5 / 1.5)


def test_document_sums_pool_and_respect_scored_positions(data_dir):
  tokenizer = load_tokenizer(data_dir)
  truth = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.int32)
  pred = np.array([[9, 2, 3, 4], [5, 6, 7, 8]], np.int32)
  everything = similarity.document_sums(pred, truth, "all", tokenizer)
  means = everything.means()
  assert means["rouge_l_tokens"] == pytest.approx((0.75 + 1.0) / 2)
  assert means["token_set_f1"] == pytest.approx((0.75 + 1.0) / 2)
  assert means["rouge_l_text"] is not None
  later = similarity.document_sums(pred, truth, "t>=1")
  assert later.means()["rouge_l_tokens"] == 1.0 and later.means()["rouge_l_text"] is None
  pooled = (everything + similarity.document_sums(truth, truth, "all", tokenizer)).means()
  assert pooled["rouge_l_tokens"] == pytest.approx((0.75 + 1.0 + 1.0 + 1.0) / 4)
  with pytest.raises(ValueError, match="different metric sets"):
    everything + later  # pylint: disable=pointless-statement


def test_rouge_score_and_nltk_load_only_for_text_rouge():
  """Every binary that scores imports the scorecard; rouge-score (and the nltk it imports,
  1.2 s) loads only when text ROUGE-L is computed. In a fresh interpreter."""
  script = ("import sys\n"
            "from lla.replay import driver\n"
            "from lla.scoring import scorecard, similarity\n"
            "print(sorted(m for m in ('rouge_score', 'nltk') if m in sys.modules))\n"
            "similarity._text_scorer()\n"
            "print(sorted(m for m in ('rouge_score', 'nltk') if m in sys.modules))\n")
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       check=True).stdout.split("\n")
  assert out[:2] == ["[]", "['nltk', 'rouge_score']"]
