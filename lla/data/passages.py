"""Fixed-length passages and the seeded calibration / training / evaluation splits.

A token stream of n tokens is cut into floor(n / T) non-overlapping windows of
exactly T tokens; window i is stream[i*T : (i+1)*T] and its document id is i.
Each split draws windows without replacement from a seeded permutation of the
windows of its source split (PROTOCOL.md section 1: 32 public calibration, 128
training, 256 held-out evaluation documents of T = 32 tokens). Splits that
share a source take consecutive, hence disjoint, slices of the same
permutation.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np

SPLIT_NAMES = ("calibration", "training", "evaluation")


def token_sha256(tokens: np.ndarray) -> str:
  """sha256 of token ids: their little-endian int32 bytes (C order), then the shape.

  The shape is appended as little-endian int64s, one per dimension, so that
  [2, 3] and [3, 2] arrays of the same ids hash differently.
  """
  digest = hashlib.sha256(np.ascontiguousarray(tokens, dtype="<i4").tobytes())
  digest.update(np.asarray(np.shape(tokens), dtype="<i8").tobytes())
  return digest.hexdigest()


def cut_windows(stream: np.ndarray, seq_len: int) -> np.ndarray:
  """Non-overlapping windows: int32 [n // seq_len, seq_len]; the tail is dropped."""
  if seq_len < 1:
    raise ValueError(f"seq_len must be positive, got {seq_len}.")
  n_windows = len(stream) // seq_len
  return np.asarray(stream[: n_windows * seq_len], np.int32).reshape(n_windows, seq_len)


def with_prefix(windows: np.ndarray, prefix: tuple[int, ...]) -> np.ndarray:
  """windows [n, L] with the tokens `prefix` (a BOS) in front of each: int32 [n, P + L]."""
  head = np.broadcast_to(np.asarray(prefix, np.int32), (len(windows), len(prefix)))
  return np.concatenate([head, windows], axis=1).astype(np.int32)


def _source_rng(seed: int, source: str) -> np.random.Generator:
  # One stream per (seed, source): a split's draw depends on its source and
  # seed only, not on how long the other sources happen to be.
  source_key = int.from_bytes(hashlib.sha256(source.encode("utf-8")).digest()[:4], "little")
  return np.random.default_rng([seed, source_key])


@dataclasses.dataclass(frozen=True, eq=False)
class Passages:
  """One split's passages.

  Attributes:
    tokens: int32 [N, T], read-only.
    document_ids: int64 [N]; row r is window `document_ids[r]` of the source
      split's stream, i.e. stream[id*L : (id+1)*L] after the known prefix (L = T less
      `Splits.known_prefix`: T without a BOS).
    source: the corpus split the windows were cut from ("train", "test", ...).
    sha256: `token_sha256(tokens)`.
  """

  tokens: np.ndarray
  document_ids: np.ndarray
  source: str
  sha256: str

  def to_json(self) -> dict[str, Any]:
    return {
        "source": self.source,
        "shape": list(self.tokens.shape),
        "sha256": self.sha256,
        "document_ids": self.document_ids.tolist(),
    }


def _read_only(array: np.ndarray) -> np.ndarray:
  array = np.array(array)
  array.setflags(write=False)
  return array


def make_passages(windows: np.ndarray, document_ids: np.ndarray, source: str) -> Passages:
  tokens = _read_only(windows[document_ids].astype(np.int32))
  return Passages(
      tokens=tokens,
      document_ids=_read_only(np.asarray(document_ids, np.int64)),
      source=source,
      sha256=token_sha256(tokens),
  )


@dataclasses.dataclass(frozen=True, eq=False)
class Splits:
  """Calibration (public), training and evaluation passages of one corpus.

  Attributes:
    corpus: corpus name ("wikitext2", "clinical", "code").
    seq_len: T, tokens per passage.
    seed: the seed of the draw.
    calibration: the attacker's public documents, tokens [n_calibration, T].
    training: the fine-tuning documents, tokens [n_train, T].
    evaluation: the held-out documents to attack, tokens [n_eval, T].
    provenance: corpus metadata, tokenizer fingerprint, source-split hashes.
    known_prefix: the tokens every passage starts with (the model's BOS), public and
      never scored; each passage is then `known_prefix` + T - P tokens of text, window
      `document_ids[r]` of T - P tokens.
  """

  corpus: str
  seq_len: int
  seed: int
  calibration: Passages
  training: Passages
  evaluation: Passages
  provenance: Mapping[str, Any]
  known_prefix: tuple[int, ...] = ()

  @property
  def text_len(self) -> int:
    """Tokens of text per passage (T less the known prefix): the windows' length."""
    return self.seq_len - len(self.known_prefix)

  @property
  def copy(self) -> str:
    """Which recorded copy of the corpus's files the passages come from (E.C.copy); "" where
    the corpus records none (the generated ones)."""
    return self.provenance.get("corpus", {}).get("copy", "")

  def items(self) -> tuple[tuple[str, Passages], ...]:
    return tuple((name, getattr(self, name)) for name in SPLIT_NAMES)

  def to_json(self) -> dict[str, Any]:
    """JSON-serialisable summary (the corpus component C of the protocol tuple)."""
    out = {
        "corpus": self.corpus,
        "seq_len": self.seq_len,
        "seed": self.seed,
        "splits": {name: passages.to_json() for name, passages in self.items()},
        "provenance": dict(self.provenance),
    }
    if self.known_prefix:  # Absent without one, so that earlier studies' summaries stand.
      out["known_prefix"] = list(self.known_prefix)
    return out


def draw_splits(
    windows_by_source: Mapping[str, np.ndarray],
    sources: Mapping[str, str],
    sizes: Mapping[str, int],
    seed: int,
) -> dict[str, Passages]:
  """Draws each split's windows without replacement; disjoint within a source.

  Args:
    windows_by_source: source split name -> int32 [n_windows, T].
    sources: split name (calibration/training/evaluation) -> source name.
    sizes: split name -> number of passages.
    seed: seed of the permutations.

  Returns:
    split name -> Passages, for the names in SPLIT_NAMES.

  Raises:
    ValueError: a source has fewer windows than the splits drawing from it need.
  """
  drawn = {}
  for source in dict.fromkeys(sources[name] for name in SPLIT_NAMES):
    names = [name for name in SPLIT_NAMES if sources[name] == source]
    windows = windows_by_source[source]
    needed = sum(sizes[name] for name in names)
    if needed > len(windows):
      raise ValueError(
          f"Source split {source!r} has {len(windows)} windows of {windows.shape[1]} tokens; "
          f"{' + '.join(f'{name} {sizes[name]}' for name in names)} = {needed} needed."
      )
    order = _source_rng(seed, source).permutation(len(windows))
    start = 0
    for name in names:
      drawn[name] = make_passages(windows, order[start : start + sizes[name]], source)
      start += sizes[name]
  return drawn


def remove_windows(stream: np.ndarray, seq_len: int, document_ids: np.ndarray) -> np.ndarray:
  """`stream` without the windows `document_ids` (as cut by `cut_windows`): int32 [n - len(ids) * T]."""
  keep = np.ones(len(stream), bool)
  for document_id in np.asarray(document_ids):
    keep[document_id * seq_len : (document_id + 1) * seq_len] = False
  return np.asarray(stream, np.int32)[keep]
