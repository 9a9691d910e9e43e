"""The one loader (lla.model.loading): its source order, the tokenizer its model carries,
and the model id over params, architecture and tokenizer.

A random Qwen3 (transformers, 2 layers, d 64) is saved with a byte-level BPE tokenizer of its
own (Qwen2's pre-tokenizer regex, trained here on WikiText-2 text and padded past GPT-2's
50,257 ids), then captured from corpus passages and replayed without calibration tokens: its
documents are checked against the WikiText-2 text and the vocabulary, not against lla.
"""

import json
import pathlib
import shutil

import jax
import numpy as np
import pytest
import tokenizers
import torch
from safetensors.numpy import load_file
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import Qwen3Config, Qwen3ForCausalLM

from configs import capture as capture_config
from configs import finetune as finetune_config
from configs import models as model_configs
from configs import replay as replay_config
from lla.capture import runner as capture_runner
from lla.data import load as data_load
from lla.data import passages
from lla.data import tokenizer as tokenizer_lib
from lla.evidence import rundir
from lla.model import checkpoint, hf_io, loading
from lla.model.gpt2 import GPT2Config, init_params
from lla.replay import driver as replay
from lla.replay import runner as replay_runner
from lla.train import finetune

# Qwen2's pre-tokenizer (its tokenizer.json): digits one by one, punctuation runs keep a
# following newline; GPT-2's regex does neither.
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
VOCAB = 50_432  # the model's; its tokenizer's ids reach past GPT-2's 50,257
T = 16


def qwen2_style_tokenizer(text: str) -> tokenizers.Tokenizer:
  """Byte-level BPE with Qwen2's pre-tokenizer, trained on `text`, its vocabulary padded
  with added tokens to just over GPT-2's 50,257 ids (the last ones unreachable from text)."""
  tokenizer = tokenizers.Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(tokenizers.Regex(QWEN2_REGEX), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=1500, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer)
  pad = 50_300 - tokenizer.get_vocab_size()
  tokenizer.add_tokens([f"<|pad_{i}|>" for i in range(pad)])
  tokenizer.add_special_tokens(["<|endoftext|>"])
  return tokenizer


def save_qwen3(directory: pathlib.Path, rope_theta: float = 1e6, seed: int = 0,
               tokenizer: tokenizers.Tokenizer | None = None) -> pathlib.Path:
  torch.manual_seed(seed)
  config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, max_position_embeddings=128, rope_theta=rope_theta,
                       tie_word_embeddings=True)
  Qwen3ForCausalLM(config).save_pretrained(directory)
  if tokenizer is not None:
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"add_bos_token": False, "bos_token": None, "eos_token": "<|endoftext|>"}))
  return directory


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, data_dir):
  """(save_pretrained directory with its tokenizer, that tokenizer)."""
  text = (data_dir / "wikitext-2" / "train.txt").read_text(encoding="utf-8")[:300_000]
  tokenizer = qwen2_style_tokenizer(text)
  directory = save_qwen3(tmp_path_factory.mktemp("qwen3") / "model", tokenizer=tokenizer)
  return directory, tokenizer


def _decoded_in(tokens: np.ndarray, tokenizer: tokenizers.Tokenizer, text: str) -> None:
  """Every row decodes to a piece of `text` (rows cut inside a multi-byte character, whose
  ends decode to U+FFFD, are checked on their whole characters)."""
  for row in tokens:
    piece = tokenizer.decode(row.tolist(), skip_special_tokens=False)
    piece = piece.strip("\ufffd")
    assert len(piece) > 10 and piece in text, piece


def test_a_qwen3_with_its_own_tokenizer_is_captured_and_replayed_in_its_vocabulary(
    qwen, data_dir, tmp_path, monkeypatch):
  directory, tokenizer = qwen
  monkeypatch.setenv("LLA_CACHE_DIR", str(tmp_path / "cache"))
  config = capture_config.get_config("tiny")
  config.model.hf_dir = str(directory)
  config.data.update(seq_len=T, n_eval=8, n_calibration=16, n_train=8)
  config.update(cut=1, batch_size=4)
  capture_dir = tmp_path / "cap"
  capture_runner.capture_from_config(config, str(capture_dir))
  test_text = (data_dir / "wikitext-2" / "test.txt").read_text(encoding="utf-8")
  train_text = (data_dir / "wikitext-2" / "train.txt").read_text(encoding="utf-8")
  documents = load_file(str(capture_dir / "truth.safetensors"))["tokens"]
  assert documents.shape == (8, T)
  _decoded_in(documents, tokenizer, test_text)

  run = replay_config.get_config("tiny")
  run.capture_dir = str(capture_dir)
  run.attacker.hf_dir = str(directory)  # no calibration tokens: cut by the model's tokenizer
  run.calibration.update(seq_len=T, n_eval=8, n_calibration=16, n_train=8)
  run.attacks = "ridge"
  run_dir = tmp_path / "run"
  replay_runner.replay_from_config(run, str(run_dir))
  calibration, = (run_dir / "inputs").glob("calibration_*.npy")
  calibration = np.load(calibration)
  assert calibration.shape == (16, T)
  _decoded_in(calibration, tokenizer, train_text)
  record, = rundir.load_records(str(run_dir))
  counts = np.bincount(calibration.ravel(), minlength=VOCAB)
  assert record.baseline_token == int(counts.argmax())
  assert tokenizer.id_to_token(record.baseline_token) is not None
  metadata = json.loads((capture_dir / "metadata.json").read_text())
  loaded = loading.load_model({"hf_dir": str(directory)})
  assert metadata["protocol"]["T"]["model_id"] == loaded.model_id != loaded.params_sha256
  assert metadata["protocol"]["C"].get("known_prefix", []) == []


def test_the_same_directory_without_its_tokenizer_is_refused_in_one_line(qwen, tmp_path):
  directory, _ = qwen
  bare = tmp_path / "bare"
  shutil.copytree(directory, bare)
  (bare / "tokenizer.json").unlink()
  (bare / "tokenizer_config.json").unlink()
  config = capture_config.get_config("tiny")
  config.model.hf_dir = str(bare)
  config.data.update(seq_len=T, n_eval=8)
  config.update(cut=1, batch_size=4)
  with pytest.raises(loading.TokenizerPolicyError) as refused:
    capture_runner.capture_from_config(config, str(tmp_path / "cap"))
  message = str(refused.value)
  assert "\n" not in message and "without its tokenizer" in message
  assert "--config.data.tokens_npy" in message
  assert not (tmp_path / "cap").exists()
  run = replay_config.get_config("tiny")
  run.capture_dir = str(tmp_path / "cap")
  with pytest.raises(loading.TokenizerPolicyError, match="--config.calibration.tokens_npy"):
    replay_runner.calibration_tokens(run.calibration, loading.load_model({"hf_dir": str(bare)}))


def test_another_rope_base_is_another_model_and_replay_refuses_it(tmp_path):
  """Identical weights, RoPE base 1e6 against 1e4: the same params hash, different model
  ids, and a run made with one attacker refuses the other."""
  one = save_qwen3(tmp_path / "a", rope_theta=1e6)
  other = tmp_path / "b"
  shutil.copytree(one, other)
  raw = json.loads((other / "config.json").read_text())
  for key in ("rope_theta",):
    if key in raw:
      raw[key] = 1e4
  if "rope_parameters" in raw:
    raw["rope_parameters"]["rope_theta"] = 1e4
  (other / "config.json").write_text(json.dumps(raw))
  a, b = (loading.load_model({"hf_dir": str(d)}) for d in (one, other))
  assert a.cfg.rope_theta == 1e6 and b.cfg.rope_theta == 1e4
  assert a.params_sha256 == b.params_sha256
  assert a.model_id != b.model_id

  tokens = np.random.default_rng(0).integers(0, 1000, (4, 8)).astype(np.int32)
  np.save(tmp_path / "tokens.npy", tokens)
  config = capture_config.get_config("tiny")
  config.model.hf_dir = str(one)
  config.data.tokens_npy = str(tmp_path / "tokens.npy")
  config.update(cut=1, batch_size=4)
  capture_runner.capture_from_config(config, str(tmp_path / "cap"))
  run = replay_config.get_config("tiny")
  run.capture_dir = str(tmp_path / "cap")
  run.calibration.tokens_npy = str(tmp_path / "tokens.npy")
  run.attacks = "ridge"
  run.attacker.hf_dir = str(one)
  replay_runner.replay_from_config(run, str(tmp_path / "run"))
  run.attacker.hf_dir = str(other)
  with pytest.raises(replay.ReplayInputError,
                     match=r"another protocol tuple \(differs in K.weights_sha256\)") as refused:
    replay_runner.replay_from_config(run, str(tmp_path / "run"))
  assert "\n" not in str(refused.value)


def _bpe_json(path: pathlib.Path, bos_in_post_processor: bool) -> None:
  vocab = {"<unk>": 0, "<|bos|>": 1, "a": 2, "b": 3}
  tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
  if bos_in_post_processor:
    tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", 1)])
  tokenizer.save(str(path / "tokenizer.json"))


@pytest.mark.parametrize("post, config, bos", [
    (False, {"add_bos_token": True, "bos_token": "<|bos|>"}, 1),
    (False, {"add_bos_token": True, "bos_token": {"content": "<|bos|>", "special": True}}, 1),
    (True, {"add_bos_token": False, "bos_token": "<|bos|>"}, None),
    (True, {"bos_token": "<|bos|>"}, 1),
    (False, {}, None),
])
def test_tokenizer_config_add_bos_token_is_honoured(tmp_path, post, config, bos):
  _bpe_json(tmp_path, post)
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  assert tokenizer_lib.from_pretrained_dir(tmp_path).bos_id == bos


@pytest.mark.parametrize("post, config, message", [
    (False, {"add_bos_token": True}, "add_bos_token is true but it names no bos_token"),
    (False, {"add_bos_token": True, "bos_token": "<s>"}, "bos_token '<s>' is not in"),
    (True, {"bos_token": "a"}, "names bos_token 'a'"),
])
def test_an_inconsistent_bos_policy_is_refused_in_one_line(tmp_path, post, config, message):
  _bpe_json(tmp_path, post)
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=message) as refused:
    tokenizer_lib.from_pretrained_dir(tmp_path)
  assert "\n" not in str(refused.value)


def test_add_bos_token_puts_the_bos_first_in_every_passage(qwen, tmp_path, monkeypatch):
  """A directory whose tokenizer_config.json asks for a BOS: every passage starts with it,
  and calibration documents without it are refused against a capture that has it."""
  directory, tokenizer = qwen
  bos_dir = tmp_path / "bos"
  shutil.copytree(directory, bos_dir)
  (bos_dir / "tokenizer_config.json").write_text(json.dumps(
      {"add_bos_token": True, "bos_token": "<|endoftext|>"}))
  monkeypatch.setenv("LLA_CACHE_DIR", str(tmp_path / "cache"))
  loaded = loading.load_model({"hf_dir": str(bos_dir)})
  bos = tokenizer.token_to_id("<|endoftext|>")
  assert loaded.tokenizer.bos_id == bos
  plain = loading.load_model({"hf_dir": str(directory)})
  assert plain.tokenizer.bos_id is None and plain.model_id != loaded.model_id
  splits = data_load.load_splits(seq_len=T, n_calibration=4, n_train=4, n_eval=4,
                                 tokenizer=loaded.tokenizer)
  assert (splits.calibration.tokens[:, 0] == bos).all()
  assert (splits.calibration.tokens[:, 1:] != bos).all()
  (tmp_path / "cap").mkdir()
  (tmp_path / "cap" / "metadata.json").write_text(json.dumps(
      {"protocol": {"C": {"known_prefix": [bos]}}}))
  replay_runner.check_bos_policy(str(tmp_path / "cap"), splits.calibration.tokens, None)
  with pytest.raises(replay.ReplayInputError, match="2 calibration document"):
    replay_runner.check_bos_policy(str(tmp_path / "cap"),
                                   splits.calibration.tokens[:2, ::-1].copy(), None)
  (tmp_path / "cap" / "metadata.json").write_text(json.dumps(
      {"protocol": {"C": {"known_prefix": []}}}))
  with pytest.raises(replay.ReplayInputError, match="has no BOS"):
    replay_runner.check_bos_policy(str(tmp_path / "cap"), splits.calibration.tokens,
                                   loaded.tokenizer)


SMALL = dict(vocab_size=128, n_positions=16)


def test_finetune_takes_the_hf_dir_over_the_presets_checkpoint(tmp_path):
  """`--config.model.hf_dir=DIR` on a preset whose `checkpoint` also names weights: the one
  order (gguf, gguf_package, hf_dir, checkpoint, hub) fine-tunes the directory's model
  (before, fine-tuning took the checkpoint)."""
  config = finetune_config.get_config("tiny")
  config.model.update(SMALL)
  config.update({"num_models": 1, "batch_size": 8, "num_epochs": 1})
  cfg = loading.architecture(config.model)
  preset = checkpoint.save(tmp_path / "preset", init_params(cfg, jax.random.key(0)), cfg,
                           export_hf=False)
  theirs = init_params(cfg, jax.random.key(1))
  hf_io.save_hf_dir(theirs, cfg, tmp_path / "theirs")
  config.model.checkpoint = str(preset.path)
  config.model.hf_dir = str(tmp_path / "theirs")
  rng = np.random.default_rng(0)
  windows = rng.integers(0, SMALL["vocab_size"], (48, 12)).astype(np.int32)
  make = lambda ids: passages.make_passages(windows, np.asarray(ids), "train")
  splits = passages.Splits(corpus="synthetic", seq_len=12, seed=0, calibration=make(range(8)),
                           training=make(range(8, 24)), evaluation=make(range(24, 48)),
                           provenance={})
  tuned, = finetune.finetune(config, tmp_path / "ft", splits)
  base = tuned.metadata["base"]
  assert base["source"] == f"hf:{tmp_path / 'theirs'}"
  assert base["model"]["params_sha256"] == checkpoint.params_sha256(theirs) != preset.sha256
  # A GPT-2 directory without a tokenizer is GPT-2's: the copy records it.
  assert tuned.metadata["tokenizer"] == {"kind": checkpoint.GPT2_TOKENS}


def test_a_checkpoint_is_cut_with_the_tokenizer_it_records(tmp_path):
  """GPT-2's tokenizer where an lla checkpoint records it (trained here on GPT-2's tokens)
  or has GPT-2's vocabulary (made before lla recorded it); any other checkpoint that records
  no tokenizer (e.g. fine-tuned from a base with its own, before lla kept it) is refused in
  one line where its text must be cut, and is another model than the recorded one."""
  small = GPT2Config(vocab_size=64, n_positions=16, n_embd=8, n_layer=2, n_head=2)
  params = init_params(small, jax.random.key(0))
  trained = checkpoint.save(tmp_path / "trained", params, small, export_hf=False,
                            tokenizer=checkpoint.GPT2_TOKENS)
  metadata = json.loads((trained.path / checkpoint.METADATA_FILE).read_text())
  assert metadata["tokenizer"] == {"kind": "gpt2"}
  assert not (trained.path / checkpoint.TOKENIZER_FILE).exists()
  recorded = loading.load_model({"checkpoint": str(trained.path)})
  assert recorded.tokenizer_kind == loading.GPT2_TOKENIZER
  assert recorded.text_tokenizer("--config.data.tokens_npy") is None  # GPT-2's
  assert recorded.recorded_tokenizer == checkpoint.GPT2_TOKENS  # what a copy records
  bare = checkpoint.save(tmp_path / "bare", params, small, export_hf=False)
  assert "tokenizer" not in json.loads((bare.path / checkpoint.METADATA_FILE).read_text())
  unknown = loading.load_model({"checkpoint": str(bare.path)})
  assert unknown.tokenizer_kind == loading.NO_TOKENIZER and unknown.recorded_tokenizer is None
  with pytest.raises(loading.TokenizerPolicyError) as refused:
    unknown.text_tokenizer("--config.data.tokens_npy")
  message = str(refused.value)
  assert "\n" not in message and message.startswith(f"lla:{bare.path}: ")
  assert "vocabulary of 64" in message and "records no tokenizer" in message
  assert "--config.data.tokens_npy" in message
  assert unknown.model_id != recorded.model_id  # same weights, cut otherwise
  # GPT-2's vocabulary: a checkpoint that records nothing keeps GPT-2's, and its model id.
  gpt2 = GPT2Config(vocab_size=50257, n_positions=16, n_embd=8, n_layer=1, n_head=2)
  params = init_params(gpt2, jax.random.key(1))
  old = loading.load_model({"checkpoint": str(
      checkpoint.save(tmp_path / "old", params, gpt2, export_hf=False).path)})
  new = loading.load_model({"checkpoint": str(checkpoint.save(
      tmp_path / "new", params, gpt2, export_hf=False, tokenizer=checkpoint.GPT2_TOKENS).path)})
  assert old.tokenizer_kind == new.tokenizer_kind == loading.GPT2_TOKENIZER
  assert old.text_tokenizer("--config.data.tokens_npy") is None
  assert old.model_id == new.model_id


def test_a_checkpoint_of_another_architecture_is_refused(tmp_path):
  """Where the config is the architecture (fine-tuning), a checkpoint of another is refused
  in one line; capture and replay take the checkpoint's own."""
  config = model_configs.get_config("tiny")
  other = GPT2Config(vocab_size=50257, n_positions=64, n_embd=32, n_layer=3, n_head=2)
  saved = checkpoint.save(tmp_path / "c", init_params(other, jax.random.key(0)), other,
                          export_hf=False)
  config.checkpoint = str(saved.path)
  with pytest.raises(loading.ModelLoadError, match="differs from model config 'tiny'") as refused:
    loading.load_model(config, check_architecture=True)
  assert "\n" not in str(refused.value)
  assert loading.load_model(config).cfg == other


def test_model_id_rule():
  """The GPT-2 presets with GPT-2's tokenizer keep the params' hash as their id; any other
  field, family or tokenizer gives another id, computed as docs/run_format.md states."""
  import hashlib
  embedded = loading.architecture(model_configs.get_config("embedded"))
  params_sha = "ab" * 32
  assert loading.identify(params_sha, embedded, None)[0] == params_sha
  assert loading.identify(params_sha, embedded.replace(dtype="bfloat16"), None)[0] == params_sha
  for name in ("tiny", "gpt2_124m"):
    cfg = loading.architecture(model_configs.get_config(name))
    assert loading.identify(params_sha, cfg, None)[0] == params_sha
  other_eps = embedded.replace(layer_norm_epsilon=1e-6)
  model_id, parts = loading.identify(params_sha, other_eps, None)
  fields = {k: v for k, v in other_eps.__dict__.items() if k != "dtype"}
  arch = hashlib.sha256(json.dumps({"config_class": "GPT2Config", "config": fields,
                                    "tokenizer": {"kind": "gpt2"}}, sort_keys=True,
                                   separators=(",", ":")).encode()).hexdigest()
  assert parts["architecture_sha256"] == arch
  assert model_id == hashlib.sha256(f"lla-model-id.v1:{params_sha}:{arch}".encode()).hexdigest()
  llama = loading.architecture(model_configs.get_config("embedded_llama"))
  assert loading.identify(params_sha, llama, None)[0] not in (params_sha, model_id)


def _hub_cache(cache: pathlib.Path, repo: str, files: pathlib.Path) -> None:
  """`files` laid out as huggingface_hub's cache holds a snapshot of `repo` at main."""
  revision = "0" * 40
  root = cache / ("models--" + repo.replace("/", "--"))
  shutil.copytree(files, root / "snapshots" / revision)
  (root / "refs").mkdir()
  (root / "refs" / "main").write_text(revision)


def test_a_hub_model_is_cut_with_its_own_tokenizer(qwen, tmp_path, monkeypatch):
  # The hub is a closed local port, so snapshot_download answers from the cache: the same
  # files and code path as a download, without the network.
  import huggingface_hub.constants  # pylint: disable=import-outside-toplevel
  directory, tokenizer = qwen
  monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
  monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
  monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
  _hub_cache(tmp_path, "lla-test/qwen3", directory)
  from_hub = loading.load_model({"hub": "lla-test/qwen3"})
  from_dir = loading.load_model({"hf_dir": str(directory)})
  text = "The tower , built in 1889 , is 330 metres tall ."
  assert from_hub.tokenizer is not None
  assert list(from_hub.tokenizer.encode(text)) == tokenizer.encode(text).ids
  # The same weights, config and tokenizer: the same function, whichever way it came.
  assert from_hub.model_id == from_dir.model_id
