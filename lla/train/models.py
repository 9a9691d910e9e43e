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


def gguf_path(model: ml_collections.ConfigDict) -> str:
  """The GGUF file a model config names (`gguf`, else the one inside `gguf_package`), or ""."""
  if model.get("gguf"):
    return model.gguf
  if model.get("gguf_package"):
    from lla.model import gguf_io  # the optional `gguf` package, imported only when used
    return gguf_io.packaged_file(model.gguf_package)
  return ""


def load_base(model: ml_collections.ConfigDict) -> tuple[dict, GPT2Config | DecoderConfig, dict]:
  """Pre-trained weights: (params, cfg, provenance {"source", "params_sha256"}).

  Sources in order: a GGUF file (`model.gguf` or `model.gguf_package`; its architecture is
  the file's own, dequantised to float32, provenance also records `lla.model.loading`'s
  info), `model.checkpoint` (lla, hash-verified), `model.hf_dir`, `model.hub`.
  Raises ValueError if a non-GGUF architecture is not the configured one (a wrong path).
  """
  path = gguf_path(model)
  if path:
    from lla.model.loading import load_model  # pylint: disable=g-import-not-at-top
    loaded = load_model(ml_collections.ConfigDict({"gguf": path}))
    return loaded.params, loaded.cfg, {"source": loaded.source, "params_sha256": loaded.model_id,
                                       "model": loaded.info}
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


class TokenizerPolicyError(ValueError):
  """A model whose tokenizer policy the job does not implement (one line naming it)."""


def tokenizer(model: ml_collections.ConfigDict):
  """The model's own tokenizer (`lla.data.Tokenizer`) when it brings one (a GGUF file's), else
  None: the data directory's GPT-2 tokenizer, which every other model here uses.

  Raises:
    TokenizerPolicyError: the tokenizer prepends BOS. Position 0 would then be known to the
      attacker and must be excluded from scoring (issue 20's BOS policy), which the job does
      not implement yet; scoring it as a recovered token would inflate every figure.
  """
  path = gguf_path(model)
  if not path:
    return None
  from lla.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  from lla.model import gguf_io  # pylint: disable=g-import-not-at-top
  backend, bos = gguf_io.gguf_tokenizer(path)
  if bos["add_bos_token"]:
    raise TokenizerPolicyError(f"{path}: its tokenizer prepends BOS (id {bos['bos_token_id']}); "
                               "the job scores every position and supports no BOS yet")
  return tokenizer_lib.wrap(backend, f"{path} (GGUF)")
