"""Capture: run the target once and store its boundary messages.

The client sends h for every document; in a training capture the server returns
g = dL/dh, with L the mean next-token loss over the documents of one training batch
(PROTOCOL section 1). Batches follow the order of `tokens`; each document's batch index is
its `step` and its place in the batch its `order`.
"""

from __future__ import annotations

import hashlib
import operator

import jax.numpy as jnp
import numpy as np

from lla.capture import store
from lla.model import layer_stack
from lla.model import split
from lla.model.gpt2 import GPT2Config
from lla.protocol import tuple as protocol


def boundary_messages_batched(params, cfg: GPT2Config, tokens: np.ndarray, cut: int,
                              batch_size: int, training: bool):
  """(h [B, T, d], g [B, T, d] or None) computed one training batch at a time.

  The model runs on the computation form of `params` (its layers stacked, one scanned layer
  body: the program's size does not grow with the cut or the depth), made here for this
  capture alone rather than cached beside the caller's tree."""
  params = layer_stack.stack(params, cfg.n_layer)
  hs, gs = [], []
  for start in range(0, tokens.shape[0], batch_size):
    batch = jnp.asarray(tokens[start:start + batch_size])
    if training:
      h, g = split.boundary_messages(params, cfg, batch, cut)
      gs.append(np.asarray(g))
    else:
      h = split.client(params, cfg, batch, cut)
    hs.append(np.asarray(h))
  return np.concatenate(hs), (np.concatenate(gs) if training else None)


class CaptureInputError(ValueError):
  """An input of a capture that is checked before anything runs; one line naming it."""


def check_known_prefix(tokens: np.ndarray, known_prefix) -> tuple[int, ...]:
  """`known_prefix` as a tuple of ints, or CaptureInputError: scoring skips one position
  (lla.scoring.metrics "after_bos"), so a prefix is one token (a BOS) that every document of
  tokens [B, T] starts with, with text after it."""
  prefix = tuple(int(t) for t in known_prefix)
  if len(prefix) > 1:
    raise CaptureInputError(f"known prefix {list(prefix)}: lla supports one public token (a "
                            "BOS), not a longer prefix")
  if prefix and tokens.shape[1] <= len(prefix):
    raise CaptureInputError(f"documents of {tokens.shape[1]} tokens hold nothing after the "
                            f"known prefix {list(prefix)}")
  if prefix and np.any(tokens[:, :len(prefix)] != np.asarray(prefix)):
    bad = int(np.flatnonzero(np.any(tokens[:, :len(prefix)] != np.asarray(prefix), 1))[0])
    raise CaptureInputError(f"document {bad} does not start with the known prefix "
                            f"{list(prefix)} (the model's BOS)")
  return prefix


def check_tokens(tokens, cfg: GPT2Config, what: str = "tokens") -> np.ndarray:
  """`tokens` as int32 [B, T] with B, T >= 1, ids in [0, V) and T <= n_positions, or
  CaptureInputError naming what is wrong (`what` names the input, e.g. its file)."""
  tokens = np.asarray(tokens)
  if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
    raise CaptureInputError(f"{what} must be [B, T] integer token ids, got "
                            f"{tokens.dtype}{list(tokens.shape)}")
  if tokens.size == 0:
    empty = "no documents" if tokens.shape[0] == 0 else "documents of no tokens"
    raise CaptureInputError(f"{what}: empty token array {list(tokens.shape)} ({empty}): a "
                            "capture needs B >= 1 documents of T >= 1 tokens")
  low, high = int(tokens.min()), int(tokens.max())
  if low < 0 or high >= cfg.vocab_size:
    raise CaptureInputError(f"{what}: token ids must lie in [0, {cfg.vocab_size}), got "
                            f"[{low}, {high}]")
  if tokens.shape[1] > cfg.n_positions:
    raise CaptureInputError(f"{what}: T={tokens.shape[1]} exceeds the model's "
                            f"n_positions={cfg.n_positions}")
  return tokens.astype(np.int32)


def check_cut(cut, cfg: GPT2Config | None = None) -> int:
  """The cut k (1 <= k < n_layer: the client runs blocks 0..k-1 and the server at least one),
  or CaptureInputError; without `cfg` only the lower bound is checked."""
  try:
    cut = operator.index(cut)
  except TypeError:
    raise CaptureInputError(f"cut={cut!r}: expected an integer") from None
  if cut < 1 or (cfg is not None and cut >= cfg.n_layer):
    upper = "n_layer - 1" if cfg is None else f"{cfg.n_layer - 1} (n_layer - 1)"
    raise CaptureInputError(f"cut={cut} is out of range: expected 1 <= cut <= {upper}; the "
                            "client runs blocks 0..cut-1 and the server the rest")
  return int(cut)


def check_batch_size(batch_size) -> int:
  """Documents per training batch (an integer >= 1), or CaptureInputError."""
  try:
    value = operator.index(batch_size)
  except TypeError:
    value = 0
  if value < 1:
    raise CaptureInputError(f"batch_size={batch_size!r}: expected an integer >= 1")
  return value


def capture_target(directory: str, params, cfg: GPT2Config, tokens: np.ndarray,
                   document_ids, cut: int, *, model_id: str, corpus: str = "custom",
                   split_hashes: dict | None = None, training: bool = True,
                   batch_size: int = 32, session_id: str | None = None,
                   messages=None, defense: str = "none", defense_params: dict | None = None,
                   defense_seed_sha256: str = "",
                   extra_metadata: dict | None = None,
                   attacker: protocol.Attacker | None = None,
                   extra_files: dict[str, bytes] | None = None,
                   known_prefix: tuple[int, ...] = (), corpus_copy: str = "") -> str:
  """Runs the split on `tokens` [B, T] and writes a capture; returns its manifest sha256.

  Args:
    messages: optional precomputed (h, g) — a defense transforms them before storage.
    defense, defense_params: the defense that produced `messages` (public parameters only).
    defense_seed_sha256: hash of its secret seed, so that two instances of one defense
      configuration (the gate's seeds) are distinct targets in E.
    attacker: E's V (position and rights) when it is not the passive server, e.g. an active
      server that wrote the gradients (lla.active).
    extra_files: files stored with the capture and covered by its manifest
      (store.write_capture).
    known_prefix: the tokens every document starts with, public (the model's BOS; E.C):
      attacks may start after them and they are never scored.
    corpus_copy: which recorded copy of the corpus the documents were cut from (E.C.copy,
      `Splits.copy`); "" where the corpus has none.
  """
  tokens = check_tokens(tokens, cfg)
  known_prefix = check_known_prefix(tokens, known_prefix)
  check_cut(cut, cfg)
  check_batch_size(batch_size)
  if messages is None:
    messages = boundary_messages_batched(params, cfg, tokens, cut, batch_size, training)
  h, g = messages
  e = protocol.make(
      T=protocol.Target(model_id=model_id, cut=cut, defense=defense,
                        defense_params=protocol.frozen(defense_params or {}),
                        defense_seed_sha256=defense_seed_sha256,
                        n_layer=cfg.n_layer),
      V=attacker or protocol.Attacker(),
      O=protocol.Observations(activations=True, gradients=g is not None),
      C=protocol.Corpora(name=corpus, seq_len=int(tokens.shape[1]),
                         split_hashes=protocol.frozen(split_hashes or {}),
                         known_prefix=known_prefix, copy=corpus_copy))
  num_docs = tokens.shape[0]
  metadata = {
      # Deterministic by default, so the same target and documents capture to the same bytes.
      "session_id": session_id or hashlib.sha256(
          (e.sha256() + tokens.tobytes().hex()).encode()).hexdigest()[:16],
      "document_ids": [int(i) for i in document_ids],
      "step": [i // batch_size for i in range(num_docs)],
      "order": [i % batch_size for i in range(num_docs)],
      "batch_size": batch_size,
      "mode": "training" if g is not None else "inference",
      "checkpoint_sha256": model_id,
      "protocol": e.to_dict(),
      "e_hash": e.sha256(),
      **(extra_metadata or {}),
  }
  return store.write_capture(directory, h, g, tokens, metadata, extra_files)
