"""From a model config (configs/models.py) to a GPT2Config and its pre-trained weights."""

from __future__ import annotations

import ml_collections

from lla.model import hf_io
from lla.model.gpt2 import GPT2Config
from lla.model import checkpoint as ckpt


def gpt2_config(model: ml_collections.ConfigDict) -> GPT2Config:
  return GPT2Config(vocab_size=model.vocab_size, n_positions=model.n_positions,
                    n_embd=model.n_embd, n_layer=model.n_layer, n_head=model.n_head,
                    layer_norm_epsilon=model.layer_norm_epsilon, dtype=model.dtype)


def load_base(model: ml_collections.ConfigDict) -> tuple[dict, GPT2Config, dict]:
  """Pre-trained weights: (params, cfg, provenance {"source", "params_sha256"}).

  Sources in order: `model.checkpoint` (lla, hash-verified), `model.hf_dir`, `model.hub`.
  Raises ValueError if the loaded architecture is not the configured one (a wrong path).
  """
  if model.get("gguf") or model.get("gguf_package"):
    raise ValueError(f"model {model.name!r} is a GGUF model: the main job pre-trains and "
                     "fine-tunes GPT-2 only; run it through experiments/real_weights.py or the "
                     "capture and replay binaries")
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
  expected = gpt2_config(model)
  if cfg.replace(dtype=expected.dtype) != expected:
    raise ValueError(f"{source}: architecture {cfg} differs from model config {model.name!r} ({expected})")
  return params, expected, {"source": source, "params_sha256": ckpt.params_sha256(params)}
