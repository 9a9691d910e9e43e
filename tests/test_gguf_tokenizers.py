"""GGUF byte-level BPE tokenizers by `tokenizer.ggml.pre` (`lla.model.gguf_io.PRE_TOKENIZERS`)
against references that do not use lla.

One tiny vocabulary (the 256 byte tokens and a few dozen merged tokens, ids non-trivial) is
made the way Llama-3's and Mistral-Nemo's tokenizer.json files were made: transformers'
`TikTokenConverter` turns byte ranks into a byte-level vocabulary and merges. The GGUF file
holds that vocabulary and those merges, as llama.cpp's converter copies them from a
tokenizer.json, with the entry's `tokenizer.ggml.pre`. Each entry's reference tokenizes the
same vocabulary its own way:

* default, gpt-2: transformers' GGUF tokenizer loader (`AutoTokenizer.from_pretrained(dir,
  gguf_file=...)`) on the same file.
* llama-bpe (and its aliases llama3, llama-v3): `TikTokenConverter().converted()`, the
  converter of Llama-3's tiktoken model, whose default pattern is Llama-3's and which sets
  `ignore_merges` (transformers' GGUF loader reads the regex but drops `ignore_merges`).
* tekken: the same converter with the pattern transformers' GGUF loader keeps for "tekken"
  (`GGUF_PRE_TOKENIZER_SPLITS`), which is how transformers' `MistralConverter` builds
  Mistral-Nemo's tokenizer from its tekken.json.
* qwen2: transformers' `Qwen2Tokenizer` (its tokenizer.json: NFC, Qwen2's split regex).
* smollm: SmolLM2's published tokenizer.json pre-tokenizer, written out below.

The texts have digit runs, punctuation runs before newlines, runs of spaces and tabs,
contractions in both cases, CRLF, slashes, case changes inside words, non-ASCII letters,
CJK and a decomposed accent.
"""

import json
import unicodedata

import gguf
import numpy as np
import pytest
import transformers
from tokenizers import Tokenizer
from transformers.convert_slow_tokenizer import TikTokenConverter
from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
from transformers.tokenization_utils_base import generate_merges

from lla.model import gguf_io

transformers.logging.set_verbosity_error()

TEXTS = [
    "Hello  world!!\n\n123456 x=3.14;  naïve café — 東京\t\tend...",
    "It's 2024: we'll SEE... (ok?)\r\n  \n\tDON'T stop",
    "a/b//c\n/d  and camelCaseWORDSand ÀÉÎ 12345678",
    " naïve",
    "cafe\u0301 x",  # decomposed é: Qwen2 normalises it to NFC
]
# Byte strings the vocabulary learns, each with all its prefixes (so merges reach them).
WORDS = [b"Hello", b" world", b"!!", b"\n\n", b"123", b"34", b"56", b" x", b"3.", b"14", b"  ",
         b"end", b"...", b" caf\xc3\xa9", b"\xc3\xaf", "東".encode(), b"It", b"'s", b"'ll",
         b"SEE", b"ok", b"\r\n", b"//", b"camel", b"Case", b"WORDS", b"and", b" and", b"20",
         b"'T"]
# In the vocabulary, but no merge makes it: only `ignore_merges` emits it whole.
WHOLE_ONLY = " naïve".encode()


class _Ranks(TikTokenConverter):
  """transformers' tiktoken converter fed byte ranks directly instead of a tiktoken file."""

  def __init__(self, ranks, **kwargs):
    super().__init__(vocab_file="in-memory", **kwargs)
    self.ranks = ranks

  def load_tiktoken_bpe(self, _):
    return self.ranks


def _ranks() -> dict[bytes, int]:
  ranks = {bytes([b]): b for b in range(256)}
  for word in WORDS:
    for end in range(2, len(word) + 1):
      ranks.setdefault(word[:end], len(ranks))
  ranks[WHOLE_ONLY] = len(ranks)
  return ranks


VOCAB, MERGES = _Ranks(_ranks()).extract_vocab_merges_from_model("in-memory")
TOKENS = sorted(VOCAB, key=VOCAB.get)
assert [VOCAB[t] for t in TOKENS] == list(range(len(TOKENS)))

# SmolLM2's tokenizer.json (HuggingFaceTB/SmolLM2-135M, "pre_tokenizer" and the BPE model's
# flags): every digit on its own, then GPT-2's byte-level regex; merges applied in full
# (llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM: "\p{N}", then GPT-2's expression).
SMOLLM2_PRE_TOKENIZER = {"type": "Sequence", "pretokenizers": [
    {"type": "Digits", "individual_digits": True},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}


def _smollm2_reference():
  spec = {"version": "1.0", "added_tokens": [], "normalizer": None,
          "pre_tokenizer": SMOLLM2_PRE_TOKENIZER, "post_processor": None,
          "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                      "use_regex": True},
          "model": {"type": "BPE", "dropout": None, "unk_token": None,
                    "continuing_subword_prefix": None, "end_of_word_suffix": None,
                    "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                    "vocab": VOCAB, "merges": [list(m) for m in MERGES]}}
  return Tokenizer.from_str(json.dumps(spec)).encode


def _encoder(tokenizer):
  return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


def _gguf_loader_reference(directory, name):
  return _encoder(transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name))


def reference(pre: str, directory, name):
  """ids = reference(pre, ...)(text), from a tokenizer built without lla."""
  if pre in ("default", "gpt-2"):
    return _gguf_loader_reference(directory, name)
  if pre in ("llama-bpe", "llama3", "llama-v3"):
    return _Ranks(_ranks()).converted().encode
  if pre == "tekken":
    return _Ranks(_ranks(), pattern=GGUF_PRE_TOKENIZER_SPLITS["tekken"]).converted().encode
  if pre == "qwen2":
    return _encoder(transformers.Qwen2Tokenizer(vocab=dict(VOCAB), merges=list(MERGES)))
  if pre == "smollm":
    return _smollm2_reference()
  raise AssertionError(f"no reference for {pre!r}")


def write_tokenizer_gguf(path, pre: str | None, add_bos: bool | None = None, **keys):
  """A tokenizer-only `llama` GGUF (the model keys transformers' loader needs, no tensors)."""
  writer = gguf.GGUFWriter(str(path), "llama")
  for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 64),
                     (writer.add_embedding_length, 8), (writer.add_feed_forward_length, 16),
                     (writer.add_head_count, 1), (writer.add_head_count_kv, 1),
                     (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_rope_freq_base, 1e4),
                     (writer.add_vocab_size, len(TOKENS))):
    add(value)
  writer.add_tokenizer_model("gpt2")
  if pre is not None:
    writer.add_tokenizer_pre(pre)
  writer.add_token_list(TOKENS)
  writer.add_token_types([1] * len(TOKENS))
  writer.add_token_merges([f"{a} {b}" for a, b in MERGES])
  writer.add_bos_token_id(0)
  writer.add_eos_token_id(1)
  if add_bos is not None:
    writer.add_add_bos_token(add_bos)
  for key, value in keys.items():
    writer.add_key_value(key, value[0], value[1])
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


PRES = ["default", "gpt-2", "smollm", "llama-bpe", "llama3", "llama-v3", "qwen2", "tekken"]


def test_every_entry_has_a_case():
  assert sorted(gguf_io.PRE_TOKENIZERS) == sorted(PRES)


@pytest.mark.parametrize("pre", PRES)
def test_pre_tokenizer_matches_its_reference(pre, tmp_path):
  write_tokenizer_gguf(tmp_path / "tok.gguf", pre)
  ours, _ = gguf_io.gguf_tokenizer(tmp_path / "tok.gguf")
  theirs = reference(pre, tmp_path, "tok.gguf")
  for text in TEXTS:
    ids = ours.encode(text).ids
    expected = theirs(text)
    expected = expected.ids if hasattr(expected, "ids") else expected
    assert ids == expected, (pre, text, ours.encode(text).tokens)
    assert max(ids) >= 256  # merged tokens, not bytes alone
    assert ours.decode(ids) == (unicodedata.normalize("NFC", text) if pre == "qwen2" else text)


def test_entries_cut_differently(tmp_path):
  """The table is what decides: the families' ids differ where their pre-tokenizers do
  (digits one by one or in threes, punctuation kept with the newline after it, whole-word
  tokens emitted by ignore_merges), on the same vocabulary and merges."""
  ids = {}
  for pre in ("gpt-2", "smollm", "llama-bpe", "qwen2", "tekken"):
    write_tokenizer_gguf(tmp_path / f"{pre}.gguf", pre)
    tokenizer, _ = gguf_io.gguf_tokenizer(tmp_path / f"{pre}.gguf")
    ids[pre] = [tokenizer.encode(text).tokens for text in TEXTS]
  assert len({json.dumps(v) for v in ids.values()}) == len(ids)
  first = {pre: v[0] for pre, v in ids.items()}
  # "!!\n\n123456": GPT-2 keeps the newlines apart and "123456" one piece; Llama-3 keeps the
  # newlines with the punctuation and cuts digits in threes; Qwen2, SmolLM2 and Tekken cut
  # every digit apart, so no digit merge applies.
  assert "\u010a\u010a" not in first["gpt-2"] and "123" in first["gpt-2"]
  assert "\u010a\u010a" in first["llama-bpe"] and "123" in first["llama-bpe"]
  for pre in ("qwen2", "smollm", "tekken"):
    assert not {"12", "123", "34", "56", "14"} & set(first[pre]), pre
  assert "\u010a\u010a" in first["qwen2"] and "\u010a\u010a" in first["tekken"]
  # Contractions in capitals: Qwen2's regex is case-insensitive, GPT-2's is not.
  assert "'T" in ids["qwen2"][1] and "'T" not in ids["gpt-2"][1]
  whole = "\u0120na\u00c3\u00afve"  # " naïve" spelled byte-level: no merge makes it
  assert whole in ids["llama-bpe"][3] and whole in ids["tekken"][3]
  assert whole not in ids["gpt-2"][3] and whole not in ids["qwen2"][3]


def test_bos_policy_defaults_to_llama_cpp_s_per_value(tmp_path):
  """A file without `tokenizer.ggml.add_bos_token` gets llama.cpp's default for its pre
  value (Llama-3 and Tekken add BOS); the key, where present, decides."""
  for pre, add_bos, expected in (("llama-bpe", None, True), ("tekken", None, True),
                                 ("qwen2", None, False), ("gpt-2", None, False),
                                 ("llama-bpe", False, False), ("qwen2", True, True)):
    write_tokenizer_gguf(tmp_path / "tok.gguf", pre, add_bos)
    assert gguf_io.gguf_tokenizer(tmp_path / "tok.gguf")[1] == {
        "bos_token_id": 0, "add_bos_token": expected}, (pre, add_bos)


def test_unknown_pre_tokenizer_and_keys_are_refused(tmp_path):
  write_tokenizer_gguf(tmp_path / "tok.gguf", "deepseek-llm")
  with pytest.raises(gguf_io.GGUFError) as info:
    gguf_io.gguf_tokenizer(tmp_path / "tok.gguf")
  message = str(info.value)
  assert "\n" not in message and "'deepseek-llm'" in message and "llama-bpe" in message
  assert "qwen2" in message and "tok.gguf" in message
  write_tokenizer_gguf(tmp_path / "prefix.gguf", "gpt-2", **{
      "tokenizer.ggml.add_space_prefix": (True, gguf.GGUFValueType.BOOL)})
  with pytest.raises(gguf_io.GGUFError, match="tokenizer.ggml.add_space_prefix"):
    gguf_io.gguf_tokenizer(tmp_path / "prefix.gguf")


def _sentencepiece_vocabulary() -> tuple[list[str], list[float], list[int]]:
  """A Llama-2-style SentencePiece vocabulary: <unk>/<s>/</s>, the 256 byte tokens, pieces
  with U+2581 for spaces. The scores are shuffled against the file's order, so the merges
  must follow the scores."""
  tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
  types = [2, 3, 3] + [6] * 256
  pieces = (["\u2581"] + list("abcdefghijklmnopqrstuvwxyzHTW.!,0123456789")
            + ["th", "he", "\u2581t", "\u2581the", "the", "in", "ing", "\u2581a", "an", "\u2581an",
               "er", "\u2581th", "\u2581he", "at", "\u2581cat", "ca", "\u2581ca", "\u2581\u2581",
               "on", "\u2581on", "ll", "llo", "He", "Hello", "\u2581w", "or", "\u2581wor",
               "\u2581world", "!!", "12", "en", "end", "..", "...", "\u2581x", "af", "caf",
               "\u2581caf", "\u2581caf\u00e9", "\u00e9", "\u2581na"])
  scores = [0.0] * len(tokens) + list(
      -np.random.default_rng(0).permutation(len(pieces)).astype(float))
  return tokens + pieces, scores, types + [1] * len(pieces)


@pytest.mark.parametrize("add_space_prefix", [None, False])
def test_llama_sentencepiece_tokenizer_is_transformers(add_space_prefix, tmp_path):
  """Llama-2 / Mistral-v0.1 GGUFs (`tokenizer.ggml.model == "llama"`, architecture llama)
  against transformers' GGUF loader on the same file: the same ids (merges from the scores,
  byte fallback, the prefix space llama.cpp adds unless the file says otherwise), decoding
  returns the text, BOS added by default."""
  tokens, scores, types = _sentencepiece_vocabulary()
  writer = gguf.GGUFWriter(str(tmp_path / "sp.gguf"), "llama")
  for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 64),
                     (writer.add_embedding_length, 8), (writer.add_feed_forward_length, 16),
                     (writer.add_head_count, 1), (writer.add_head_count_kv, 1),
                     (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_rope_freq_base, 1e4),
                     (writer.add_vocab_size, len(tokens))):
    add(value)
  writer.add_tokenizer_model("llama")
  writer.add_tokenizer_pre("default")
  writer.add_token_list(tokens)
  writer.add_token_scores(scores)
  writer.add_token_types(types)
  writer.add_bos_token_id(1)
  writer.add_eos_token_id(2)
  writer.add_unk_token_id(0)
  if add_space_prefix is not None:
    writer.add_add_space_prefix(add_space_prefix)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()

  ours, policy = gguf_io.gguf_tokenizer(tmp_path / "sp.gguf")
  assert policy == {"bos_token_id": 1, "add_bos_token": True}
  if add_space_prefix is None:
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="sp.gguf")
  else:  # transformers' GGUF loader drops the file's add_space_prefix; its class takes it
    theirs = transformers.LlamaTokenizer(
        vocab={t: i for i, t in enumerate(tokens)}, add_prefix_space=False,
        merges=generate_merges({t: i for i, t in enumerate(tokens)}, dict(zip(tokens, scores))))
  texts = TEXTS + ["the cat ate an onion", "Hello world", " leading  spaces", "x"]
  for text in texts:
    ids = ours.encode(text).ids
    assert ids == theirs(text, add_special_tokens=False)["input_ids"], text
    assert ours.decode(ids) == theirs.decode(ids, clean_up_tokenization_spaces=False), text
  prefix = ["\u2581"] if add_space_prefix is None else []
  assert ours.encode("Hello").tokens == prefix + ["Hello"]
  assert ours.encode("東").tokens == prefix + ["<0xE6>", "<0x9D>", "<0xB1>"]
