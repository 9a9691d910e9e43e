"""The one loader: a model config (configs/models.py) -> `LoadedModel` (params, cfg,
tokenizer, model_id, source, info). Capture, replay, the main job, fine-tuning, the active
tier, the decoy split, real_weights and the sweep worker all load through `load_model`.

Sources, first non-empty wins (`SOURCES`): `gguf` (a GGUF file), `gguf_package` (an installed
package holding one), `hf_dir` (a `save_pretrained` directory), `checkpoint` (an lla
checkpoint), `hub` (a Hugging Face hub name). A GGUF file and a directory carry their own
architecture; an lla checkpoint or a hub model named by a full model config is refused when
its architecture is not the configured one (`check_architecture`: a wrong path).

The tokenizer is the model's own: a GGUF file's; a directory's `tokenizer.json` with the BOS
policy of its `tokenizer_config.json`, and a hub model's likewise (its snapshot holds both
files where the repository has them); the one an lla checkpoint records (fine-tuned from a
model that brought one). A model lla pre-trains or fine-tunes from GPT-2's records GPT-2's
(lla.model.checkpoint.GPT2_TOKENS), and a GPT-2 directory, or an lla checkpoint of GPT-2's
vocabulary (GPT2_VOCAB_SIZE) that records no tokenizer, has GPT-2's: they are cut by the
data directory's GPT-2 tokenizer (`tokenizer` None, `tokenizer_kind` "gpt2"). Any other
model without one cannot cut text (`text_tokenizer` refuses in one line, naming the token
files that do instead).

The model id (`model_id`) is the identity of the function, docs/run_format.md "Model id":
the params' sha256 combined with `architecture_sha256` (every decoder config field but the
compute dtype, and the tokenizer), which is "" for the GPT-2 presets with GPT-2's tokenizer
so that their ids stay the params' sha256.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
from typing import Any

import ml_collections

from lla.data import tokenizer as tokenizer_lib
from lla.model import checkpoint, hf_io
from lla.model.decoder import DecoderConfig
from lla.model.gpt2 import GPT2Config

SOURCES = ("gguf", "gguf_package", "hf_dir", "checkpoint", "hub")
SOURCE_NAMES = ", ".join(SOURCES[:-1]) + " or " + SOURCES[-1]  # for messages
# Fields of a model config that say what the model is (configs/models.py ARCHITECTURE).
_ARCHITECTURE_FIELDS = ("vocab_size", "n_layer", "n_embd", "n_head", "n_positions")
# The compute dtype of the matmuls is chosen per run (PROTOCOL.md section 4 pins float32 and
# lla.runtime records the precision in every record's provenance); the same weights under
# another dtype are the same model, so it is no part of the identity.
_NOT_IDENTITY = ("dtype",)
# GPT-2's presets (configs/models.py embedded, tiny, gpt2_124m) with GPT-2's tokenizer: their
# architecture hash is "" (their model ids are the params' sha256, as before identities
# covered the architecture). Their shapes differ, so the params' hash still names the config.
_EMPTY_HASH = (
    GPT2Config(vocab_size=50257, n_positions=128, n_embd=128, n_layer=8, n_head=4),
    GPT2Config(vocab_size=50257, n_positions=64, n_embd=32, n_layer=4, n_head=2),
    GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12),
)
GPT2_TOKENIZER = "gpt2"  # tokenizer_kind: the data directory's GPT-2 tokenizer
GPT2_VOCAB_SIZE = 50257  # GPT-2's tokenizer's vocabulary
OWN_TOKENIZER = "own"    # the model's own (`LoadedModel.tokenizer`)
NO_TOKENIZER = "none"    # none: only token files can feed it


class ModelLoadError(ValueError):
  """A model that cannot be loaded or used as named: one line naming it."""


class MissingWeightsError(ModelLoadError):
  """A published model whose weights no file names (lla does not pre-train it)."""


class TokenizerPolicyError(ModelLoadError):
  """A tokenizer whose BOS policy is inconsistent, or a model without a tokenizer asked to
  cut text."""


@dataclasses.dataclass(frozen=True)
class LoadedModel:
  params: dict
  cfg: GPT2Config | DecoderConfig
  # The model's own tokenizer; None: the data directory's GPT-2 tokenizer ("gpt2") or none.
  tokenizer: tokenizer_lib.Tokenizer | None
  model_id: str      # identity of the function in E (`model_id`)
  source: str
  # {"family", "format" (gguf | hf-safetensors | lla-checkpoint), "dequantisation",
  #  "params_sha256", "architecture_sha256", "tokenizer" (tokenizer_identity), ...}
  info: dict[str, Any] = dataclasses.field(default_factory=dict)
  tokenizer_kind: str = GPT2_TOKENIZER

  @property
  def params_sha256(self) -> str:
    return self.info["params_sha256"]

  @property
  def recorded_tokenizer(self) -> tokenizer_lib.Tokenizer | str | None:
    """What a checkpoint trained from this model records as its tokenizer
    (lla.model.checkpoint.save): its own, GPT-2's, or none."""
    if self.tokenizer is not None:
      return self.tokenizer
    return checkpoint.GPT2_TOKENS if self.tokenizer_kind == GPT2_TOKENIZER else None

  def text_tokenizer(self, token_files: str) -> tokenizer_lib.Tokenizer | None:
    """The tokenizer that cuts text for this model (None: the data directory's GPT-2).

    Raises:
      TokenizerPolicyError: the model has no tokenizer; `token_files` names the flags that
        give its documents as token ids instead.
    """
    if self.tokenizer_kind == NO_TOKENIZER and self.info.get("format") == "lla-checkpoint":
      raise TokenizerPolicyError(
          f"{self.source}: an lla checkpoint with a vocabulary of {self.cfg.vocab_size} (not "
          f"GPT-2's {GPT2_VOCAB_SIZE}) that records no tokenizer: lla does not cut its text "
          "with GPT-2's; fine-tune it again from its base (which records the base's "
          f"tokenizer), or give its documents as {token_files}")
    if self.tokenizer_kind == NO_TOKENIZER:
      raise TokenizerPolicyError(
          f"{self.source}: a {self.cfg.family} model without its tokenizer (no "
          "tokenizer.json): lla does not cut its text with GPT-2's; add the model's "
          f"tokenizer.json (and tokenizer_config.json), or give its documents as {token_files}")
    return self.tokenizer


def tokenizer_identity(kind: str, tokenizer: tokenizer_lib.Tokenizer | None) -> dict:
  """What of the tokenizer enters the model id: its definition's hash and its BOS."""
  if kind != OWN_TOKENIZER:
    return {"kind": kind}
  return {"kind": kind, "sha256": tokenizer.sha256, "bos_id": tokenizer.bos_id}


def architecture_sha256(cfg: GPT2Config | DecoderConfig, tokenizer: dict) -> str:
  """sha256 of the canonical JSON {"config_class", "config" (every field but the dtype),
  "tokenizer" (`tokenizer_identity`)}; "" for a GPT-2 preset with GPT-2's tokenizer."""
  if (isinstance(cfg, GPT2Config) and tokenizer == {"kind": GPT2_TOKENIZER}
      and dataclasses.replace(cfg, dtype="float32") in _EMPTY_HASH):
    return ""
  fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _NOT_IDENTITY}
  text = json.dumps({"config_class": type(cfg).__name__, "config": fields,
                     "tokenizer": tokenizer}, sort_keys=True, separators=(",", ":"))
  return hashlib.sha256(text.encode("utf-8")).hexdigest()


def model_id(params_sha256: str, architecture_hash: str) -> str:
  """The params' sha256 where the architecture hash is "", else sha256 of
  "lla-model-id.v1:<params sha256>:<architecture sha256>"."""
  if not architecture_hash:
    return params_sha256
  text = f"lla-model-id.v1:{params_sha256}:{architecture_hash}"
  return hashlib.sha256(text.encode("ascii")).hexdigest()


def identify(params_sha256: str, cfg, tokenizer: tokenizer_lib.Tokenizer | None,
             kind: str = GPT2_TOKENIZER) -> tuple[str, dict]:
  """(model id, its parts for `LoadedModel.info`) of a model whose params hash to
  `params_sha256`: e.g. a fine-tuned copy, which keeps its base's config and tokenizer."""
  if tokenizer is not None:
    kind = OWN_TOKENIZER
  identity = tokenizer_identity(kind, tokenizer)
  arch = architecture_sha256(cfg, identity)
  return model_id(params_sha256, arch), {"params_sha256": params_sha256,
                                         "architecture_sha256": arch, "tokenizer": identity}


def check_weights(model: ml_collections.ConfigDict) -> None:
  """Raises MissingWeightsError (one line) for a model that needs published weights
  (`weights_required`, e.g. configs/models.py:qwen3_0_6b) when none is named."""
  if model.get("weights_required") and not any(model.get(k) for k in SOURCES):
    raise MissingWeightsError(f"model {model.name!r} is read from its published weights, which "
                              "lla does not pre-train: pass --config.model.hf_dir=DIR (a "
                              "save_pretrained directory with its tokenizer.json)")


def architecture(model: ml_collections.ConfigDict) -> GPT2Config | DecoderConfig:
  """The model config's `GPT2Config` (a config without `family`), or for a RoPE family its
  `DecoderConfig` (no biases, RMSNorm, SwiGLU, default RoPE, head_dim = d / H): the model
  lla pre-trains. A published model (`weights_required`) has its checkpoint's instead."""
  check_weights(model)
  if model.get("weights_required"):
    raise ModelLoadError(f"model {model.name!r}: its architecture is its checkpoint's "
                         "config.json (lla.model.loading.load_model), not one lla builds")
  if model.get("family", "gpt2") == "gpt2":
    return GPT2Config(vocab_size=model.vocab_size, n_positions=model.n_positions,
                      n_embd=model.n_embd, n_layer=model.n_layer, n_head=model.n_head,
                      layer_norm_epsilon=model.layer_norm_epsilon, dtype=model.dtype)
  if model.n_embd % model.n_head:
    raise ModelLoadError(f"n_embd={model.n_embd} is not divisible by n_head={model.n_head}")
  return DecoderConfig(family=model.family, vocab_size=model.vocab_size,
                       n_positions=model.n_positions, n_embd=model.n_embd,
                       n_layer=model.n_layer, n_head=model.n_head, n_kv_head=model.n_kv_head,
                       head_dim=model.n_embd // model.n_head, d_ff=model.d_ff,
                       norm_eps=model.layer_norm_epsilon, rope_theta=model.rope_theta,
                       tie_embeddings=model.tie_embeddings, dtype=model.dtype)


def first_source(model: ml_collections.ConfigDict | dict) -> str | None:
  """The source field `load_model` reads (the first of `SOURCES` set), or None."""
  return next((k for k in SOURCES if model.get(k)), None)


def source_of(model: ml_collections.ConfigDict | dict) -> dict:
  """The source `load_model` reads, as {field: value} ({} for none): how to load the model
  again (the other fields a config sets are never read)."""
  first = first_source(model)
  return {first: model[first]} if first else {}


def gguf_path(model: ml_collections.ConfigDict) -> str:
  """The GGUF file a model config names (`gguf`, else the one inside `gguf_package`), or ""."""
  if model.get("gguf"):
    return model.gguf
  if model.get("gguf_package"):
    from lla.model import gguf_io  # the optional `gguf` package, imported only when used
    return gguf_io.packaged_file(model.gguf_package)
  return ""


def _gguf_tokenizer(path: str) -> tokenizer_lib.Tokenizer:
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


def _directory_tokenizer(directory: str | pathlib.Path, cfg) -> tuple[Any, str]:
  """(tokenizer, kind) of a save_pretrained directory: its own; else GPT-2's for a GPT-2
  (its tokenizer is GPT-2's); else none."""
  try:
    own = tokenizer_lib.from_pretrained_dir(directory)
  except ValueError as e:
    raise TokenizerPolicyError(str(e)) from None
  if own is not None:
    return own, OWN_TOKENIZER
  return None, GPT2_TOKENIZER if isinstance(cfg, GPT2Config) else NO_TOKENIZER


def _check_architecture(model: ml_collections.ConfigDict, cfg, source: str):
  """The configured architecture, which the loaded one must equal (its dtype the config's)."""
  expected = architecture(model)
  if cfg.replace(dtype=expected.dtype) != expected:
    raise ModelLoadError(f"{source}: architecture {cfg} differs from model config "
                         f"{model.get('name')!r} ({expected})")
  return expected


def load_model(model: ml_collections.ConfigDict | dict,
               check_architecture: bool = False) -> LoadedModel:
  """Loads the first source of `SOURCES` that `model` sets (see the module docstring).

  Args:
    model: a model config (configs/models.py), or just its source fields.
    check_architecture: an lla checkpoint or hub model must have `model`'s architecture
      (`architecture`): the fine-tuning base, the main job's, the active tier's. Capture and
      replay take the checkpoint's own (a user's directory needs no matching config).

  Raises:
    ModelLoadError (MissingWeightsError, TokenizerPolicyError), hf_io.CheckpointError,
    checkpoint.CheckpointError or gguf_io.GGUFError: one line naming the problem.
  """
  if isinstance(model, dict):
    model = ml_collections.ConfigDict(model)
  check_weights(model)
  kind, tokenizer = GPT2_TOKENIZER, None
  if model.get("gguf") or model.get("gguf_package"):
    from lla.model import gguf_io  # the optional `gguf` package, imported only when used
    path = gguf_path(model)
    params, cfg, info = gguf_io.load_gguf(path)
    tokenizer, kind, source = _gguf_tokenizer(path), OWN_TOKENIZER, f"gguf:{path}"
  elif model.get("hf_dir"):
    params, cfg = hf_io.load_hf_dir(model.hf_dir)
    tokenizer, kind = _directory_tokenizer(model.hf_dir, cfg)
    source = f"hf:{model.hf_dir}"
    info = {"format": "hf-safetensors", "dequantisation": "none"}
  elif model.get("checkpoint"):
    restored = checkpoint.restore(model.checkpoint)
    params, cfg, source = restored.params, restored.cfg, f"lla:{restored.path}"
    # A checkpoint records the tokenizer of the model it was fine-tuned from, or GPT-2's
    # when lla trained it on GPT-2's tokens; one that records none (written before lla
    # recorded it) is GPT-2's only with GPT-2's vocabulary: a model fine-tuned here from a
    # base with a tokenizer of its own is never cut with GPT-2's.
    tokenizer = restored.tokenizer
    if tokenizer is None and not restored.gpt2_tokens and cfg.vocab_size != GPT2_VOCAB_SIZE:
      kind = NO_TOKENIZER
    if check_architecture:
      cfg = _check_architecture(model, cfg, source)
    info = {"format": "lla-checkpoint",
            **{k: restored.metadata[k] for k in ("source_format", "dequantisation")
               if k in restored.metadata}}
  elif model.get("hub"):
    params, cfg, snapshot = hf_io.load_from_hub(model.hub)
    source = f"hub:{model.hub}"
    if check_architecture:
      cfg = _check_architecture(model, cfg, source)
    tokenizer, kind = _directory_tokenizer(snapshot, cfg)
    info = {"format": "hf-safetensors", "dequantisation": "none"}
  else:
    raise ModelLoadError(f"model {model.get('name') or ''!r} names no {SOURCE_NAMES} to "
                         "load from")
  identity, parts = identify(checkpoint.params_sha256(params), cfg, tokenizer, kind)
  info = {"family": cfg.family, **info, **parts}
  return LoadedModel(params, cfg, tokenizer, identity, source, info,
                     OWN_TOKENIZER if tokenizer is not None else kind)
