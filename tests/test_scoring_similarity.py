"""The papers' similarity metrics against hand-made cases and an independent LCS."""

import numpy as np
import pytest

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


def test_token_rouge_l_hand_made_cases():
  # LCS of [1, 2, 3, 4] and [1, 3, 4, 5] is [1, 3, 4]: P = R = 3/4.
  assert similarity.rouge_l_tokens(np.array([1, 2, 3, 4]), np.array([1, 3, 4, 5])) == 0.75
  # Precision 2/2 (prediction), recall 2/4 (truth): F1 = 2/3.
  assert similarity.rouge_l_tokens(np.array([7, 9]), np.array([7, 8, 9, 10])) == pytest.approx(2 / 3)
  assert similarity.rouge_l_tokens(np.array([5, 5]), np.array([6, 6])) == 0.0
  # Ids are compared as ids: 12 is not 1 followed by 2.
  assert similarity.rouge_l_tokens(np.array([12]), np.array([1, 2])) == 0.0


def test_token_rouge_l_equals_independent_lcs():
  rng = np.random.default_rng(0)
  for _ in range(50):
    a, b = rng.integers(0, 6, rng.integers(1, 12)), rng.integers(0, 6, rng.integers(1, 12))
    lcs = lcs_length(list(b), list(a))
    want = 0.0 if lcs == 0 else 2 * (lcs / len(a)) * (lcs / len(b)) / (lcs / len(a) + lcs / len(b))
    assert similarity.rouge_l_tokens(a, b) == pytest.approx(want, abs=1e-12)


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
