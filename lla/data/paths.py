"""Where the data lives: one resolution rule for every entry point.

The data directory comes from an explicit argument (a config field such as
`--config.data.data_dir`, or a flag) or, failing that, from the environment
variable `LLA_DATA_DIR`. Nothing is guessed from the library's own location:
a run must say where its data is, and a missing file fails loudly with every
place that was tried and the two ways to provide it (an existing copy, or
`python -m experiments.fetch_data`, lla/data/fetch.py).

Expected layout of a data directory:

  DATA_DIR/
    wikitext-2/{train,valid,test}.txt      (or wiki.{split}.tokens / .raw)
    gpt2-tokenizer/{vocab.json,merges.txt}
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

ENV_VAR = "LLA_DATA_DIR"

EXPECTED_LAYOUT = (
    "wikitext-2/{train,valid,test}.txt (or wiki.{train,valid,test}.tokens "
    "or wiki.{train,valid,test}.raw), gpt2-tokenizer/{vocab.json,merges.txt}"
)

_HOW_TO_PROVIDE = (
    f"Provide the data by setting {ENV_VAR}=/path/to/data or by passing "
    "--config.data.data_dir=/path/to/data (data_dir= in Python), or get a copy with "
    "`python -m experiments.fetch_data --out /path/to/data` (WikiText-2 and GPT-2's tokenizer "
    f"from the Hugging Face hub, verified). Expected layout under that directory: {EXPECTED_LAYOUT}."
)


class DataNotFoundError(FileNotFoundError):
  """A data directory or file is missing; the message lists where we looked."""

  def __init__(self, what: str, looked: Sequence[str], hint: str = _HOW_TO_PROVIDE):
    self.what = what
    self.looked = tuple(looked)
    lines = [f"{what} not found. Looked in:"]
    lines += [f"  - {place}" for place in self.looked]
    lines.append(hint)
    super().__init__("\n".join(lines))


def resolve_data_dir(data_dir: str | os.PathLike[str] | None = None) -> Path:
  """Returns the data directory: `data_dir` if given, else `$LLA_DATA_DIR`.

  An explicit argument wins over the environment, and is never silently
  replaced by it: if a run names a directory that does not exist, that is an
  error, not a cue to read data from somewhere else.

  Args:
    data_dir: explicit directory (config field / flag); None or "" if unset.

  Raises:
    DataNotFoundError: neither source is set, or the chosen one is not a
      directory. The message lists both sources and their values.
  """
  env_value = os.environ.get(ENV_VAR) or None
  explicit = os.fspath(data_dir) if data_dir not in (None, "") else None
  looked = [
      f"argument data_dir: {explicit if explicit else '(not given)'}",
      f"environment variable {ENV_VAR}: {env_value if env_value else '(unset)'}"
      + (" (not consulted: data_dir was given)" if explicit and env_value else ""),
  ]
  chosen = explicit or env_value
  if chosen is None:
    raise DataNotFoundError("Data directory", looked)
  path = Path(chosen).expanduser()
  if not path.is_dir():
    raise DataNotFoundError(f"Data directory {str(path)!r}", looked)
  return path


def find_file(data_dir: Path, candidates: Sequence[str], what: str) -> Path:
  """Returns the first of `candidates` (paths relative to `data_dir`) that exists.

  Raises:
    DataNotFoundError: none exists; the message lists every full path tried.
  """
  tried = [data_dir / relative for relative in candidates]
  for path in tried:
    if path.is_file():
      return path
  raise DataNotFoundError(what, [str(path) for path in tried])
