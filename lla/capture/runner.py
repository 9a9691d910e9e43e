"""Config-driven capture and the token sources it reads."""

from __future__ import annotations

import ml_collections
import numpy as np

from lla import defenses
from lla.capture import capture
from lla.data import load as data_load
from lla.data.passages import token_sha256
from lla.defenses import training as defended
from lla.evidence import files
from lla.model.loading import load_model


def load_tokens_npy(path: str) -> np.ndarray:
  """A user's token ids: an .npy of [B, T] integers (never unpickled), as int32."""
  return files.load_token_matrix(path, "token ids").astype(np.int32)


def defense_from_config(config: ml_collections.ConfigDict, training: bool):
  """(defense, secret) named by a configs/capture.py `defense` block, or (None, None).

  The secret is `Secret.explicit(secret_seed)` when a seed is given, else 128 bits drawn
  from the OS now (kept in memory only: the capture records its hash).

  Raises:
    defenses.DefenseError (one line, naming it): an unregistered defense, a parameter it
      does not declare, a value out of range, a seed for a defense without secrets, or a
      defense that cannot act on this capture.
  """
  given = {k: v for k, v in config.items() if k not in ("name", "secret_seed") and v is not None}
  if config.name in ("", "none"):
    if given or config.secret_seed is not None:
      raise defenses.DefenseError(
          f"defense parameters {', '.join(sorted(given)) or 'secret_seed'} given without a "
          "defense: set --config.defense.name")
    return None, None
  defense = defenses.make(config.name, **given)
  if not defense.has_secret:
    if config.secret_seed is not None:
      raise defenses.DefenseError(f"defense {config.name!r} has no secret: "
                                  "--config.defense.secret_seed does not apply")
    secret = None
  elif config.secret_seed is not None:
    secret = defenses.Secret.explicit(config.secret_seed)
  else:
    secret = defenses.Secret.draw()
  defended.check_capturable(defense, secret, training)
  return defense, secret


def capture_from_config(config: ml_collections.ConfigDict, workdir: str) -> str:
  """Loads the target and the documents named by `config` and writes the capture.

  Every input is checked (the defense first) before anything is written.
  """
  defense, secret = defense_from_config(config.defense, bool(config.training))
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
  defense_args = {}
  if defense is not None:
    record = defense.to_record(secret)
    public = {**record["params"], "strength": record["strength"]}
    if secret is not None:
      public["secret_source"] = secret.source
    defense_args = dict(
        messages=defended.batched_messages(model.params, model.cfg, tokens, int(config.cut),
                                           defense, secret, int(config.batch_size),
                                           bool(config.training)),
        defense=defense.name, defense_params=public,
        defense_seed_sha256=record.get("secret_sha256", ""))
  return capture.capture_target(
      workdir, model.params, model.cfg, tokens, ids, int(config.cut), model_id=model.model_id,
      corpus=corpus, split_hashes=hashes, training=bool(config.training),
      batch_size=int(config.batch_size), session_id=config.session_id or None,
      extra_metadata={"model_source": model.source}, **defense_args)
