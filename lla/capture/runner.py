"""Config-driven capture and the token sources it reads."""

from __future__ import annotations

import os

import ml_collections
import numpy as np

from lla import defenses
from lla.capture import capture
from lla.data import load as data_load
from lla.data.passages import token_sha256
from lla.defenses import training as defended
from lla.evidence import files
from lla.model import loading


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


def _user_tokens(path: str) -> np.ndarray:
  """The --config.data.tokens_npy array (any integer dtype, not yet range-checked)."""
  try:
    return files.load_token_matrix(path, "token ids")
  except (FileNotFoundError, ValueError) as e:
    message = str(e).removeprefix(f"{path}: ")
    raise capture.CaptureInputError(f"--config.data.tokens_npy={path}: {message}") from None


def _check_workdir(workdir: str) -> None:
  if os.path.isdir(workdir) and os.listdir(workdir) or os.path.lexists(workdir) and \
      not os.path.isdir(workdir):
    raise capture.CaptureInputError(f"--workdir={workdir}: exists and is not an empty directory; "
                                    "a capture is never overwritten: use a new --workdir")


def _check_model_source(model: ml_collections.ConfigDict) -> None:
  """The source lla.model.loading.load_model will read exists (a package or hub name is
  checked by the loader, in one line)."""
  what = loading.first_source(model)
  if what is None:
    raise capture.CaptureInputError(f"--config.model: names no {loading.SOURCE_NAMES} to "
                                    "load the target from")
  path = model[what]
  if what == "gguf" and not os.path.isfile(path):
    raise capture.CaptureInputError(f"--config.model.gguf={path}: no such file")
  if what in ("hf_dir", "checkpoint") and not os.path.isdir(path):
    raise capture.CaptureInputError(f"--config.model.{what}={path}: no such directory")


def capture_from_config(config: ml_collections.ConfigDict, workdir: str) -> str:
  """Loads the target and the documents named by `config` and writes the capture.

  Every input is checked (the workdir, cut, batch size, defense, model and tokens) before
  anything is computed or written; a bad one raises CaptureInputError,
  defenses.DefenseError or a model's CheckpointError, one line naming it.
  """
  _check_workdir(workdir)
  capture.check_cut(config.cut)
  capture.check_batch_size(config.batch_size)
  defense, secret = defense_from_config(config.defense, bool(config.training))
  user_tokens = _user_tokens(config.data.tokens_npy) if config.data.tokens_npy else None
  _check_model_source(config.model)
  model = loading.load_model(config.model)
  capture.check_cut(config.cut, model.cfg)
  # The model's own tokenizer (a GGUF's, an hf_dir's tokenizer.json) cuts the text, and its
  # BOS, if any, starts every document as a public token; without one, only token files
  # feed a model that is not a GPT-2.
  tokenizer = model.tokenizer
  known_prefix = tokenizer.known_prefix if tokenizer is not None else ()
  if user_tokens is not None:
    tokens = capture.check_tokens(user_tokens, model.cfg,
                                  f"--config.data.tokens_npy={config.data.tokens_npy}")
    ids, corpus, corpus_copy = np.arange(tokens.shape[0]), "custom", ""
    hashes = {"evaluation": token_sha256(tokens)}
  else:
    data = {k: v for k, v in config.data.to_dict().items() if k != "tokens_npy"}
    splits = data_load.load_splits(
        **data, tokenizer=model.text_tokenizer("--config.data.tokens_npy=TOKENS.npy"))
    tokens, ids, corpus = splits.evaluation.tokens, splits.evaluation.document_ids, splits.corpus
    corpus_copy = splits.copy
    tokens = capture.check_tokens(tokens, model.cfg, f"the {corpus} evaluation split")
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
      known_prefix=known_prefix, corpus_copy=corpus_copy,
      # Family, format and dequantisation; a GPT-2's records are unchanged.
      extra_metadata={"model_source": model.source,
                      **({"model_info": model.info} if model.cfg.family != "gpt2" else {})},
      **defense_args)
