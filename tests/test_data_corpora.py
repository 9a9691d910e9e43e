"""Corpora: WikiText-2 files, clinical templates, stdlib code; the token cache."""

import hashlib
import sys
import re

import numpy as np
import pytest

from lla.data import corpora
from lla.data import paths
from lla.data import tokenizer as tokenizer_lib

# valid.txt in GPT-2 tokens (shared/data/README.md).
WIKITEXT_VALID_TOKENS = 258_659


@pytest.fixture(scope="module")
def tokenizer(data_dir):
  return tokenizer_lib.load_tokenizer(data_dir)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("token_cache")


def test_wikitext_valid_stream_matches_whole_text_encoding(data_dir, tokenizer, cache_dir):
  corpus = corpora.WikiText2(tokenizer, data_dir=data_dir, cache_dir=cache_dir)
  stream = corpus.tokens("valid")
  assert stream.dtype == np.int32 and stream.ndim == 1
  assert len(stream) == WIKITEXT_VALID_TOKENS
  # Line-by-line encoding is only a speed-up: same ids as encoding the file at once.
  text = (data_dir / "wikitext-2" / "valid.txt").read_text(encoding="utf-8")
  np.testing.assert_array_equal(stream, tokenizer.encode(text))
  assert corpus.source_sha256("valid") == "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8"
  assert corpus.metadata()["files"]["valid"] == "wikitext-2/valid.txt"


def test_cache_is_reused_without_tokenizing(data_dir, tokenizer, cache_dir, monkeypatch):
  first = corpora.WikiText2(tokenizer, data_dir=data_dir, cache_dir=cache_dir).tokens("test")
  assert corpora.WikiText2(tokenizer, data_dir=data_dir, cache_dir=cache_dir).cache_path("test").is_file()

  def must_not_tokenize(*args, **kwargs):
    raise AssertionError("tokenized again despite the cache")

  monkeypatch.setattr(tokenizer_lib.Tokenizer, "encode_batch", must_not_tokenize)
  fresh_tokenizer = tokenizer_lib.load_tokenizer(data_dir)
  again = corpora.WikiText2(fresh_tokenizer, data_dir=data_dir, cache_dir=cache_dir).tokens("test")
  np.testing.assert_array_equal(first, again)
  assert not again.flags.writeable


def _write_wikitext(root, names_and_text):
  for name, text in names_and_text.items():
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def test_wikitext_original_file_names_and_cache_key_follows_content(tokenizer, tmp_path):
  data = tmp_path / "data"
  _write_wikitext(data, {"wikitext-2-raw/wiki.valid.raw": " = A = \n\n Some text .\n"})
  corpus = corpora.WikiText2(tokenizer, data_dir=data, cache_dir=tmp_path / "cache")
  assert tokenizer.decode(corpus.tokens("valid")) == " = A = \n\n Some text .\n"
  _write_wikitext(data, {"wikitext-2/wiki.valid.tokens": " = B = \n"})  # Preferred name now exists.
  assert tokenizer.decode(corpus.tokens("valid")) == " = B = \n"
  assert len(list((tmp_path / "cache").glob("wikitext2-valid-*.npy"))) == 2


def test_wikitext_missing_split_lists_every_name(tokenizer, tmp_path):
  corpus = corpora.WikiText2(tokenizer, data_dir=tmp_path, cache_dir=tmp_path / "cache")
  with pytest.raises(paths.DataNotFoundError) as error:
    corpus.tokens("train")
  for name in ("wikitext-2/train.txt", "wikitext-2/wiki.train.tokens", "wikitext-2/wiki.train.raw"):
    assert str(tmp_path / name) in str(error.value)


def test_unknown_split_is_rejected(tokenizer, tmp_path):
  with pytest.raises(ValueError, match="validation"):
    corpora.ClinicalTemplates(tokenizer, cache_dir=tmp_path).tokens("validation")


def test_clinical_notes_are_deterministic_in_the_seed(tokenizer, tmp_path):
  small = {"train": 50, "valid": 20, "test": 20}
  notes = corpora.ClinicalTemplates(tokenizer, cache_dir=tmp_path, seed=3, n_notes=small).documents("test")
  again = corpora.ClinicalTemplates(tokenizer, cache_dir=tmp_path, seed=3, n_notes=small).documents("test")
  other_seed = corpora.ClinicalTemplates(tokenizer, cache_dir=tmp_path, seed=4, n_notes=small).documents("test")
  other_split = corpora.ClinicalTemplates(tokenizer, cache_dir=tmp_path, seed=3, n_notes=small).documents("valid")
  assert len(notes) == 20 and notes == again
  assert notes != other_seed and notes != other_split
  medications = [medication[0] for medication in corpora._MEDICATIONS]
  for note in notes:
    assert re.search(r"\b\d{2,3}/\d{2,3}\b", note), note  # Blood pressure.
    assert re.search(r"\b\d{2}\.\d C\b", note), note  # Temperature.
    assert re.search(r"\b\d{2,3}% on ", note), note  # SpO2.
    assert re.search(r"\b\d{2} ?(-year-old|y/o|yo)\b", note), note  # Age.
    assert any(medication in note for medication in medications), note


def test_clinical_stream_separates_notes_with_endoftext(tokenizer, tmp_path):
  corpus = corpora.ClinicalTemplates(tokenizer, cache_dir=tmp_path, n_notes={"test": 5})
  stream = corpus.tokens("test")
  assert np.sum(stream == tokenizer.eot_id) == 4
  assert tokenizer.decode(stream) == "<|endoftext|>".join(corpus.documents("test"))


def test_code_corpus_decodes_to_python_source(tokenizer, tmp_path):
  corpus = corpora.PythonStdlibCode(tokenizer, cache_dir=tmp_path)
  files = corpus.files("test")
  assert files and files == sorted(files)
  assert {corpus.split_of(path.relative_to(corpus.stdlib_dir).as_posix()) for path in files} == {"test"}
  assert not any("site-packages" in path.parts for path in files)
  stream = corpus.tokens("test")
  first_file = files[0].read_text(encoding="utf-8")
  first_document = stream[: int(np.argmax(stream == tokenizer.eot_id))]
  assert tokenizer.decode(first_document) == first_file
  compile(first_file, str(files[0]), "exec")
  metadata = corpus.metadata()
  assert metadata["python_version"].count(".") == 2
  assert sum(metadata["n_files"].values()) > 100


def test_code_corpus_splits_partition_the_files(tokenizer, tmp_path):
  corpus = corpora.PythonStdlibCode(tokenizer, cache_dir=tmp_path)
  by_split = [set(corpus.files(split)) for split in corpora.SPLITS]
  assert sum(map(len, by_split)) == len(set.union(*by_split))


def test_documents_hash_is_length_prefixed():
  assert corpora._sha256_documents(["ab", "c"]) != corpora._sha256_documents(["a", "bc"])
  assert corpora._sha256_documents(["x"]) != hashlib.sha256(b"x").hexdigest()


def test_hub_wikitext_without_datasets_is_a_clear_error(tokenizer, tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "datasets", None)  # Makes `import datasets` fail.
  with pytest.raises(paths.DataNotFoundError, match="`datasets` package is not installed"):
    corpora.WikiText2Hub(tokenizer, cache_dir=tmp_path).tokens("valid")
