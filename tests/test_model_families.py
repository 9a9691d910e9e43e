"""lla's RoPE decoder families against transformers' PyTorch models (eager attention).

Each reference is a random tiny HF model (llama with llama3 RoPE scaling, an untied head, GQA
and biases; qwen2 with q/k/v biases and a tied head; qwen3 with q/k-norm; mistral with a
sliding window shorter than T; gemma with (1 + w) RMSNorm, GeGLU and sqrt(d) embedding scale;
gemma3 adding q/k-norm, sandwich norms, a score scale other than head_dim, windowed layers
shorter than T beside a full one, each kind with its own RoPE), saved with `save_pretrained` and read back with `hf_io.load_hf_dir`, so the checks cover the
conversion as well as the maths. Every norm weight and bias is perturbed away from its init.
Tolerances are relative to the largest magnitude of the reference tensor (1e-5).
"""

import json
import shutil
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from lla.model import hf_io, split
from lla.model.decoder import DecoderConfig
from lla.model.hf_io import CheckpointError

transformers.logging.set_verbosity_error()

B, T = 2, 16
RTOL = 1e-5

_COMMON = dict(vocab_size=101, hidden_size=64, num_hidden_layers=3, intermediate_size=96,
               max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=None)
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        tie_word_embeddings=False, attention_bias=True, mlp_bias=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8192))),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(
        hidden_size=48, num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=1e-6,
        tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
        tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=1, sliding_window=8, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    # k = 1 and 2 cut after a windowed and after the full layer; T = 16 > window 8.
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=24,
        rope_parameters={"full_attention": dict(rope_type="linear", rope_theta=1e6, factor=2.0),
                         "sliding_attention": dict(rope_type="default", rope_theta=1e4)})),
}
CUTS = (1, 2)


def assert_close(actual, reference, rtol, what=""):
  """max |actual - reference| <= rtol * max |reference|."""
  actual, reference = np.asarray(actual, np.float64), np.asarray(reference, np.float64)
  assert actual.shape == reference.shape, (what, actual.shape, reference.shape)
  err, scale = np.max(np.abs(actual - reference)), np.max(np.abs(reference))
  assert err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol:g} * {scale:.3g}"


def hf_model(family: str, seed: int = 0):
  config_cls, model_cls, extra = FAMILIES[family]
  torch.manual_seed(seed)
  config = config_cls(**{**_COMMON, **extra})
  config._attn_implementation = "eager"
  model = model_cls(config).eval()
  with torch.no_grad():
    for p in model.parameters():
      if p.ndim == 1:  # norm weights and biases: away from their (1 or 0, 0) init
        p.add_(0.1 * torch.randn_like(p))
  return model.requires_grad_(False)


def hf_boundary(model, tokens: torch.Tensor, k: int):
  """(h, g): HF's residual stream after layer k-1 and dL/dh for HF's `labels=` loss."""
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


class Ref(NamedTuple):
  family: str
  model: object
  directory: object
  params: dict
  cfg: DecoderConfig
  tokens: jax.Array
  tokens_pt: torch.Tensor


@pytest.fixture(scope="module", params=list(FAMILIES))
def ref(request, tmp_path_factory) -> Ref:
  model = hf_model(request.param)
  directory = tmp_path_factory.mktemp(request.param)
  model.save_pretrained(directory)
  params, cfg = hf_io.load_hf_dir(directory)
  tokens = np.random.default_rng(0).integers(0, _COMMON["vocab_size"], (B, T), dtype=np.int32)
  return Ref(request.param, model, directory, params, cfg, jnp.asarray(tokens),
             torch.from_numpy(tokens).long())


@pytest.fixture(params=["named", "stacked"])
def params(request, ref) -> dict:
  """The parameters in either form: the HF-named tree (layers unrolled) or its computation
  form (the layers stacked, a range of them one scanned layer body)."""
  return ref.params if request.param == "named" else split.computation_form(ref.params, ref.cfg)


def test_config_read(ref):
  cfg, hf = ref.cfg, ref.model.config
  assert cfg.family == ref.family
  assert (cfg.vocab_size, cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.d_ff) == (
      hf.vocab_size, hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads,
      hf.num_key_value_heads, hf.intermediate_size)
  assert cfg.head_dim == getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
  assert cfg.tie_embeddings == hf.tie_word_embeddings
  assert cfg.qk_norm == (ref.family in ("qwen3", "gemma3"))
  assert cfg.sandwich_norms == (ref.family == "gemma3")
  assert (cfg.sliding_window == 8) == (ref.family in ("mistral", "gemma3"))
  if ref.family == "gemma3":
    assert cfg.window_layers == (True, False, True) and cfg.query_pre_attn_scalar == 24
    assert (cfg.local_rope_theta, cfg.rope_type, cfg.rope_theta) == (1e4, "linear", 1e6)
  tied = np.array_equal(split.input_table(ref.params), split.output_table(ref.params))
  assert tied == cfg.tie_embeddings


def test_logits_and_hidden_states(ref, params):
  with torch.no_grad():
    out = ref.model(ref.tokens_pt, output_hidden_states=True)
  assert_close(split.logits(params, ref.cfg, ref.tokens), out.logits, RTOL, "logits")
  ours = jax.jit(split.hidden_states, static_argnums=1)(params, ref.cfg, ref.tokens)
  assert len(ours) == len(out.hidden_states) == ref.cfg.n_layer + 1
  for i, (a, r) in enumerate(zip(ours, out.hidden_states)):
    assert_close(a, r, RTOL, f"hidden state {i}")


def test_boundary_messages(ref, params):
  for k in CUTS:
    h_ref, g_ref = hf_boundary(ref.model, ref.tokens_pt, k)
    h, g = split.boundary_messages(params, ref.cfg, ref.tokens, k)
    assert_close(h, h_ref, RTOL, f"h at k={k}")
    assert_close(g, g_ref, RTOL, f"g at k={k}")


def test_server_loss_is_hf_loss(ref, params):
  with torch.no_grad():
    out = ref.model(ref.tokens_pt, labels=ref.tokens_pt)
  k = CUTS[-1]
  h = split.client(params, ref.cfg, ref.tokens, k)
  loss, logits = split.server_loss(params, ref.cfg, h, ref.tokens, k)
  assert_close(loss, out.loss, RTOL, "server loss")
  assert_close(logits, out.logits, RTOL, "server logits")


def test_kv_step_equals_batched_client_and_hf(ref, params):
  """The KV-cached one-token client (cache [k, 2, T, H_kv, D] of rotated keys) at every
  position, against the batched client and against HF's h."""
  k = CUTS[-1]
  h_ref, _ = hf_boundary(ref.model, ref.tokens_pt, k)
  want = split.client(params, ref.cfg, ref.tokens, k)
  step = jax.jit(jax.vmap(split.client_step, in_axes=(None, None, 0, 0, None)), static_argnums=1)
  cache = jnp.stack([split.init_cache(ref.cfg, k, T)] * B)
  assert cache.shape == (B, k, 2, T, ref.cfg.n_kv_head, ref.cfg.head_dim)
  rows = []
  for t in range(T):
    h_t, cache = step(params, ref.cfg, cache, ref.tokens[:, t], t)
    rows.append(h_t)
  stepped = jnp.stack(rows, axis=1)
  assert_close(stepped, want, RTOL, "KV step vs batched client")
  assert_close(stepped, h_ref, RTOL, "KV step vs HF h")


def test_step_embedding_is_step_kv(ref, params):
  """The continuous-input step (SipIt's gradient policy) from the input-table row equals the
  token step (Gemma: the row is scaled by sqrt(d) inside)."""
  k = 1
  cache = split.init_cache(ref.cfg, k, T)
  token = ref.tokens[0, 0]
  a, _ = split.client_step_kv(params, ref.cfg, cache, token, 0)
  b, _ = split.client_step_embedding(params, ref.cfg, cache,
                                     split.input_table(params)[token], 0)
  np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_computation_form_is_the_named_tree_stacked(ref):
  """Each leaf of the stack is the named layers' leaves one above the other, and the
  non-layer entries are the same arrays."""
  form = split.computation_form(ref.params, ref.cfg)
  assert split.computation_form(ref.params, ref.cfg) is form  # made once
  named = [f"layers_{i}" for i in range(ref.cfg.n_layer)]
  assert set(form) == (set(ref.params) - set(named)) | {"layer_stack"}
  for i, name in enumerate(named):
    jax.tree.map(lambda s, x, i=i: np.testing.assert_array_equal(s[i], x),
                 form["layer_stack"], ref.params[name])


def test_export_roundtrip_loads_in_transformers(ref, tmp_path):
  hf_io.save_hf_dir(ref.params, ref.cfg, tmp_path / "out")
  _, model_cls, _ = FAMILIES[ref.family]
  model, info = model_cls.from_pretrained(tmp_path / "out", output_loading_info=True,
                                          attn_implementation="eager")
  assert not any(info.values()), info
  with torch.no_grad():
    exported = model.eval()(ref.tokens_pt).logits.numpy()
    original = ref.model(ref.tokens_pt).logits.numpy()
  assert_close(exported, original, RTOL, "exported logits")
  params, cfg = hf_io.load_hf_dir(tmp_path / "out")
  assert cfg == ref.cfg
  jax.tree.map(np.testing.assert_array_equal, params, ref.params)


def _legacy(raw: dict) -> dict:
  """transformers 4.x's spelling: rope_theta + rope_scaling {"type": ...}, no rope_parameters
  (Gemma-3: the full layers' RoPE so, the sliding layers' base as rope_local_base_freq)."""
  raw = dict(raw)
  rope = dict(raw.pop("rope_parameters"))
  if "sliding_attention" in rope:
    raw["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    rope = dict(rope["full_attention"])
  raw["rope_theta"] = rope.pop("rope_theta")
  kind = rope.pop("rope_type")
  raw["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}
  return raw


def test_legacy_config_spelling(ref, tmp_path):
  directory = shutil.copytree(ref.directory, tmp_path / "legacy")
  raw = json.loads((directory / "config.json").read_text())
  assert "rope_parameters" in raw and "rope_theta" not in raw  # what transformers 5 writes
  (directory / "config.json").write_text(json.dumps(_legacy(raw)))
  _, cfg = hf_io.load_hf_dir(directory)
  assert cfg == ref.cfg


@pytest.mark.parametrize("family,change,field", [
    ("qwen3", dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0,
                                        original_max_position_embeddings=32)), "yarn"),
    ("qwen3", dict(rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0)),
     "dynamic"),
    ("qwen3", dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    ("qwen3", dict(final_logit_softcapping=30.0), "final_logit_softcapping"),
    ("qwen3", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    ("qwen3", dict(hidden_act="relu"), "hidden_act"),
    ("qwen3", dict(model_type="gemma2"), "model_type"),
    # Gemma-3's own: what its config can say that lla does not implement.
    ("gemma3", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("gemma3", dict(rope_parameters={
        "full_attention": dict(rope_type="default", rope_theta=1e6),
        "sliding_attention": dict(rope_type="linear", rope_theta=1e4, factor=2.0)}),
     "sliding_attention"),
    ("gemma3", dict(rope_parameters={"chunked_attention": dict(rope_type="default",
                                                               rope_theta=1e4)}),
     "chunked_attention"),
    ("gemma3", dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]),
     "layer_types"),
    ("gemma3", dict(final_logit_softcapping=30.0), "final_logit_softcapping"),
])
def test_unsupported_fields_are_refused_in_one_line(family, change, field, tmp_path):
  hf_model(family).save_pretrained(tmp_path)
  raw = json.loads((tmp_path / "config.json").read_text())
  raw.update(change)
  (tmp_path / "config.json").write_text(json.dumps(raw))
  with pytest.raises(CheckpointError) as info:
    hf_io.load_hf_dir(tmp_path)
  message = str(info.value)
  assert "\n" not in message and field in message, message


@pytest.mark.parametrize("ref", ["llama", "qwen3"], indirect=True)  # untied, tied
def test_lla_checkpoint_roundtrip_records_family(ref, tmp_path):
  """orbax checkpoint of a RoPE family: config (with family) and params restore exactly, the
  HF export is loadable, and load_model reports family and format."""
  import ml_collections

  from lla.model import checkpoint, loading
  saved = checkpoint.save(tmp_path / "ckpt", ref.params, ref.cfg,
                          metadata={"source_format": "hf-safetensors", "dequantisation": "none"})
  assert saved.metadata["family"] == ref.family
  restored = checkpoint.restore(tmp_path / "ckpt")
  assert restored.cfg == ref.cfg and restored.sha256 == saved.sha256
  jax.tree.map(np.testing.assert_array_equal, restored.params, ref.params)
  loaded = loading.load_model(ml_collections.ConfigDict({"checkpoint": str(tmp_path / "ckpt")}))
  assert {k: loaded.info[k] for k in ("family", "format", "source_format", "dequantisation")} \
      == {"family": ref.family, "format": "lla-checkpoint", "source_format": "hf-safetensors",
          "dequantisation": "none"}
  # It records no tokenizer and its vocabulary is not GPT-2's: no tokenizer cuts its text.
  assert ref.cfg.vocab_size != loading.GPT2_VOCAB_SIZE
  assert loaded.info["params_sha256"] == saved.sha256 and loaded.tokenizer_kind == "none"
  with pytest.raises(loading.TokenizerPolicyError, match="records no tokenizer"):
    loaded.text_tokenizer("--tokens_npy")
  # Trained here on GPT-2's tokens, it records that and is cut by GPT-2's tokenizer.
  checkpoint.save(tmp_path / "ckpt_gpt2", ref.params, ref.cfg, tokenizer=checkpoint.GPT2_TOKENS)
  loaded = loading.load_model(ml_collections.ConfigDict({"checkpoint": str(tmp_path / "ckpt_gpt2")}))
  assert loaded.tokenizer_kind == "gpt2"
  loaded = loading.load_model(ml_collections.ConfigDict({"hf_dir": str(restored.hf_dir)}))
  # The same weights; the export carries no tokenizer, so it declares none (another id).
  assert loaded.cfg == ref.cfg and loaded.params_sha256 == saved.sha256
  assert loaded.tokenizer_kind == "none" and loaded.model_id not in (saved.sha256, "")


def test_capture_cli_on_a_llama_checkpoint(tmp_path):
  """experiments/capture.py --config.model.hf_dir=DIR on a llama (llama3 RoPE, untied, GQA):
  the stored h and g equal transformers' at the cut, and the record names the family."""
  import subprocess
  import sys

  from lla.capture import store
  model = hf_model("llama")
  model.save_pretrained(tmp_path / "hf")
  tokens = np.random.default_rng(1).integers(0, _COMMON["vocab_size"], (3, T)).astype(np.int32)
  np.save(tmp_path / "tokens.npy", tokens)
  k = 2
  result = subprocess.run(
      [sys.executable, "-m", "experiments.capture", "--config=configs/capture.py",
       f"--config.model.hf_dir={tmp_path / 'hf'}", f"--config.data.tokens_npy={tmp_path / 'tokens.npy'}",
       f"--config.cut={k}", f"--workdir={tmp_path / 'capture'}"],
      cwd=str(__import__("pathlib").Path(__file__).parents[1]), capture_output=True, text=True)
  assert result.returncode == 0, result.stderr[-2000:]
  captured = store.load_capture(tmp_path / "capture")
  h_ref, g_ref = hf_boundary(model, torch.from_numpy(tokens).long(), k)
  assert_close(captured.activations, h_ref, RTOL, "captured h")
  assert_close(captured.gradients, g_ref, RTOL, "captured g")
  info = captured.metadata["model_info"]
  assert {k: info[k] for k in ("family", "format", "dequantisation")} == {
      "family": "llama", "format": "hf-safetensors", "dequantisation": "none"}
  # Token files fed a directory without a tokenizer; its id covers its config.
  assert info["tokenizer"] == {"kind": "none"} and info["architecture_sha256"]
  assert captured.metadata["protocol"]["T"]["model_id"] not in ("", info["params_sha256"])


def test_the_llama_twin_has_its_gpt2s_shape_and_size():
  """configs/models.py's `embedded_llama` is the embedded GPT-2's twin: the same vocabulary,
  width, depth, heads and positions, and (SwiGLU of width ~8d/3 against GPT-2's 4d MLP)
  within 1% of its parameter count, counted from the initialised shapes."""
  from configs import main_table
  from configs import models as model_configs
  from lla.model import loading
  gpt2, twin = (loading.architecture(model_configs.get_config(name))
                for name in ("embedded", "embedded_llama"))
  shared = ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions")
  assert twin.family == "llama" and all(getattr(twin, f) == getattr(gpt2, f) for f in shared)
  count = lambda cfg: sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(
      jax.eval_shape(lambda: split.init_params(cfg, jax.random.key(0)))))
  assert abs(count(twin) / count(gpt2) - 1) < 0.01, (count(twin), count(gpt2))
  # The main job's twin variant reads the twin's architecture in every phase.
  config = main_table.get_config("cpu_llama")
  for part in (config.model, config.pretrain.model, config.finetune.model, config.active.model,
               config.frontier.sweep.cell.target):
    assert loading.architecture(part) == twin


def _tokenizer_json(path, template: str | None):
  """A word-level tokenizer over the family tests' 101 ids ("<s>" = 1, "</s>" = 2), with
  `template` as its post-processor (None: none)."""
  import tokenizers
  from tokenizers import models as tok_models, pre_tokenizers, processors
  vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 101)}}
  tokenizer = tokenizers.Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
  if template is not None:
    tokenizer.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[("<s>", 1), ("</s>", 2)])
  tokenizer.save(str(path))


def test_a_published_directory_brings_its_architecture_and_its_tokenizers_bos(tmp_path):
  """A Qwen3 save_pretrained directory (q/k-norm, head_dim 32 != d / H = 16) given as the
  base of a Llama model config: the loader takes the directory's architecture (the client's
  h equals transformers'), records it, and reads the directory's tokenizer.json with the BOS
  its post-processor prepends; without tokenizer.json it cuts no text (not with GPT-2's),
  and a post-processor that appends an EOS is refused in one line."""
  from configs import models as model_configs
  from lla.model import loading
  hf = hf_model("qwen3")
  hf.save_pretrained(tmp_path / "qwen3")
  config = model_configs.get_config("tiny_llama")
  config.hf_dir = str(tmp_path / "qwen3")
  loaded = loading.load_model(config, check_architecture=True)
  params, cfg = loaded.params, loaded.cfg
  assert (cfg.family, cfg.head_dim, cfg.qk_norm, cfg.n_embd // cfg.n_head) == ("qwen3", 32, True,
                                                                              16)
  assert {k: loaded.info[k] for k in ("family", "format", "dequantisation")} == {
      "family": "qwen3", "format": "hf-safetensors", "dequantisation": "none"}
  tokens = np.random.default_rng(3).integers(0, _COMMON["vocab_size"], (B, T)).astype(np.int32)
  assert_close(split.client(params, cfg, jnp.asarray(tokens), 2),
               hf_boundary(hf, torch.from_numpy(tokens).long(), 2)[0], RTOL, "h at k = 2")
  assert loaded.tokenizer is None  # no tokenizer.json: none, and no text cut by GPT-2's
  with pytest.raises(loading.TokenizerPolicyError, match="without its tokenizer"):
    loaded.text_tokenizer("--config.data.tokens_npy")
  for template, bos in (("$A", None), ("<s> $A", 1)):
    _tokenizer_json(tmp_path / "qwen3" / "tokenizer.json", template)
    own = loading.load_model(config).text_tokenizer("--config.data.tokens_npy")
    assert own.bos_id == bos and own.encode("w5 w7").tolist() == [5, 7]
  _tokenizer_json(tmp_path / "qwen3" / "tokenizer.json", "$A </s>")
  with pytest.raises(loading.TokenizerPolicyError, match="lla places one leading BOS"):
    loading.load_model(config)


def test_a_published_model_without_weights_is_refused_before_any_write(tmp_path):
  import subprocess
  import sys
  result = subprocess.run(
      [sys.executable, "-m", "experiments.main_table", "--config=configs/main_table.py:paper_qwen3",
       f"--workdir={tmp_path / 'work'}"],
      cwd=str(__import__("pathlib").Path(__file__).parents[1]), capture_output=True, text=True,
      env=dict(__import__("os").environ, JAX_PLATFORMS="cpu"))
  assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
  line, = result.stderr.strip().splitlines()
  assert "'qwen3_0_6b'" in line and "--config.model.hf_dir" in line
  assert not [p for p in (tmp_path / "work").rglob("*") if p.is_file()]
