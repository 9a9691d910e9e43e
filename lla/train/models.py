"""From a model config (configs/models.py) to its architecture and pre-trained weights."""

from __future__ import annotations

import pathlib

import ml_collections

from lla.model import hf_io
from lla.model.decoder import DecoderConfig
from lla.model.gpt2 import GPT2Config
from lla.model import checkpoint as ckpt


class MissingWeightsError(ValueError):
  """A published model whose weights no file names (lla does not pre-train it)."""


def check_weights(model: ml_collections.ConfigDict) -> None:
  """Raises MissingWeightsError (one line) for a model that needs published weights
  (`weights_required`, e.g. configs/models.py:qwen3_0_6b) when none is named."""
  if model.get("weights_required") and not any(
      model.get(k) for k in ("hf_dir", "gguf", "gguf_package", "checkpoint", "hub")):
    raise MissingWeightsError(f"model {model.name!r} is read from its published weights, which "
                              "lla does not pre-train: pass --config.model.hf_dir=DIR (a "
                              "save_pretrained directory with its tokenizer.json)")


def architecture(model: ml_collections.ConfigDict) -> GPT2Config | DecoderConfig:
  """The model's `GPT2Config` (a config without `family`), or for a RoPE family its
  `DecoderConfig` (no biases, RMSNorm, SwiGLU, default RoPE, head_dim = d / H): the model
  lla pre-trains. A published model (`weights_required`) has its checkpoint's instead."""
  check_weights(model)
  if model.get("weights_required"):
    raise ValueError(f"model {model.name!r}: its architecture is its checkpoint's config.json "
                     "(lla.model.loading.load_model), not one lla builds")
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


def is_gguf(model: ml_collections.ConfigDict) -> bool:
  """Whether the model's weights come from a GGUF file (`gguf` or `gguf_package`)."""
  return bool(model.get("gguf") or model.get("gguf_package"))


def gguf_path(model: ml_collections.ConfigDict) -> str:
  """The GGUF file a model config names (`gguf`, else the one inside `gguf_package`), or ""."""
  if not is_gguf(model):
    return ""
  if model.get("gguf"):
    return model.gguf
  from lla.model import gguf_io  # the optional `gguf` package, imported only when used
  return gguf_io.packaged_file(model.gguf_package)


def load_base(model: ml_collections.ConfigDict) -> tuple[dict, GPT2Config | DecoderConfig, dict]:
  """Pre-trained weights: (params, cfg, provenance {"source", "params_sha256"}).

  Sources in order: a GGUF file (`model.gguf` or `model.gguf_package`; its architecture is
  the file's own, dequantised to float32, provenance also records `lla.model.loading`'s
  info), `model.checkpoint` (lla, hash-verified), `model.hf_dir` (a `save_pretrained`
  directory, whose config.json is its architecture, as a GGUF's metadata is: a user's
  Llama, Mistral or Qwen3 needs no matching model config), `model.hub`.
  Raises ValueError if a checkpoint's or hub model's architecture is not the configured one
  (a wrong path).
  """
  path = gguf_path(model)
  # Published files carry their own architecture (a checkpoint of lla's, named too, wins
  # over a directory).
  published = ({"gguf": path} if path else
               {"hf_dir": model.hf_dir} if model.hf_dir and not model.checkpoint else None)
  if published:
    from lla.model.loading import load_model  # pylint: disable=g-import-not-at-top
    loaded = load_model(ml_collections.ConfigDict(published))
    return loaded.params, loaded.cfg, {"source": loaded.source, "params_sha256": loaded.model_id,
                                       "model": loaded.info}
  if model.checkpoint:
    restored = ckpt.restore(model.checkpoint)
    params, cfg, source = restored.params, restored.cfg, f"lla:{restored.path}"
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
  """A model whose tokenizer policy is inconsistent (one line naming it)."""


def tokenizer(model: ml_collections.ConfigDict):
  """The model's own tokenizer (`lla.data.Tokenizer`) when it brings one (a GGUF file's, or
  the `tokenizer.json` of an `hf_dir`), else None: the data directory's GPT-2 tokenizer,
  which the models pre-trained here use.

  A tokenizer that prepends BOS carries it (`Tokenizer.bos_id`): the passages then start with
  it, and position 0 is public and never scored (docs/models.md, "BOS").

  Raises:
    TokenizerPolicyError: the file asks for a BOS but names no BOS token, or its
      post-processor adds more than one leading BOS.
  """
  from lla.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  path = gguf_path(model)
  if not path:
    own = pathlib.Path(model.get("hf_dir") or "") / "tokenizer.json"
    if not model.get("hf_dir") or not own.is_file():
      return None
    try:
      return tokenizer_lib.from_file(own)
    except ValueError as e:
      raise TokenizerPolicyError(str(e)) from None
  from lla.model import gguf_io  # pylint: disable=g-import-not-at-top
  backend, bos = gguf_io.gguf_tokenizer(path)
  bos_id = None
  if bos["add_bos_token"]:
    bos_id = bos["bos_token_id"]
    if bos_id is None or not 0 <= int(bos_id) < backend.get_vocab_size(with_added_tokens=True):
      raise TokenizerPolicyError(f"{path}: its tokenizer prepends BOS but names no BOS token in "
                                 f"its vocabulary (tokenizer.ggml.bos_token_id = {bos_id})")
    bos_id = int(bos_id)
  return tokenizer_lib.wrap(backend, f"{path} (GGUF)", bos_id)
