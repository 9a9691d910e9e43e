"""GPT-2 tokenizer built from vocab.json + merges.txt."""

import numpy as np
import pytest
import tokenizers

from lla.data import paths
from lla.data import tokenizer as tokenizer_lib


@pytest.fixture(scope="module")
def tokenizer(data_dir):
  return tokenizer_lib.load_tokenizer(data_dir)


def test_known_ids(tokenizer):
  np.testing.assert_array_equal(tokenizer.encode("Hello world"), [15496, 995])
  assert tokenizer.encode("Hello world").dtype == np.int32
  assert tokenizer.vocab_size == 50257


def test_endoftext_is_one_special_token(tokenizer):
  np.testing.assert_array_equal(tokenizer.encode("a<|endoftext|>b"), [64, 50256, 65])
  assert tokenizer.eot_id == 50256


def test_round_trip_bytes(tokenizer):
  text = " = Valkyria Chronicles III = \n  café 日本語 <unk> @-@ \t\n"
  assert tokenizer.decode(tokenizer.encode(text)) == text
  ids = tokenizer.encode_batch(["Hello world", "", " world"])
  assert [list(i) for i in ids] == [[15496, 995], [], [995]]


def test_tokenizer_dir_and_data_dir_give_same_tokenizer(data_dir, tokenizer):
  direct = tokenizer_lib.load_tokenizer(data_dir / "gpt2-tokenizer")
  assert direct.sha256 == tokenizer.sha256


def test_environment_variable_is_the_default(data_dir, tokenizer, monkeypatch):
  monkeypatch.setenv(paths.ENV_VAR, str(data_dir))
  assert tokenizer_lib.load_tokenizer(None).sha256 == tokenizer.sha256


def test_directory_without_files_lists_places(tmp_path):
  with pytest.raises(paths.DataNotFoundError) as error:
    tokenizer_lib.load_tokenizer(tmp_path)
  for place in ("gpt2-tokenizer/vocab.json", "gpt2-tokenizer/merges.txt"):
    assert str(tmp_path / place) in str(error.value)
  assert str(tmp_path / "vocab.json") in str(error.value)


def test_missing_local_path_does_not_go_to_the_hub(tmp_path, monkeypatch):
  def no_network(*args, **kwargs):
    raise AssertionError("went to the hub")

  monkeypatch.setattr(tokenizers.Tokenizer, "from_pretrained", no_network)
  with pytest.raises(paths.DataNotFoundError, match="not a directory"):
    tokenizer_lib.load_tokenizer(tmp_path / "missing" / "tokenizer")
  with pytest.raises(paths.DataNotFoundError):
    tokenizer_lib.load_tokenizer("./gpt2")


def test_hub_unreachable_is_a_plain_error(monkeypatch):
  def offline(*args, **kwargs):
    raise OSError("We couldn't connect to 'https://huggingface.co'")

  monkeypatch.setattr(tokenizers.Tokenizer, "from_pretrained", offline)
  with pytest.raises(paths.DataNotFoundError) as error:
    tokenizer_lib.load_tokenizer("gpt2")
  assert "Hugging Face hub 'gpt2'" in str(error.value)
  assert "couldn't connect" in str(error.value)
  assert "vocab.json and merges.txt" in str(error.value)
