"""One entry point from a model config to weights: GGUF file, HF directory, lla checkpoint
or hub. `LoadedModel.info` records the family, the source format and the dequantisation."""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from lla.model import checkpoint, hf_io
from lla.model.decoder import DecoderConfig
from lla.model.gpt2 import GPT2Config


@dataclasses.dataclass(frozen=True)
class LoadedModel:
  params: dict
  cfg: GPT2Config | DecoderConfig
  model_id: str      # sha256 of the parameters: the target's identity in E
  source: str
  # {"family", "format" (gguf | hf-safetensors | lla-checkpoint), "dequantisation", ...}
  info: dict[str, Any] = dataclasses.field(default_factory=dict)


def load_model(model: ml_collections.ConfigDict) -> LoadedModel:
  """Loads from `model.gguf` (or the GGUF file inside the installed `model.gguf_package`),
  else `model.hf_dir`, else `model.checkpoint`, else `model.hub`.

  The architecture is the checkpoint's own: a user's directory needs no matching config.
  """
  if model.get("gguf") or model.get("gguf_package"):
    from lla.model import gguf_io  # the optional `gguf` package, imported only when used
    path = model.get("gguf") or gguf_io.packaged_file(model.gguf_package)
    params, cfg, info = gguf_io.load_gguf(path)
    source = f"gguf:{path}"
  elif model.get("hf_dir"):
    params, cfg = hf_io.load_hf_dir(model.hf_dir)
    source = f"hf:{model.hf_dir}"
    info = {"format": "hf-safetensors", "dequantisation": "none"}
  elif model.get("checkpoint"):
    restored = checkpoint.restore(model.checkpoint)
    params, cfg, source = restored.params, restored.cfg, f"lla:{restored.path}"
    info = {"format": "lla-checkpoint",
            **{k: restored.metadata[k] for k in ("source_format", "dequantisation")
               if k in restored.metadata}}
  elif model.get("hub"):
    params, cfg = hf_io.load_from_hub(model.hub)
    source = f"hub:{model.hub}"
    info = {"format": "hf-safetensors", "dequantisation": "none"}
  else:
    raise ValueError("the model config names no gguf, gguf_package, hf_dir, checkpoint or hub "
                     "to load from")
  info = {"family": cfg.family, **info}
  return LoadedModel(params, cfg, checkpoint.params_sha256(params), source, info)
