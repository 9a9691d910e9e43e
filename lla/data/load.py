"""The data entry points used by the rest of lla.

  splits = load_splits(config.data.data_dir, corpus="wikitext2", seed=config.seed)
  splits.evaluation.tokens        # int32 [256, 32]
  tokenizer = load_tokenizer(config.data.data_dir)
  stream = pretraining_tokens(config.data.data_dir, exclude=splits)
"""

from __future__ import annotations

import os
from typing import Any

import ml_collections
import numpy as np

from lla.data import corpora
from lla.data import passages
from lla.data import paths
from lla.data import tokenizer as tokenizer_lib
from lla.data.tokenizer import load_tokenizer

PathLike = str | os.PathLike[str]
CORPORA = ("wikitext2", "clinical", "code")


def get_config() -> ml_collections.ConfigDict:
  """Defaults of `config.data`; the field names are `load_splits`'s arguments."""
  config = ml_collections.ConfigDict()
  config.data_dir = ml_collections.config_dict.placeholder(str)  # Else $LLA_DATA_DIR.
  config.cache_dir = ml_collections.config_dict.placeholder(str)  # Else $LLA_CACHE_DIR or ~/.cache/lla/tokens.
  config.corpus = "wikitext2"
  config.seq_len = 32
  config.n_calibration = 32
  config.n_train = 128
  config.n_eval = 256
  config.seed = 0
  config.calibration_source = "train"
  config.training_source = "train"
  config.evaluation_source = "test"
  return config


def make_corpus(
    corpus: str,
    data_dir: PathLike | None = None,
    cache_dir: PathLike | None = None,
    tokenizer: tokenizer_lib.Tokenizer | None = None,
) -> corpora.Corpus:
  """Builds a corpus by name; the tokenizer defaults to the data directory's."""
  if corpus not in CORPORA:
    raise ValueError(f"Unknown corpus {corpus!r}; expected one of {CORPORA} (or pass a Corpus).")
  if tokenizer is None:
    tokenizer = load_tokenizer(paths.resolve_data_dir(data_dir))
  if corpus == "wikitext2":
    return corpora.WikiText2(tokenizer, data_dir=data_dir, cache_dir=cache_dir)
  if corpus == "clinical":
    return corpora.ClinicalTemplates(tokenizer, cache_dir=cache_dir)
  return corpora.PythonStdlibCode(tokenizer, cache_dir=cache_dir)


def load_splits(
    data_dir: PathLike | None = None,
    corpus: str | corpora.Corpus = "wikitext2",
    seq_len: int = 32,
    n_calibration: int = 32,
    n_train: int = 128,
    n_eval: int = 256,
    seed: int = 0,
    cache_dir: PathLike | None = None,
    *,
    calibration_source: str = "train",
    training_source: str = "train",
    evaluation_source: str = "test",
    tokenizer: tokenizer_lib.Tokenizer | None = None,
) -> passages.Splits:
  """Calibration, training and evaluation passages of exactly `seq_len` tokens.

  Args:
    data_dir: data directory; None for `$LLA_DATA_DIR`. Only the tokenizer is
      read from it for the generated corpora.
    corpus: "wikitext2", "clinical", "code", or a `Corpus` instance.
    seq_len: T, tokens per passage.
    n_calibration: public calibration documents (the attacker's).
    n_train: fine-tuning documents.
    n_eval: held-out documents to attack.
    seed: seed of the draw (the corpora themselves are fixed).
    cache_dir: token cache; None for `corpora.default_cache_dir()`.
    calibration_source: corpus split the calibration passages come from.
    training_source: corpus split the training passages come from.
    evaluation_source: corpus split the evaluation passages come from.
    tokenizer: overrides the data directory's tokenizer.

  Returns:
    `Splits` with tokens int32 [n, seq_len] per split, document ids (window
    indices in the source stream) and sha256 hashes; splits that share a
    source are disjoint. A tokenizer with a BOS (`Tokenizer.bos_id`) puts it at
    position 0 of every passage, before seq_len - 1 tokens of text: the passage is
    the sequence its model sees, and `Splits.known_prefix` says which positions are
    public.
  """
  if not isinstance(corpus, corpora.Corpus):
    corpus = make_corpus(corpus, data_dir, cache_dir, tokenizer)
  prefix = corpus.tokenizer.known_prefix
  if seq_len <= len(prefix):
    raise ValueError(f"seq_len={seq_len} leaves no text after the tokenizer's BOS")
  sources = {"calibration": calibration_source, "training": training_source, "evaluation": evaluation_source}
  sizes = {"calibration": n_calibration, "training": n_train, "evaluation": n_eval}
  windows = {source: passages.with_prefix(passages.cut_windows(corpus.tokens(source),
                                                               seq_len - len(prefix)), prefix)
             for source in set(sources.values())}
  drawn = passages.draw_splits(windows, sources, sizes, seed)
  provenance = {
      "corpus": corpus.metadata(),
      "tokenizer": {"source": corpus.tokenizer.source, "sha256": corpus.tokenizer.sha256},
      "source_sha256": {source: corpus.source_sha256(source) for source in sorted(windows)},
      "n_windows": {source: len(windows[source]) for source in sorted(windows)},
  }
  return passages.Splits(corpus=corpus.name, seq_len=seq_len, seed=seed, provenance=provenance,
                         known_prefix=prefix, **drawn)


def load_splits_from_config(config: ml_collections.ConfigDict, **overrides: Any) -> passages.Splits:
  """`load_splits(**config)` for a `get_config()`-shaped ConfigDict."""
  return load_splits(**{**config.to_dict(), **overrides})


def pretraining_tokens(
    data_dir: PathLike | None = None,
    split: str = "train",
    *,
    exclude: passages.Splits | None = None,
    exclude_splits: tuple[str, ...] = ("evaluation",),
    cache_dir: PathLike | None = None,
    tokenizer: tokenizer_lib.Tokenizer | None = None,
) -> np.ndarray:
  """The WikiText-2 `split` stream for language-model training: int32 [n].

  Args:
    data_dir: data directory; None for `$LLA_DATA_DIR`.
    split: WikiText-2 split.
    exclude: WikiText-2 splits whose passages must not be trained on. The
      windows of `exclude_splits` that were cut from this same `split` are
      removed and the remaining pieces joined; with the default sources
      (evaluation from test) nothing is removed from train.
    exclude_splits: which of `exclude`'s splits to remove.
    cache_dir: token cache; None for the default.
    tokenizer: overrides the data directory's tokenizer.

  Raises:
    ValueError: `exclude` was drawn from another corpus, tokenizer or text.
  """
  corpus = make_corpus("wikitext2", data_dir, cache_dir, tokenizer)
  stream = corpus.tokens(split)
  if exclude is None:
    return stream
  drop = [exclude_split for exclude_split in exclude_splits if getattr(exclude, exclude_split).source == split]
  if not drop:
    return stream
  same_source = (
      exclude.corpus == corpus.name
      and exclude.provenance["tokenizer"]["sha256"] == corpus.tokenizer.sha256
      and exclude.provenance["source_sha256"][split] == corpus.source_sha256(split)
  )
  if not same_source:
    raise ValueError(
        f"`exclude` was drawn from {exclude.corpus!r} with another tokenizer or text than WikiText-2 "
        f"{split!r} here; its document ids would point at the wrong windows."
    )
  document_ids = np.concatenate([getattr(exclude, name).document_ids for name in drop])
  return passages.remove_windows(stream, exclude.text_len, document_ids)
