"""Pre-training a GPT-2 from scratch on WikiText-2 train, cached in a workdir.

  ckpt = pretrain(config, workdir)   # workdir/checkpoint, reused if valid

The result is an lla checkpoint (orbax + HF export, see lla.model.checkpoint) whose metadata
holds the run config, the loss history, the data hashes and the held-out (WikiText-2 valid)
cross-entropy and perplexity. A checkpoint made with another config is refused, not reused.
"""

from __future__ import annotations

import json
import os
import pathlib
import time

import jax
import ml_collections
import numpy as np
from absl import logging

from lla import data
from lla.model.gpt2 import param_count
from lla.model import split
from lla.model import checkpoint as ckpt
from lla.train import loop
from lla.model import loading

CHECKPOINT_DIR = "checkpoint"


def json_config(config: ml_collections.ConfigDict) -> dict:
  """The config as it reads back from metadata.json (tuples become lists), for comparison."""
  return json.loads(config.to_json(sort_keys=True))


def _windows(stream: np.ndarray, seq_len: int) -> np.ndarray:
  return data.passages.cut_windows(stream, seq_len)


def load_pretraining_data(config: ml_collections.ConfigDict,
                          exclude: data.Splits | None = None) -> tuple[np.ndarray, np.ndarray]:
  """WikiText-2 (train windows [N, T], valid windows [M, T]) with T = config.seq_len.

  The passages of `config.exclude_splits` of `exclude` (default: the split draw of
  config.data) are cut out of train first, so that the base model never saw the fine-tuning
  or attacked documents. A job that fine-tunes on another draw passes its own.
  """
  splits = data.load_splits_from_config(config.data) if exclude is None else exclude
  kwargs = dict(cache_dir=config.data.cache_dir)
  train = data.pretraining_tokens(config.data.data_dir, "train", exclude=splits,
                                  exclude_splits=tuple(config.exclude_splits), **kwargs)
  valid = _windows(data.pretraining_tokens(config.data.data_dir, "valid", **kwargs), config.seq_len)
  return _windows(train, config.seq_len), valid[:config.eval_windows or None]


def excluded_hashes(config: ml_collections.ConfigDict, splits: data.Splits) -> dict:
  """{split: sha256} of the passages cut out of pre-training (recorded and compared)."""
  return {name: getattr(splits, name).sha256 for name in config.exclude_splits}


def pretrain(config: ml_collections.ConfigDict, workdir: str | os.PathLike,
             train_tokens: np.ndarray | None = None,
             valid_tokens: np.ndarray | None = None,
             exclude: data.Splits | None = None) -> ckpt.Checkpoint:
  """Returns the checkpoint in `workdir/checkpoint`, training it first if there is none.

  Args:
    config: see configs/pretrain.py.
    workdir: run directory.
    train_tokens, valid_tokens: int32 [N, T] windows overriding the WikiText-2 ones (tests).
    exclude: the split draw whose `config.exclude_splits` pre-training must not see
      (default: config.data's draw); the main job passes its own.

  Raises:
    ValueError: the cached checkpoint was made with a different config or exclusion.
  """
  cfg = loading.architecture(config.model)
  run_config = json_config(config)
  if train_tokens is None:
    exclude = data.load_splits_from_config(config.data) if exclude is None else exclude
    run_config["excluded_sha256"] = excluded_hashes(config, exclude)
  directory = pathlib.Path(workdir) / CHECKPOINT_DIR

  def create():
    nonlocal train_tokens, valid_tokens
    if train_tokens is None:
      train_tokens, valid_tokens = load_pretraining_data(config, exclude)
    params = split.init_params(cfg, jax.random.key(config.seed))
    logging.info("pretraining %s (%d params) on %s windows for %d steps of %d x %d tokens",
                 config.model.name, param_count(params), train_tokens.shape, config.num_steps,
                 config.batch_size, config.seq_len)
    start = time.time()
    result = loop.train(params, cfg, train_tokens, optimizer=config.optimizer,
                        num_steps=config.num_steps, batch_size=config.batch_size,
                        seed=config.seed, log_every=config.log_every, desc="pretrain")
    train_seconds = time.time() - start
    held_out = loop.evaluate(result.params, cfg, valid_tokens, config.eval_batch_size)
    tokens_seen = config.num_steps * config.batch_size * config.seq_len
    logging.info("pretrained in %.0f s (%.0f tokens/s); valid CE %.4f, perplexity %.2f",
                 train_seconds, tokens_seen / train_seconds, held_out["ce"], held_out["perplexity"])
    metadata = {
        "kind": "pretrain",
        "run_config": run_config,
        "history": result.history,
        "valid": held_out,
        "train_seconds": train_seconds,
        "tokens_seen": tokens_seen,
        "epochs": tokens_seen / train_tokens.size,
        "data": {"train_windows_sha256": data.token_sha256(train_tokens),
                 "train_windows": list(train_tokens.shape),
                 "valid_windows_sha256": data.token_sha256(valid_tokens),
                 "valid_windows": list(valid_tokens.shape)},
    }
    return result.params, cfg, metadata

  # Trained on the data directory's GPT-2 tokens: recorded, so that the model and every copy
  # fine-tuned from it are cut with GPT-2's tokenizer whatever their vocabulary.
  checkpoint, _ = ckpt.load_or_create(directory, create, export_hf=config.export_hf,
                                      tokenizer=ckpt.GPT2_TOKENS)
  if checkpoint.metadata.get("run_config") != run_config:
    raise ValueError(f"{directory} was made with a different config; use another --workdir "
                     "or delete it")
  return checkpoint
