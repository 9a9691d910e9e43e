"""Tokenizers (the `tokenizers` library, not a re-implementation): GPT-2's byte-level BPE,
which the corpora and the embedded model use, and any other model's own.

GPT-2's comes from two sources, same result (50,257 ids, `<|endoftext|>` = 50256
registered as a special token so that it is never split into pieces):

  * a directory holding OpenAI's `vocab.json` + `merges.txt` (or a data
    directory with a `gpt2-tokenizer/` subdirectory): works offline;
  * a hub name such as "gpt2" (needs network access or a warm HF cache).

Another model's tokenizer (e.g. a GGUF file's, lla.model.gguf_io.gguf_tokenizer) is wrapped
with `wrap`; a study pins whichever it decodes with by its definition (`definition`,
`from_definition`), so scoring text needs nothing but the study.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from lla.data import paths

EOT_TOKEN = "<|endoftext|>"
EOT_ID = 50256
TOKENIZER_SUBDIR = "gpt2-tokenizer"
_TOKENIZER_FILES = ("vocab.json", "merges.txt")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenizer:
  """A `tokenizers.Tokenizer` plus what runs need to record about it.

  Attributes:
    backend: the underlying `tokenizers.Tokenizer`.
    source: where it came from (a directory, or "hub:<name>").
    sha256: fingerprint of the full tokenizer definition (vocabulary, merges,
      pre-tokenizer, special tokens); it keys token caches, so any change to
      how text becomes ids invalidates them.
    bos_id: the token the model's own tokenizer puts in front of every sequence (Llama's
      `<s>`, Gemma's `<bos>`), or None where it adds none (GPT-2, Qwen, SmolLM2). `encode`
      never adds it: the passages put it at position 0 (lla.data.load.load_splits), where
      it is public and never scored.
  """

  backend: tokenizers.Tokenizer
  source: str
  sha256: str
  bos_id: int | None = None

  @property
  def known_prefix(self) -> tuple[int, ...]:
    """The tokens every passage starts with, known to everyone: (bos_id,) or ()."""
    return () if self.bos_id is None else (int(self.bos_id),)

  @property
  def eot_id(self) -> int | None:
    """The id of GPT-2's `<|endoftext|>` (50256 in GPT-2's), None where it has none."""
    return self.backend.token_to_id(EOT_TOKEN)

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> np.ndarray:
    """Returns the ids of `text`, int32 [n]."""
    return np.asarray(self.backend.encode(text, add_special_tokens=False).ids, np.int32)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    """Tokenizes each text separately, in parallel: a list of int32 [n_i].

    Callers encode long text line by line (lines keeping their endings, as
    Hugging Face's `run_clm` does with WikiText rows): the Rust backend then
    uses every core, and the concatenation still decodes to the exact text.
    """
    # encode_batch_fast skips offset tracking (about 1.5x faster) where it exists.
    encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
    return [np.asarray(e.ids, np.int32) for e in encode(list(texts), add_special_tokens=False)]

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    return self.backend.decode(np.asarray(ids).tolist(), skip_special_tokens=False)


def _fingerprint(backend: tokenizers.Tokenizer) -> str:
  return hashlib.sha256(backend.to_str().encode("utf-8")).hexdigest()


def _check_gpt2(backend: tokenizers.Tokenizer, source: str) -> None:
  eot = backend.token_to_id(EOT_TOKEN)
  if eot != EOT_ID:
    raise ValueError(f"Tokenizer from {source} maps {EOT_TOKEN} to {eot}, expected {EOT_ID}: not GPT-2's.")


def from_directory(directory: str | os.PathLike[str]) -> Tokenizer:
  """Builds GPT-2's tokenizer from `vocab.json` + `merges.txt` in `directory`.

  Mirrors the Hugging Face `gpt2` tokenizer.json: byte-level pre-tokenizer with
  GPT-2's regex and no prefix space, byte-level decoder, no unknown token.
  """
  directory = Path(directory)
  vocab, merges = (
      paths.find_file(directory, [name], f"GPT-2 tokenizer file {name!r}") for name in _TOKENIZER_FILES
  )
  backend = tokenizers.Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = decoders.ByteLevel()
  backend.post_processor = processors.ByteLevel(trim_offsets=False)
  # OpenAI's vocab.json already holds the id; registering it as special is
  # what stops "<|endoftext|>" in text from being byte-pair encoded.
  backend.add_special_tokens([tokenizers.AddedToken(EOT_TOKEN, special=True)])
  _check_gpt2(backend, str(directory))
  return wrap(backend, str(directory))


def wrap(backend: tokenizers.Tokenizer, source: str, bos_id: int | None = None) -> Tokenizer:
  """Any `tokenizers.Tokenizer` (a model's own, e.g. a GGUF file's), from `source`, with the
  BOS its model expects in front of every sequence (None: none)."""
  return Tokenizer(backend=backend, source=source, sha256=_fingerprint(backend), bos_id=bos_id)


def from_file(path: str | os.PathLike[str]) -> Tokenizer:
  """A model's own `tokenizer.json` (a `save_pretrained` directory's), with the BOS its
  post-processor puts in front of a sequence (Llama-2's `<s>`, Llama-3's
  `<|begin_of_text|>`; Qwen's adds none): lla places that BOS itself (`Tokenizer.bos_id`).

  Raises:
    ValueError: the post-processor adds tokens other than one leading BOS (e.g. an EOS),
      which lla does not place.
  """
  backend = tokenizers.Tokenizer.from_file(str(path))
  plain = backend.encode("a", add_special_tokens=False).ids
  full = backend.encode("a", add_special_tokens=True).ids
  if full == plain:
    return wrap(backend, str(path))
  if len(full) == len(plain) + 1 and full[1:] == plain:
    return wrap(backend, str(path), bos_id=int(full[0]))
  raise ValueError(f"{path}: its post-processor turns {plain} into {full}; lla places one "
                   "leading BOS and nothing else")


PRETRAINED_TOKENIZER = "tokenizer.json"
PRETRAINED_CONFIG = "tokenizer_config.json"


def from_pretrained_dir(directory: str | os.PathLike[str]) -> Tokenizer | None:
  """A `save_pretrained` directory's own tokenizer, or None where it holds no
  tokenizer.json.

  The BOS policy is transformers': `add_bos_token` in tokenizer_config.json, where present,
  decides whether `bos_token` (named there) starts every sequence (a Llama tokenizer whose
  config sets it false adds none, whatever its post-processor says); where absent, the
  tokenizer.json post-processor decides (`from_file`), and its BOS must be the `bos_token`
  the config names, if it names one.

  Raises:
    ValueError (one line): add_bos_token without a bos_token in the vocabulary, a
      post-processor BOS other than the named bos_token, or one `from_file` refuses.
  """
  directory = Path(directory)
  own = directory / PRETRAINED_TOKENIZER
  if not own.is_file():
    return None
  tokenizer = from_file(own)
  config_path = directory / PRETRAINED_CONFIG
  if not config_path.is_file():
    return tokenizer
  try:
    config = json.loads(config_path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{config_path}: not valid JSON ({e})") from None
  bos_token = config.get("bos_token")
  if isinstance(bos_token, dict):  # an AddedToken's serialisation
    bos_token = bos_token.get("content")
  named = tokenizer.backend.token_to_id(bos_token) if bos_token else None
  if bos_token and named is None:
    raise ValueError(f"{config_path}: bos_token {bos_token!r} is not in {own.name}'s vocabulary")
  add = config.get("add_bos_token")
  if add is None:
    if tokenizer.bos_id is not None and named is not None and named != tokenizer.bos_id:
      raise ValueError(f"{own}: its post-processor prepends id {tokenizer.bos_id}, "
                       f"{config_path.name} names bos_token {bos_token!r} (id {named})")
    return tokenizer
  if not add:
    return wrap(tokenizer.backend, str(own))
  if named is None:
    raise ValueError(f"{config_path}: add_bos_token is true but it names no bos_token")
  return wrap(tokenizer.backend, str(own), bos_id=int(named))


def definition(tokenizer: Tokenizer) -> str:
  """The tokenizer's full definition (the `tokenizers` JSON); its sha256 is `sha256`."""
  return tokenizer.backend.to_str()


def from_definition(text: str, source: str) -> Tokenizer:
  """The tokenizer a `definition` describes (e.g. one pinned in a study's inputs): GPT-2's
  or any model's own."""
  return wrap(tokenizers.Tokenizer.from_str(text), source)


def from_hub(name: str = "gpt2") -> Tokenizer:
  """Downloads (or reads from the HF cache) the tokenizer of hub model `name`.

  Raises:
    paths.DataNotFoundError: the hub is unreachable and nothing is cached.
  """
  try:
    backend = tokenizers.Tokenizer.from_pretrained(name)
  except Exception as e:  # The hub client raises many types; all mean "not available".
    raise paths.DataNotFoundError(
        f"Tokenizer {name!r}",
        [
            f"local directory {name!r}: not a directory",
            f"Hugging Face hub {name!r}: {type(e).__name__}: {e}",
        ],
        hint=(
            "Offline? Pass a directory holding vocab.json and merges.txt, or a "
            f"data directory with {TOKENIZER_SUBDIR}/ (or set {paths.ENV_VAR})."
        ),
    ) from e
  _check_gpt2(backend, f"hub:{name}")
  return wrap(backend, f"hub:{name}")


def load_tokenizer(data_dir_or_name: str | os.PathLike[str] | None = None) -> Tokenizer:
  """Loads GPT-2's tokenizer from a directory, a data directory, or the hub.

  Args:
    data_dir_or_name: a directory with vocab.json + merges.txt; or a data
      directory with `gpt2-tokenizer/`; or a hub name ("gpt2"); or None for
      `$LLA_DATA_DIR`.
  """
  if data_dir_or_name is None:
    data_dir_or_name = paths.resolve_data_dir(None)
  path = Path(data_dir_or_name).expanduser()
  if path.is_dir():
    candidates = (path / TOKENIZER_SUBDIR, path)
    for directory in candidates:
      if all((directory / name).is_file() for name in _TOKENIZER_FILES):
        return from_directory(directory)
    raise paths.DataNotFoundError(
        "GPT-2 tokenizer files (vocab.json, merges.txt)",
        [str(directory / name) for directory in candidates for name in _TOKENIZER_FILES],
    )
  # Only a string shaped like a hub id ("gpt2", "owner/name") goes to the
  # network; anything else is a local path that does not exist, and a typo in
  # it should say so rather than trigger a download.
  if isinstance(data_dir_or_name, str) and _HUB_ID.fullmatch(data_dir_or_name):
    return from_hub(data_dir_or_name)
  raise paths.DataNotFoundError("Tokenizer directory", [f"{path}: not a directory"])
