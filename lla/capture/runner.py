"""Config-driven capture and the token sources it reads."""

from __future__ import annotations

import ml_collections
import numpy as np

from lla.capture import capture
from lla.data import load as data_load
from lla.data.passages import token_sha256
from lla.evidence import files
from lla.model.loading import load_model


def load_tokens_npy(path: str) -> np.ndarray:
  """A user's token ids: an .npy of [B, T] integers (never unpickled), as int32."""
  return files.load_token_matrix(path, "token ids").astype(np.int32)


def capture_from_config(config: ml_collections.ConfigDict, workdir: str) -> str:
  """Loads the target and the documents named by `config` and writes the capture."""
  model = load_model(config.model)
  if config.data.tokens_npy:
    tokens = load_tokens_npy(config.data.tokens_npy)
    ids, corpus = np.arange(tokens.shape[0]), "custom"
    hashes = {"evaluation": token_sha256(tokens)}
  else:
    data = {k: v for k, v in config.data.to_dict().items() if k != "tokens_npy"}
    splits = data_load.load_splits(**data)
    tokens, ids, corpus = splits.evaluation.tokens, splits.evaluation.document_ids, splits.corpus
    hashes = {name: p.sha256 for name, p in splits.items()}
  return capture.capture_target(
      workdir, model.params, model.cfg, tokens, ids, int(config.cut), model_id=model.model_id,
      corpus=corpus, split_hashes=hashes, training=bool(config.training),
      batch_size=int(config.batch_size), session_id=config.session_id or None,
      extra_metadata={"model_source": model.source})

