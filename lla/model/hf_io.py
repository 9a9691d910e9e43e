"""Hugging Face `save_pretrained` directories <-> lla parameters.

Reads `config.json` plus `model.safetensors` (or sharded safetensors with
`model.safetensors.index.json`); writes a directory that transformers' `from_pretrained`
loads with identical logits. Pickled `pytorch_model.bin` checkpoints are refused, never
unpickled. `model_type` "gpt2" loads into `GPT2Config` / `lla.model.gpt2` (unchanged); llama,
mistral, qwen2, qwen3 and gemma load into `DecoderConfig` / `lla.model.decoder`
(`lla.model.families` reads their config.json in either rope spelling and names the tensors).
"""

from __future__ import annotations

import json
import os
import pathlib

import jax
import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from lla.model import families
from lla.model.decoder import DecoderConfig
from lla.model.gpt2 import GPT2Config

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# A model's own tokenizer and its BOS policy (lla.data.tokenizer.from_pretrained_dir).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# HF buffers and tied copies that carry no parameters of their own.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


class CheckpointError(ValueError):
  """A checkpoint that cannot be loaded; the message names the file and the problem."""


def _read_config(path: pathlib.Path) -> dict:
  try:
    return json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def _config_from_hf(path: pathlib.Path, raw: dict | None = None) -> GPT2Config | DecoderConfig:
  raw = _read_config(path) if raw is None else raw
  model_type = raw.get("model_type", "gpt2")
  if model_type in families.MODEL_TYPES:
    try:
      return families.config_from_hf(raw)
    except families.UnsupportedField as e:
      raise CheckpointError(f"{path}: {e}") from None
    except KeyError as e:
      raise CheckpointError(f"{path}: missing field {e.args[0]!r}") from None
  if model_type != "gpt2":
    raise CheckpointError(f"{path}: model_type is {raw.get('model_type')!r}, lla loads 'gpt2' "
                          f"and {', '.join(repr(m) for m in families.MODEL_TYPES)}")
  activation = raw.get("activation_function", "gelu_new")
  if activation != "gelu_new":
    raise CheckpointError(f"{path}: activation_function {activation!r} is unsupported (gelu_new only)")
  if not raw.get("scale_attn_weights", True):
    raise CheckpointError(f"{path}: scale_attn_weights=false is unsupported (lla scales by 1/sqrt(D))")
  if raw.get("scale_attn_by_inverse_layer_idx", False):
    raise CheckpointError(f"{path}: scale_attn_by_inverse_layer_idx=true is unsupported")
  if not raw.get("tie_word_embeddings", True):
    raise CheckpointError(f"{path}: untied word embeddings are unsupported (GPT-2 ties the head to wte)")
  if raw.get("n_inner") not in (None, 4 * raw.get("n_embd", 768)):
    raise CheckpointError(f"{path}: n_inner={raw['n_inner']} is unsupported (4 * n_embd only)")
  try:
    return GPT2Config(
        vocab_size=int(raw["vocab_size"]), n_positions=int(raw["n_positions"]),
        n_embd=int(raw["n_embd"]), n_layer=int(raw["n_layer"]), n_head=int(raw["n_head"]),
        layer_norm_epsilon=float(raw.get("layer_norm_epsilon", 1e-5)))
  except KeyError as e:
    raise CheckpointError(f"{path}: missing field {e.args[0]!r}") from None


def _weight_files(directory: pathlib.Path) -> list[pathlib.Path]:
  single, index = directory / WEIGHTS_FILE, directory / INDEX_FILE
  if single.exists():
    return [single]
  if index.exists():
    try:
      shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (json.JSONDecodeError, KeyError) as e:
      raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
    files = [directory / s for s in shards]
    for f in files:
      if not f.exists():
        raise CheckpointError(f"{f}: shard listed in {index.name} is missing")
    return files
  if any((directory / n).exists() for n in ("pytorch_model.bin", "pytorch_model.bin.index.json")):
    raise CheckpointError(
        f"{directory}: has only pytorch_model.bin, a pickle that lla will not load; convert it "
        "with transformers: GPT2LMHeadModel.from_pretrained(DIR).save_pretrained(OUT, "
        "safe_serialization=True)")
  raise CheckpointError(f"{directory}: no {WEIGHTS_FILE} or {INDEX_FILE}")


def _load_safetensors(f: pathlib.Path) -> dict[str, np.ndarray]:
  """numpy arrays of a safetensors file; bfloat16 tensors (numpy has no such dtype, and most
  released Llama / Qwen / Gemma checkpoints are bf16) are read through JAX and widened to
  float32, which is exact."""
  try:
    return load_file(str(f))
  except TypeError:
    from safetensors.flax import load_file as load_jax
    return {name: np.asarray(value.astype(jax.numpy.float32)) if value.dtype == jax.numpy.bfloat16
            else np.asarray(value) for name, value in load_jax(str(f)).items()}


def _read_tensors(files: list[pathlib.Path]) -> dict[str, np.ndarray]:
  tensors = {}
  for f in files:
    try:
      loaded = _load_safetensors(f)
    except (SafetensorError, OSError, ValueError) as e:
      raise CheckpointError(f"{f}: unreadable safetensors file, truncated or corrupt ({e})") from None
    for name, value in loaded.items():
      name = name.removeprefix("transformer.")
      if not name.endswith(_IGNORED_SUFFIXES):
        tensors[name] = value
  return tensors


def _expected_shapes(cfg: GPT2Config) -> dict[str, tuple[int, ...]]:
  d = cfg.n_embd
  shapes = {"wte.weight": (cfg.vocab_size, d), "wpe.weight": (cfg.n_positions, d),
            "ln_f.weight": (d,), "ln_f.bias": (d,)}
  for i in range(cfg.n_layer):
    p = f"h.{i}."
    shapes.update({
        p + "ln_1.weight": (d,), p + "ln_1.bias": (d,),
        p + "attn.c_attn.weight": (d, 3 * d), p + "attn.c_attn.bias": (3 * d,),
        p + "attn.c_proj.weight": (d, d), p + "attn.c_proj.bias": (d,),
        p + "ln_2.weight": (d,), p + "ln_2.bias": (d,),
        p + "mlp.c_fc.weight": (d, 4 * d), p + "mlp.c_fc.bias": (4 * d,),
        p + "mlp.c_proj.weight": (4 * d, d), p + "mlp.c_proj.bias": (d,),
    })
  return shapes


def _hf_to_flax_path(name: str) -> tuple[str, ...]:
  """'h.3.attn.c_attn.weight' -> ('h_3', 'attn', 'c_attn', 'kernel')."""
  parts = name.split(".")
  if parts[0] == "h":
    parts = [f"h_{parts[1]}"] + parts[2:]
  module, leaf = parts[:-1], parts[-1]
  if module[-1] in ("wte", "wpe"):
    return (*module, "embedding")
  if module[-1].startswith("ln"):
    return (*module, {"weight": "scale", "bias": "bias"}[leaf])
  return (*module, {"weight": "kernel", "bias": "bias"}[leaf])


def load_hf_dir(directory: str | os.PathLike) -> tuple[dict, GPT2Config]:
  """Loads a `save_pretrained` GPT-2 directory -> (params, cfg). Raises CheckpointError."""
  directory = pathlib.Path(directory)
  if not directory.is_dir():
    raise CheckpointError(f"{directory}: checkpoint directory does not exist")
  config_path = directory / CONFIG_FILE
  if not config_path.exists():
    raise CheckpointError(f"{config_path}: missing (a save_pretrained directory needs config.json)")
  cfg = _config_from_hf(config_path)
  files = _weight_files(directory)
  tensors = _read_tensors(files)
  where = files[0].name if len(files) == 1 else f"{INDEX_FILE} shards"
  if isinstance(cfg, DecoderConfig):
    try:
      return families.params_from_tensors(tensors, cfg, str(directory / where)), cfg
    except ValueError as e:
      raise CheckpointError(str(e)) from None
  head = tensors.pop("lm_head.weight", None)
  expected = _expected_shapes(cfg)
  missing = sorted(set(expected) - set(tensors))
  if missing:
    raise CheckpointError(f"{directory / where}: tensors missing for config.json "
                          f"(n_layer={cfg.n_layer}): {', '.join(missing[:5])}"
                          + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
  unexpected = sorted(set(tensors) - set(expected))
  if unexpected:
    raise CheckpointError(f"{directory / where}: tensors not in a GPT-2 of this config.json: "
                          f"{', '.join(unexpected[:5])}")
  for name, shape in expected.items():
    if tuple(tensors[name].shape) != shape:
      raise CheckpointError(f"{directory / where}: {name} has shape {tuple(tensors[name].shape)}, "
                            f"config.json implies {shape}")
  if head is not None and not np.array_equal(head, tensors["wte.weight"]):
    raise CheckpointError(f"{directory / where}: lm_head.weight differs from wte (untied head unsupported)")
  params: dict = {}
  for name, value in tensors.items():
    node = params
    *parents, leaf = _hf_to_flax_path(name)
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = jax.numpy.asarray(value, dtype=jax.numpy.float32)
  return params, cfg


def save_hf_dir(params, cfg: GPT2Config, directory: str | os.PathLike) -> pathlib.Path:
  """Writes params as a `save_pretrained` directory (config.json + model.safetensors)."""
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  if isinstance(cfg, DecoderConfig):
    return _save_decoder_dir(params, cfg, directory)
  tensors = {}
  for name in _expected_shapes(cfg):
    node = params
    for p in _hf_to_flax_path(name):
      node = node[p]
    tensors["transformer." + name] = np.ascontiguousarray(np.asarray(node, dtype=np.float32))
  config = {
      "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
      "vocab_size": cfg.vocab_size, "n_positions": cfg.n_positions, "n_ctx": cfg.n_positions,
      "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": None,
      "activation_function": "gelu_new", "layer_norm_epsilon": cfg.layer_norm_epsilon,
      "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": 0.02,
      "scale_attn_weights": True, "tie_word_embeddings": True,
      # GPT-2's <|endoftext|> is its last token (50256); a small test vocabulary has no 50256.
      "bos_token_id": cfg.vocab_size - 1, "eos_token_id": cfg.vocab_size - 1,
  }
  tmp = directory / (WEIGHTS_FILE + ".tmp")
  save_file(tensors, str(tmp), metadata={"format": "pt"})
  os.replace(tmp, directory / WEIGHTS_FILE)
  (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
  return directory


def _save_decoder_dir(params, cfg: DecoderConfig, directory: pathlib.Path,
                     bos_token_id: int | None = None,
                     eos_token_id: int | None = None) -> pathlib.Path:
  families.check_supported(cfg)
  tensors = families.tensors_from_params(params, cfg)
  config = families.to_hf_config(cfg, bos_token_id, eos_token_id)
  tmp = directory / (WEIGHTS_FILE + ".tmp")
  save_file(tensors, str(tmp), metadata={"format": "pt"})
  os.replace(tmp, directory / WEIGHTS_FILE)
  (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
  return directory


def load_from_hub(name: str) -> tuple[dict, GPT2Config | DecoderConfig, str]:
  """Downloads `name` (e.g. 'gpt2') from the Hugging Face hub, then loads it:
  (params, cfg, the local snapshot directory). The snapshot holds the weights, config.json
  and the model's own tokenizer files where the repository has them, so the hub model is
  cut with its own tokenizer as a save_pretrained directory is."""
  try:
    from huggingface_hub import snapshot_download
    local = snapshot_download(name, allow_patterns=[CONFIG_FILE, "*.safetensors", INDEX_FILE,
                                                     *TOKENIZER_FILES],
                              etag_timeout=10)
  except Exception as e:  # The hub client raises many types for "offline"; all mean the same.
    raise CheckpointError(
        f"hub model {name!r}: could not be fetched from the Hugging Face hub ({type(e).__name__}); "
        "this machine may have no hub access. Download it where there is one "
        "(GPT2LMHeadModel.from_pretrained(name).save_pretrained(DIR)) and pass "
        "--config.model.hf_dir=DIR") from None
  params, cfg = load_hf_dir(local)
  return params, cfg, local
