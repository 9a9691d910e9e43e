"""The server's public text: WikiText-2 training windows disjoint from the client's documents.

FSHA's server trains its pilot, decoder and critic on public data from the client's domain
(the official code uses MNIST's test split while the client trains on its train split).
Here: the WikiText-2 train stream with the client's training windows removed
(lla.data.pretraining_tokens), cut into T-token windows, `n_docs` of them drawn with a
seed. The client's evaluation documents come from the test split, so nothing the client
holds is public. Only the run hands these tokens to the server; server code never loads
data itself.
"""

from __future__ import annotations

import numpy as np

from lla import data
from lla.data import passages


def public_windows(splits: data.Splits, n_docs: int, seed: int,
                   data_dir: str | None = None, tokenizer=None) -> np.ndarray:
  """int32 [n_docs, T] public windows, none overlapping a client training window, cut by
  the splits' tokenizer (`tokenizer`; None: the data directory's) and starting with their
  known prefix (a BOS) as the client's documents do."""
  stream = data.pretraining_tokens(data_dir, split=splits.training.source, exclude=splits,
                                   exclude_splits=("training",), tokenizer=tokenizer)
  windows = passages.with_prefix(passages.cut_windows(stream, splits.text_len),
                                 splits.known_prefix)
  if n_docs > len(windows):
    raise ValueError(f"public set: {n_docs} documents asked, {len(windows)} windows available")
  order = np.random.default_rng(seed).permutation(len(windows))[:n_docs]
  return windows[np.sort(order)]
