"""Token blocks for the decoy-row split: WikiText-2 or a synthetic Markov stream.

A block is R + 1 consecutive tokens (inputs [:R], targets [1:]); blocks start every R
tokens, so consecutive blocks share one token and every token of the stream is a target.
"""

from __future__ import annotations

import numpy as np

from lla import data
from lla.data import tokenizer


def blocks_of(stream: np.ndarray, n_real: int) -> np.ndarray:
  """stream [n] int -> blocks [(n - 1) // n_real, n_real + 1], stride n_real."""
  count = (len(stream) - 1) // n_real
  idx = np.arange(count)[:, None] * n_real + np.arange(n_real + 1)[None, :]
  return stream[idx].astype(np.int32)


def wikitext_stream(data_dir: str | None, split: str) -> np.ndarray:
  """The GPT-2 tokens of one WikiText-2 split (lla.data's cached stream)."""
  return np.asarray(data.pretraining_tokens(data_dir or None, split=split), np.int32)


def synthetic_stream(vocab: int, n_tokens: int, seed: int) -> np.ndarray:
  """A stationary Markov chain with a Zipf-like marginal: [n_tokens] int32.

  Sparse random transitions make the next token learnable from the current one, and the
  skewed marginal gives the most-frequent-token baseline something to be right about.
  """
  rng = np.random.default_rng(seed)
  zipf = 1.0 / np.arange(1, vocab + 1) ** 1.1
  trans = rng.dirichlet(np.full(vocab, 0.05), size=vocab) * 0.7 + 0.3 * zipf / zipf.sum()
  cum = np.cumsum(trans, axis=1)
  cum /= cum[:, -1:]
  u = rng.random(n_tokens)
  out = np.empty(n_tokens, np.int32)
  t = 0
  for i in range(n_tokens):
    t = min(int(np.searchsorted(cum[t], u[i])), vocab - 1)
    out[i] = t
  return out


def load_blocks(source: str, n_real: int, *, data_dir: str | None = None, vocab: int = 0,
                n_tokens: int = 0, seed: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
  """(train blocks [N, R + 1], held-out blocks [N', R + 1], vocabulary size).

  Args:
    source: "wikitext" (train / valid splits) or "synthetic" (one stream cut 90 / 10;
      `vocab`, `n_tokens` and `seed` define it).
  """
  if source == "wikitext":
    train = blocks_of(wikitext_stream(data_dir, "train"), n_real)
    valid = blocks_of(wikitext_stream(data_dir, "valid"), n_real)
    return train, valid, tokenizer.EOT_ID + 1
  if source == "synthetic":
    stream = synthetic_stream(vocab, n_tokens, seed)
    cut = int(0.9 * len(stream))
    return blocks_of(stream[:cut], n_real), blocks_of(stream[cut:], n_real), vocab
  raise ValueError(f"data source {source!r}: expected 'wikitext' or 'synthetic'")
