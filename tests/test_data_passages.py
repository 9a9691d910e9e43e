"""Fixed-length passages, seeded disjoint splits, hashes and the pre-training stream."""

import hashlib
import json

import numpy as np
import pytest

import lla.data
from lla.data import corpora
from lla.data import passages

# Valid and test instead of train keep these tests fast (train takes seconds to tokenize).
FAST_SOURCES = dict(calibration_source="valid", training_source="valid", evaluation_source="test")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("token_cache")


@pytest.fixture(scope="module")
def load(data_dir, cache_dir):
  def load_with(**kwargs):
    return lla.data.load_splits(data_dir, cache_dir=cache_dir, **{**FAST_SOURCES, **kwargs})

  return load_with


def _independent_sha256(tokens):
  return hashlib.sha256(
      np.asarray(tokens).astype("<i4").tobytes() + np.asarray(tokens.shape, "<i8").tobytes()
  ).hexdigest()


def _rows(tokens):
  return {row.tobytes() for row in tokens}


def test_shapes_dtypes_and_defaults(load):
  splits = load()
  assert (splits.corpus, splits.seq_len, splits.seed) == ("wikitext2", 32, 0)
  for name, size in (("calibration", 32), ("training", 128), ("evaluation", 256)):
    split = getattr(splits, name)
    assert split.tokens.shape == (size, 32) and split.tokens.dtype == np.int32
    assert split.document_ids.shape == (size,)
    assert not split.tokens.flags.writeable


def test_passages_are_the_windows_of_the_source_stream(load, data_dir, cache_dir):
  splits = load(seq_len=16)
  tokenizer = lla.data.load_tokenizer(data_dir)
  stream = corpora.WikiText2(tokenizer, data_dir=data_dir, cache_dir=cache_dir).tokens("test")
  for row, document_id in zip(splits.evaluation.tokens, splits.evaluation.document_ids):
    np.testing.assert_array_equal(row, stream[document_id * 16 : (document_id + 1) * 16])


def test_splits_sharing_a_source_are_disjoint(load):
  splits = load(evaluation_source="valid", n_eval=1000)
  ids = [set(split.document_ids.tolist()) for _, split in splits.items()]
  assert all(len(i) == n for i, n in zip(ids, (32, 128, 1000)))
  assert not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])


def test_deterministic_for_a_seed_and_different_for_another(load):
  first, again, other = load(seed=7), load(seed=7), load(seed=8)
  for (name, a), (_, b), (_, c) in zip(first.items(), again.items(), other.items()):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert a.sha256 == b.sha256 != c.sha256, name
  assert first.to_json() == again.to_json()


def test_one_split_does_not_move_when_another_changes_size(load):
  np.testing.assert_array_equal(load(n_eval=256).calibration.tokens, load(n_eval=17).calibration.tokens)


def test_hashes_equal_an_independent_computation(load):
  for _, split in load().items():
    assert split.sha256 == _independent_sha256(split.tokens)
  tokens = np.arange(6, dtype=np.int32)
  assert passages.token_sha256(tokens.reshape(2, 3)) != passages.token_sha256(tokens.reshape(3, 2))


def test_to_json_summarises_and_serialises(load):
  summary = load().to_json()
  json.dumps(summary)
  assert summary["splits"]["evaluation"]["source"] == "test"
  assert summary["splits"]["calibration"]["shape"] == [32, 32]
  assert len(summary["splits"]["training"]["document_ids"]) == 128
  assert summary["provenance"]["source_sha256"]["test"] == (
      "d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0"
  )


def test_too_few_windows_is_a_clear_error(load):
  with pytest.raises(ValueError, match="calibration 5000 \\+ training 5000"):
    load(n_calibration=5000, n_train=5000)


def test_generated_corpora_give_splits(data_dir, cache_dir):
  for corpus in ("clinical", "code"):
    splits = lla.data.load_splits(data_dir, corpus=corpus, cache_dir=cache_dir, **FAST_SOURCES)
    assert splits.corpus == corpus and splits.evaluation.tokens.shape == (256, 32)
  with pytest.raises(ValueError, match="Unknown corpus"):
    lla.data.load_splits(data_dir, corpus="wikitext103", cache_dir=cache_dir)


def test_pretraining_stream_excludes_evaluation_passages_from_the_same_split(load, data_dir, cache_dir):
  splits = load(evaluation_source="valid")
  full = lla.data.pretraining_tokens(data_dir, "valid", cache_dir=cache_dir)
  reduced = lla.data.pretraining_tokens(data_dir, "valid", exclude=splits, cache_dir=cache_dir)
  assert len(reduced) == len(full) - 256 * 32
  kept = passages.cut_windows(full, 32)[
      np.setdiff1d(np.arange(len(full) // 32), splits.evaluation.document_ids)
  ].reshape(-1)
  np.testing.assert_array_equal(reduced[: len(kept)], kept)
  # Evaluation drawn from test: nothing to remove from valid.
  np.testing.assert_array_equal(
      lla.data.pretraining_tokens(data_dir, "valid", exclude=load(), cache_dir=cache_dir), full
  )


def test_pretraining_exclusion_refuses_splits_of_another_corpus(data_dir, cache_dir):
  clinical = lla.data.load_splits(data_dir, corpus="clinical", cache_dir=cache_dir, evaluation_source="valid")
  with pytest.raises(ValueError, match="wrong windows"):
    lla.data.pretraining_tokens(data_dir, "valid", exclude=clinical, cache_dir=cache_dir)


def test_config_fields_are_load_splits_arguments(data_dir, cache_dir):
  config = lla.data.get_config()
  config.data_dir, config.cache_dir = str(data_dir), str(cache_dir)
  config.update(FAST_SOURCES)
  config.n_eval = 8
  assert lla.data.load_splits_from_config(config).evaluation.tokens.shape == (8, 32)
