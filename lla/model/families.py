"""HF `config.json` and tensor names of the RoPE families <-> `DecoderConfig` and Flax params.

`config_from_hf(raw)` reads both config spellings: transformers 5's `rope_parameters` and the
legacy `rope_theta` / `rope_scaling` of checkpoints written by 4.x. A field lla does not
implement (yarn / dynamic NTK / longrope RoPE, partial rotary, logit soft-capping, per-layer
RoPE outside Gemma-3's two layer types, bidirectional attention, a quantization_config) is
refused with one line naming it (`UnsupportedField`). `model_type` "gemma3_text" (Gemma-3's
text model, `Gemma3ForCausalLM`) is the family "gemma3".

Tensor names: HF `model.layers.{i}.self_attn.q_proj.weight` <-> Flax
`layers_{i}/self_attn/q_proj/kernel`; every `nn.Linear` weight `[out, in]` is transposed to a
Flax kernel `[in, out]`; embeddings, norms and `lm_head` `[V, d]` are not.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from lla.model.decoder import DecoderConfig, init_params

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma3_text")
# DecoderConfig.family of each model_type (the same name but Gemma-3's).
FAMILY_OF = {**{m: m for m in MODEL_TYPES}, "gemma3_text": "gemma3"}
MODEL_TYPE_OF = {family: model_type for model_type, family in FAMILY_OF.items()}

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "gemma": "GemmaForCausalLM", "gemma3": "Gemma3ForCausalLM"}
# transformers' class defaults for fields a config.json may omit.
_TIED_DEFAULT = {"llama": False, "mistral": False, "qwen2": False, "qwen3": False, "gemma": True,
                 "gemma3": True}
_EPS_DEFAULT = {"llama": 1e-6, "mistral": 1e-6, "qwen2": 1e-6, "qwen3": 1e-6, "gemma": 1e-6,
                "gemma3": 1e-6}
# Gemma3TextConfig's defaults: RoPE bases of its full and sliding layers, the window, every
# `sliding_window_pattern`-th layer full, the score scale.
_GEMMA3_DEFAULTS = dict(global_theta=1e6, local_theta=1e4, sliding_window=4096, pattern=6,
                        query_pre_attn_scalar=256)
_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu",
                "gelu_new": "geglu"}


class UnsupportedField(ValueError):
  """A config field (or value) lla does not implement; the message names it, in one line."""


def _rope(raw: dict) -> dict:
  """The RoPE fields of DecoderConfig from either spelling (one RoPE for every layer)."""
  params = raw.get("rope_parameters")
  legacy = raw.get("rope_scaling")
  if params is not None and not isinstance(params, dict):
    raise UnsupportedField(f"rope_parameters={params!r} is not a dict")
  if params and any(isinstance(v, dict) for v in params.values()):
    raise UnsupportedField("rope_parameters is per layer type (nested); lla implements one RoPE "
                           "for every layer")
  merged: dict[str, Any] = dict(legacy or {})
  merged.update(params or {})
  theta = merged.get("rope_theta", raw.get("rope_theta", 10000.0))
  rope_type = merged.get("rope_type", merged.get("type", "default"))
  partial = merged.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
  if partial not in (None, 1, 1.0):
    raise UnsupportedField(f"partial_rotary_factor={partial} is unsupported (lla rotates the whole head)")
  if rope_type not in ("default", "linear", "llama3"):
    name = {"dynamic": "dynamic NTK"}.get(rope_type, rope_type)
    raise UnsupportedField(f"rope_type {rope_type!r} ({name} RoPE scaling) is unsupported; lla "
                           "implements default, linear and llama3")
  out = dict(rope_type=rope_type, rope_theta=float(theta))
  if rope_type in ("linear", "llama3"):
    out["rope_factor"] = float(merged["factor"])
  if rope_type == "llama3":
    out.update(rope_low_freq_factor=float(merged["low_freq_factor"]),
               rope_high_freq_factor=float(merged["high_freq_factor"]),
               rope_original_max_positions=int(merged["original_max_position_embeddings"]))
  if merged.get("attention_factor") not in (None, 1, 1.0):
    raise UnsupportedField(f"rope attention_factor={merged['attention_factor']} is unsupported")
  return out


def _gemma3_rope(raw: dict) -> dict:
  """Gemma-3's two RoPEs: the config's for full-attention layers (`rope_parameters
  ["full_attention"]`, or legacy `rope_theta` + `rope_scaling`), a default one of base
  `local_rope_theta` for sliding layers (`["sliding_attention"]`, or `rope_local_base_freq`)."""
  params = raw.get("rope_parameters")
  if params is not None and not (isinstance(params, dict)
                                 and all(isinstance(v, dict) for v in params.values())):
    raise UnsupportedField(f"rope_parameters={params!r} is not a dict per layer type")
  params = params or {}
  if set(params) - {"full_attention", "sliding_attention"}:
    raise UnsupportedField(f"rope_parameters for layer types {sorted(params)} (lla knows "
                           "full_attention and sliding_attention)")
  full = dict(params.get("full_attention") or {})
  full.setdefault("rope_theta", raw.get("rope_theta", _GEMMA3_DEFAULTS["global_theta"]))
  full = {**(raw.get("rope_scaling") or {}), **full}
  local = dict(params.get("sliding_attention") or {})
  local_type = local.get("rope_type", local.get("type", "default"))
  if local_type != "default":
    raise UnsupportedField(f"rope_parameters['sliding_attention'] rope_type {local_type!r} is "
                           "unsupported (default only)")
  theta = local.get("rope_theta", raw.get("rope_local_base_freq", _GEMMA3_DEFAULTS["local_theta"]))
  return dict(_rope({"rope_parameters": full}), local_rope_theta=float(theta))


def _window(raw: dict, model_type: str, n_layer: int) -> dict:
  window = raw.get("sliding_window")
  if model_type == "mistral":
    if raw.get("layer_types"):
      raise UnsupportedField("layer_types on a mistral config (alternating attention) is unsupported")
    return dict(sliding_window=int(window or 0))
  if model_type in ("qwen2", "qwen3"):
    if not raw.get("use_sliding_window") or not window:
      return dict(sliding_window=0)
    types = raw.get("layer_types") or [
        "sliding_attention" if i >= raw.get("max_window_layers", 28) else "full_attention"
        for i in range(n_layer)]
    if len(types) != n_layer or set(types) - {"sliding_attention", "full_attention"}:
      raise UnsupportedField(f"layer_types={types!r} is not one entry per layer of "
                             "full_attention / sliding_attention")
    return dict(sliding_window=int(window),
                window_layers=tuple(t == "sliding_attention" for t in types))
  if model_type == "gemma3_text":
    if raw.get("use_bidirectional_attention"):
      raise UnsupportedField("use_bidirectional_attention=true is unsupported (causal only)")
    pattern = int(raw.get("sliding_window_pattern") or _GEMMA3_DEFAULTS["pattern"])
    types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layer)]
    if len(types) != n_layer or set(types) - {"sliding_attention", "full_attention"}:
      raise UnsupportedField(f"layer_types={types!r} is not one entry per layer of "
                             "full_attention / sliding_attention")
    window = int(raw.get("sliding_window") or _GEMMA3_DEFAULTS["sliding_window"])
    return dict(sliding_window=window,
                window_layers=tuple(t == "sliding_attention" for t in types))
  if window:
    raise UnsupportedField(f"sliding_window={window} on a {model_type} config is unsupported")
  return {}


def config_from_hf(raw: dict) -> DecoderConfig:
  """A `config.json` dict of a supported family -> DecoderConfig. Raises UnsupportedField,
  or KeyError naming a missing required field."""
  model_type = raw.get("model_type")
  if model_type not in MODEL_TYPES:
    raise UnsupportedField(f"model_type {model_type!r} is not one of {MODEL_TYPES + ('gpt2',)}")
  for field in ("attn_logit_softcapping", "final_logit_softcapping"):
    if raw.get(field) is not None:
      raise UnsupportedField(f"{field}={raw[field]} (logit soft-capping) is unsupported")
  if raw.get("quantization_config"):
    raise UnsupportedField("quantization_config is unsupported (lla loads float weights; "
                           "dequantise first, or pass the GGUF file itself)")
  gemma3 = model_type == "gemma3_text"
  if not gemma3 and raw.get("query_pre_attn_scalar") not in (None, raw.get("head_dim")):
    raise UnsupportedField(f"query_pre_attn_scalar={raw['query_pre_attn_scalar']} is unsupported")
  d, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
  n_layer = int(raw["num_hidden_layers"])
  default_act = "gelu_pytorch_tanh" if gemma3 else "silu"
  act = raw.get("hidden_activation") or raw.get("hidden_act") or default_act
  if model_type in ("gemma", "gemma3_text") and act == "gelu":
    act = "gelu_pytorch_tanh"  # transformers' Gemma remaps "gelu" to the tanh form
  if act not in _ACTIVATIONS:
    raise UnsupportedField(f"hidden_act {act!r} is unsupported (silu or gelu_pytorch_tanh)")
  bias = bool(raw.get("attention_bias") or False)
  qkv_bias, o_bias = {"qwen2": (True, False), "mistral": (False, False)}.get(model_type, (bias, bias))
  family = FAMILY_OF[model_type]
  gemma = family in ("gemma", "gemma3")
  return DecoderConfig(
      family=family,
      vocab_size=int(raw["vocab_size"]),
      n_positions=int(raw.get("max_position_embeddings") or 2048),
      n_embd=d, n_layer=n_layer, n_head=heads,
      n_kv_head=int(raw.get("num_key_value_heads") or heads),
      head_dim=int(raw.get("head_dim") or d // heads),
      d_ff=int(raw["intermediate_size"]),
      norm="rmsnorm_1p" if gemma else "rmsnorm",
      norm_eps=float(raw.get("rms_norm_eps", _EPS_DEFAULT[family])),
      mlp=_ACTIVATIONS[act],
      qkv_bias=qkv_bias, o_bias=o_bias,
      mlp_bias=bool(raw.get("mlp_bias") or False) if model_type == "llama" else False,
      qk_norm=family in ("qwen3", "gemma3"),
      sandwich_norms=gemma3,
      query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar")
                                  or _GEMMA3_DEFAULTS["query_pre_attn_scalar"]) if gemma3 else 0.0,
      tie_embeddings=bool(raw.get("tie_word_embeddings", _TIED_DEFAULT[family])),
      embed_scale=float(d ** 0.5) if gemma else 1.0,
      **(_gemma3_rope(raw) if gemma3 else _rope(raw)), **_window(raw, model_type, n_layer))


def to_hf_config(cfg: DecoderConfig, bos_token_id: int | None = None,
                 eos_token_id: int | None = None) -> dict:
  """The `config.json` transformers 5 would write for `cfg` (`rope_parameters` spelling)."""
  rope: dict[str, Any] = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
  if cfg.rope_type in ("linear", "llama3"):
    rope["factor"] = cfg.rope_factor
  if cfg.rope_type == "llama3":
    rope.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
                original_max_position_embeddings=cfg.rope_original_max_positions)
  act = "silu" if cfg.mlp == "swiglu" else "gelu_pytorch_tanh"
  raw = {
      "architectures": [_ARCHITECTURES[cfg.family]], "model_type": MODEL_TYPE_OF[cfg.family],
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd,
      "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layer,
      "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head,
      "head_dim": cfg.head_dim, "hidden_act": act, "rms_norm_eps": cfg.norm_eps,
      "max_position_embeddings": cfg.n_positions, "rope_parameters": rope,
      "tie_word_embeddings": cfg.tie_embeddings, "attention_dropout": 0.0,
      "initializer_range": 0.02, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
  }
  if cfg.family == "llama":
    raw.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
  if cfg.family in ("qwen3", "gemma", "gemma3"):
    raw["attention_bias"] = cfg.qkv_bias
  if cfg.family in ("gemma", "gemma3"):
    raw["hidden_activation"] = act
  if cfg.family == "gemma3":
    layer_types = ["sliding_attention" if cfg.window(i) else "full_attention"
                   for i in range(cfg.n_layer)]
    local = {"rope_type": "default", "rope_theta": cfg.local_rope_theta or cfg.rope_theta}
    scalar = cfg.query_pre_attn_scalar or cfg.head_dim  # transformers' field is an int
    raw.update(query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
               sliding_window=cfg.sliding_window or None, layer_types=layer_types,
               rope_parameters={"full_attention": rope, "sliding_attention": local},
               final_logit_softcapping=None, attn_logit_softcapping=None,
               use_bidirectional_attention=False)
  if cfg.family == "mistral":
    raw["sliding_window"] = cfg.sliding_window or None
  if cfg.family in ("qwen2", "qwen3"):
    sliding = bool(cfg.sliding_window)
    raw.update(use_sliding_window=sliding, sliding_window=cfg.sliding_window or None,
               max_window_layers=cfg.n_layer)
    if sliding:
      raw["layer_types"] = ["sliding_attention" if cfg.window(i) else "full_attention"
                            for i in range(cfg.n_layer)]
  return raw


def check_supported(cfg: DecoderConfig) -> None:
  """Refuses a config that the family's HF class cannot express (e.g. untyped biases)."""
  if cfg.family == "qwen2" and not (cfg.qkv_bias and not cfg.o_bias):
    raise UnsupportedField("qwen2 has q/k/v biases and no o_proj bias")
  if cfg.family == "mistral" and (cfg.qkv_bias or cfg.o_bias):
    raise UnsupportedField("mistral has no attention biases")
  if cfg.qkv_bias != cfg.o_bias and cfg.family in ("llama", "qwen3", "gemma", "gemma3"):
    raise UnsupportedField(f"{cfg.family}: attention_bias sets q/k/v and o_proj biases together")
  gemma3 = cfg.family == "gemma3"
  if gemma3 and not (cfg.qk_norm and cfg.sandwich_norms and cfg.norm == "rmsnorm_1p"):
    raise UnsupportedField("gemma3 has q/k-norm and sandwich norms, all of the (1 + w) kind")
  if not gemma3 and (cfg.sandwich_norms or cfg.query_pre_attn_scalar or cfg.local_rope_theta):
    raise UnsupportedField(f"{cfg.family}: sandwich_norms, query_pre_attn_scalar and "
                           "local_rope_theta are Gemma-3's (its HF class alone expresses them)")


# --- tensor names ------------------------------------------------------------------------


def flax_to_hf(path: tuple[str, ...]) -> tuple[str, bool]:
  """('layers_3', 'self_attn', 'q_proj', 'kernel') -> ('model.layers.3.self_attn.q_proj.weight',
  transpose=True)."""
  if path == ("lm_head",):
    return "lm_head.weight", False
  if path == ("embed_tokens", "embedding"):
    return "model.embed_tokens.weight", False
  *module, leaf = path
  if module[0].startswith("layers_"):
    module = ["layers", module[0].removeprefix("layers_"), *module[1:]]
  name = "model." + ".".join(module) + "." + {"kernel": "weight", "scale": "weight",
                                              "bias": "bias"}[leaf]
  return name, leaf == "kernel"


def expected_tensors(cfg: DecoderConfig) -> dict[str, tuple[tuple[str, ...], tuple[int, ...], bool]]:
  """HF name -> (Flax path, HF shape, transpose) of every parameter of `cfg`."""
  shapes = jax.eval_shape(lambda key: init_params(cfg, key), jax.random.key(0))
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
    flax_path = tuple(p.key for p in path)
    name, transpose = flax_to_hf(flax_path)
    shape = tuple(leaf.shape[::-1]) if transpose else tuple(leaf.shape)
    out[name] = (flax_path, shape, transpose)
  return out


def params_from_tensors(tensors: dict[str, np.ndarray], cfg: DecoderConfig,
                        where: str) -> dict:
  """HF-named tensors -> Flax params (float32). Raises ValueError naming the problem."""
  tensors = dict(tensors)
  for name in list(tensors):
    if name.endswith("rotary_emb.inv_freq"):  # a buffer some 4.x versions saved
      del tensors[name]
  if cfg.tie_embeddings:
    tensors.pop("lm_head.weight", None)
  expected = expected_tensors(cfg)
  missing = sorted(set(expected) - set(tensors))
  if missing:
    raise ValueError(f"{where}: tensors missing for config.json (n_layer={cfg.n_layer}, "
                     f"tie_word_embeddings={cfg.tie_embeddings}): {', '.join(missing[:5])}"
                     + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
  unexpected = sorted(set(tensors) - set(expected))
  if unexpected:
    raise ValueError(f"{where}: tensors not in a {cfg.family} of this config.json: "
                     f"{', '.join(unexpected[:5])}")
  params: dict = {}
  for name, (path, shape, transpose) in expected.items():
    value = np.asarray(tensors[name])
    if tuple(value.shape) != shape:
      raise ValueError(f"{where}: {name} has shape {tuple(value.shape)}, config.json implies {shape}")
    value = value.astype(np.float32)
    node = params
    for p in path[:-1]:
      node = node.setdefault(p, {})
    node[path[-1]] = jax.numpy.asarray(value.T if transpose else value)
  return params


def tensors_from_params(params, cfg: DecoderConfig) -> dict[str, np.ndarray]:
  """Flax params -> HF-named float32 tensors (what `save_pretrained` writes)."""
  out = {}
  for name, (path, _, transpose) in expected_tensors(cfg).items():
    node = params
    for p in path:
      node = node[p]
    value = np.asarray(node, dtype=np.float32)
    out[name] = np.ascontiguousarray(value.T if transpose else value)
  return out

