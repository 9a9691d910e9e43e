"""One entry point from a model config to weights: lla checkpoint, HF directory or hub."""

from __future__ import annotations

import dataclasses

import ml_collections

from lla.model import checkpoint, hf_io
from lla.model.gpt2 import GPT2Config


@dataclasses.dataclass(frozen=True)
class LoadedModel:
  params: dict
  cfg: GPT2Config
  model_id: str      # sha256 of the parameters: the target's identity in E
  source: str


def load_model(model: ml_collections.ConfigDict) -> LoadedModel:
  """Loads from `model.hf_dir`, else `model.checkpoint`, else `model.hub`.

  The architecture is the checkpoint's own: a user's directory needs no matching config.
  """
  if model.get("hf_dir"):
    params, cfg = hf_io.load_hf_dir(model.hf_dir)
    source = f"hf:{model.hf_dir}"
  elif model.get("checkpoint"):
    restored = checkpoint.restore(model.checkpoint)
    params, cfg, source = restored.params, restored.cfg, f"lla:{restored.path}"
  elif model.get("hub"):
    params, cfg = hf_io.load_from_hub(model.hub)
    source = f"hub:{model.hub}"
  else:
    raise ValueError("the model config names no hf_dir, checkpoint or hub to load from")
  return LoadedModel(params, cfg, checkpoint.params_sha256(params), source)
