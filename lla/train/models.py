"""From a model config (configs/models.py) to its architecture and pre-trained weights."""

from __future__ import annotations

import ml_collections

from lla.model import hf_io
from lla.model.decoder import DecoderConfig
from lla.model.gpt2 import GPT2Config
from lla.model import checkpoint as ckpt


def architecture(model: ml_collections.ConfigDict) -> GPT2Config | DecoderConfig:
  """The model's `GPT2Config` (a config without `family`), or for a RoPE family its
  `DecoderConfig` (no biases, RMSNorm, SwiGLU, default RoPE, head_dim = d / H)."""
  if model.get("family", "gpt2") == "gpt2":
    return GPT2Config(vocab_size=model.vocab_size, n_positions=model.n_positions,
                      n_embd=model.n_embd, n_layer=model.n_layer, n_head=model.n_head,
                      layer_norm_epsilon=model.layer_norm_epsilon, dtype=model.dtype)
  if model.n_embd % model.n_head:
    raise ValueError(f"n_embd={model.n_embd} is not divisible by n_head={model.n_head}")
  return DecoderConfig(family=model.family, vocab_size=model.vocab_size,
                       n_positions=model.n_positions, n_embd=model.n_embd,
                       n_layer=model.n_layer, n_head=model.n_head, n_kv_head=model.n_kv_head,
                       head_dim=model.n_embd // model.n_head, d_ff=model.d_ff,
                       norm_eps=model.layer_norm_epsilon, rope_theta=model.rope_theta,
                       tie_embeddings=model.tie_embeddings, dtype=model.dtype)


def load_base(model: ml_collections.ConfigDict) -> tuple[dict, GPT2Config | DecoderConfig, dict]:
  """Pre-trained weights: (params, cfg, provenance {"source", "params_sha256"}).

  Sources in order: `model.checkpoint` (lla, hash-verified), `model.hf_dir`, `model.hub`.
  Raises ValueError if the loaded architecture is not the configured one (a wrong path).
  """
  if model.get("gguf") or model.get("gguf_package"):
    raise ValueError(f"model {model.name!r} is a GGUF model: the main job pre-trains and "
                     "fine-tunes its own models (GPT-2 and its Llama twin); run it through "
                     "experiments/real_weights.py or the capture and replay binaries")
  if model.checkpoint:
    restored = ckpt.restore(model.checkpoint)
    params, cfg, source = restored.params, restored.cfg, f"lla:{restored.path}"
  elif model.hf_dir:
    params, cfg = hf_io.load_hf_dir(model.hf_dir)
    source = f"hf:{model.hf_dir}"
  elif model.hub:
    params, cfg = hf_io.load_from_hub(model.hub)
    source = f"hub:{model.hub}"
  else:
    raise ValueError(f"model {model.name!r} names no checkpoint, hf_dir or hub to load from")
  expected = architecture(model)
  if cfg.replace(dtype=expected.dtype) != expected:
    raise ValueError(f"{source}: architecture {cfg} differs from model config {model.name!r} ({expected})")
  return params, expected, {"source": source, "params_sha256": ckpt.params_sha256(params)}
