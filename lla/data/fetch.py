"""WikiText-2 and GPT-2's tokenizer files from the Hugging Face hub, checked against recorded sums.

  result = fetch.fetch("data")   # downloads what is missing, verifies everything
  result.copy                    # "hub-canonical", "shared-repacked", ...

Writes the layout `lla.data.paths` reads:

  DIR/wikitext-2/{train,valid,test}.txt     WikiText-2, tokenized variant (v1, with <unk>)
  DIR/gpt2-tokenizer/{vocab.json,merges.txt}

Sources, pinned to commits (a branch could move under a recorded sum):

  * dataset `Salesforce/wikitext` @ WIKITEXT_REVISION, `wikitext-2-v1/{split}-00000-of-00001.parquet`:
    one row per line of the original `wiki.{split}.tokens`. A row keeps its "\n"; the
    original's blank lines, " \n", are empty rows, so `text_from_rows` turns "" back into " \n".
  * model `openai-community/gpt2` @ GPT2_REVISION, `vocab.json` and `merges.txt` (OpenAI's
    `encoder.json` and `vocab.bpe` under the Hugging Face names, byte for byte).

Every file is checked against COPIES, the table of recorded copies of this layout: a file
counts only if its sha256 or git blob id is one a copy records for its path, and the
directory's copy is the one every file belongs to. Files are written to a temporary name
beside their destination and renamed only once they verify, so an interrupted or corrupt
download never leaves a file under a final name; files already present that verify are
kept, so a directory that already holds a recognised copy is verified and nothing is
downloaded (it may be read-only).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from lla.data import paths

WIKITEXT_REPO = "Salesforce/wikitext"
# The repository's head since its parquet conversion; `datasets` records this commit for
# the wikitext-2-v1 files (36,718 / 3,760 / 4,358 rows = train / valid / test lines).
WIKITEXT_REVISION = "b08601e04326c79dfdd32d625aee71d232d685c3"
WIKITEXT_CONFIG = "wikitext-2-v1"
GPT2_REPO = "openai-community/gpt2"
# Its vocab.json and merges.txt at this commit have git blob ids 1f1d9aac... and 226b0752...,
# the same blobs as OpenAI's encoder.json and vocab.bpe (recorded in COPIES below).
GPT2_REVISION = "607a30d783dfa663caf39e06633721c8d4cfcd7e"

UNRECOGNISED = "unrecognised"


@dataclasses.dataclass(frozen=True)
class Source:
  """Where one file of the layout comes from on the hub."""
  repo_id: str
  repo_type: str
  revision: str
  filename: str
  parquet_rows: bool  # True: a parquet file of WikiText rows, written back as text


def _wikitext(split: str) -> Source:
  return Source(WIKITEXT_REPO, "dataset", WIKITEXT_REVISION,
                f"{WIKITEXT_CONFIG}/{split}-00000-of-00001.parquet", True)


def _gpt2(filename: str) -> Source:
  return Source(GPT2_REPO, "model", GPT2_REVISION, filename, False)


# Layout path -> its source; the order is the order of the downloads.
SOURCES: dict[str, Source] = {
    "gpt2-tokenizer/vocab.json": _gpt2("vocab.json"),
    "gpt2-tokenizer/merges.txt": _gpt2("merges.txt"),
    "wikitext-2/valid.txt": _wikitext("validation"),
    "wikitext-2/test.txt": _wikitext("test"),
    "wikitext-2/train.txt": _wikitext("train"),
}
WIKITEXT_FILES = {split: f"wikitext-2/{split}.txt" for split in ("train", "valid", "test")}

# Files every recorded copy shares. Sums from ../shared/data/README.md: valid and test are
# the files of pytorch/examples (commit d5678bc8, by WikiText's first author), the tokenizer
# files OpenAI's (tiktoken pins the same sha256).
_COMMON = {
    "wikitext-2/valid.txt": frozenset({
        "sha256:f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8",
        "git-blob:eec944eb2d9e46061cd34a6913528797db6842fc"}),
    "wikitext-2/test.txt": frozenset({
        "sha256:d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0",
        "git-blob:6f3fc88e4cd88456ea892971f9f12243e8428624"}),
    "gpt2-tokenizer/vocab.json": frozenset({
        "sha256:196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
        "git-blob:1f1d9aaca301414e7f6c9396df506798ff4eb9a6"}),
    "gpt2-tokenizer/merges.txt": frozenset({
        "sha256:1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
        "git-blob:226b0752cac7789c48f0cb3ec53eda48b7be36cc"}),
}

# Copy name -> layout path -> the identities ("sha256:..." / "git-blob:...") recorded for it.
# The copies differ in train.txt only.
COPIES: dict[str, dict[str, frozenset[str]]] = {
    # The original train file (pytorch/examples' wikitext-2/train.txt, git blob 2d84b35a...),
    # which the hub's rows should reproduce: their byte counts agree (`datasets` records
    # 10,918,118 bytes of rows = the file's bytes less 2 per blank line, plus 4 per row), the
    # bytes themselves were never compared here (no network). Only its blob id is recorded.
    "hub-canonical": {
        "wikitext-2/train.txt": frozenset({"git-blob:2d84b35af79e411d73ea7cae83c73964c6ac83b4"}),
        **_COMMON,
    },
    # ../shared/data: the same train text with its 615 articles in another order.
    "shared-repacked": {
        "wikitext-2/train.txt": frozenset({
            "sha256:728c77e87e176af4730f9a80fc6008bcaff421a7202c1c048877c0eec3685f89",
            "git-blob:29208aee343c889c0dfb1559134da76b2d83a587"}),
        **_COMMON,
    },
}


class FetchError(RuntimeError):
  """The data could not be fetched or did not verify; the message is one line."""


@dataclasses.dataclass(frozen=True)
class Result:
  out: Path
  copy: str                   # the name in COPIES every file belongs to
  downloaded: tuple[str, ...]  # layout paths written by this call
  kept: tuple[str, ...]        # layout paths that were already there and verified


def identities(data: bytes) -> frozenset[str]:
  """The names a file's bytes are recorded under: sha256 and git blob id (sha1 of a header + bytes)."""
  blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
  return frozenset({f"sha256:{hashlib.sha256(data).hexdigest()}", f"git-blob:{blob}"})


def _sha256_of(ids: Iterable[str]) -> str:
  return next(i for i in ids if i.startswith("sha256:")).removeprefix("sha256:")


def copies_matching(files: Mapping[str, frozenset[str]]) -> list[str]:
  """Names of the recorded copies that hold every given file (layout path -> identities)."""
  return [name for name, recorded in COPIES.items()
          if all(path in recorded and recorded[path] & ids for path, ids in files.items())]


def identify(files: Mapping[str, str | os.PathLike[str]]) -> str:
  """The recorded copy that the files (layout path -> file on disk) belong to, else UNRECOGNISED.

  Files may be a subset of the layout (a corpus's three splits); where several copies hold
  them all, the first in COPIES is named.
  """
  matching = copies_matching({path: identities(Path(f).read_bytes()) for path, f in files.items()})
  return matching[0] if matching else UNRECOGNISED


def text_from_rows(rows: Iterable[str | None], where: str) -> bytes:
  """The WikiText file whose lines the hub's rows are: "" is the blank line " \\n"."""
  pieces = []
  for index, row in enumerate(rows):
    if row is None or (row and not row.endswith("\n")):
      raise FetchError(f"{where}: row {index} is {row!r}, not a WikiText line ending in a newline")
    pieces.append(row or " \n")
  return "".join(pieces).encode("utf-8")


def _read_parquet_text(path: str, where: str) -> bytes:
  # pyarrow is needed only here: importing it for every `lla.data` user would cost them its load time.
  import pyarrow  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  try:
    column = pq.read_table(path, columns=["text"]).column("text")
  except (pyarrow.ArrowException, KeyError) as e:
    raise FetchError(f"{where}: not a parquet file with a 'text' column ({type(e).__name__}: "
                     f"{_first_line(e)})") from None
  return text_from_rows(column.to_pylist(), where)


def _first_line(error: BaseException) -> str:
  return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _download(source: Source, cache_dir: Path, endpoint: str | None) -> bytes:
  # Imported here, like pyarrow: only a fetch needs the hub client, not every `lla.data` user.
  from huggingface_hub import constants  # pylint: disable=g-import-not-at-top
  from huggingface_hub import hf_hub_download  # pylint: disable=g-import-not-at-top
  where = f"{source.repo_id}@{source.revision[:8]}/{source.filename}"
  try:
    local = hf_hub_download(source.repo_id, source.filename, repo_type=source.repo_type,
                            revision=source.revision, cache_dir=cache_dir, endpoint=endpoint)
  except Exception as e:  # pylint: disable=broad-except  # Network and hub errors come in many types.
    raise FetchError(
        f"cannot download {where} from the Hugging Face hub at {endpoint or constants.ENDPOINT} "
        f"({type(e).__name__}: {_first_line(e)}). Either use a copy you have: set "
        f"{paths.ENV_VAR}=DIR (or --data_dir / --config.data.data_dir=DIR) to a data directory, or "
        "run `python -m experiments.fetch_data --out DIR` where the hub is reachable") from None
  if source.parquet_rows:
    return _read_parquet_text(local, where)
  return Path(local).read_bytes()


def _write_verified(target: Path, relative: str, data: bytes) -> None:
  """Writes `data` to `target` only if it is a recorded copy of `relative`: temp file, then rename."""
  ids = identities(data)
  if not copies_matching({relative: ids}):
    raise FetchError(f"{relative} as downloaded ({len(data):,} bytes, sha256 {_sha256_of(ids)}) matches "
                     f"no recorded copy ({_recorded(relative)}); nothing was written for it")
  target.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{target.name}.", suffix=".part",
                                   delete=False) as f:
    try:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())  # on disk before it takes the final name: a crash leaves no short file
      os.replace(f.name, target)
    except BaseException:
      os.unlink(f.name)
      raise


def _recorded(relative: str) -> str:
  return ", ".join(f"{name}: {' / '.join(sorted(recorded[relative]))}" for name, recorded in COPIES.items())


def fetch(out: str | os.PathLike[str], *, endpoint: str | None = None,
          log: Callable[[str], None] = lambda line: None) -> Result:
  """Fills `out` with the layout lla reads, downloading only what is missing; verifies every file.

  Args:
    out: the data directory (created if needed).
    endpoint: the hub's URL; None for huggingface_hub's default ($HF_ENDPOINT, else huggingface.co).
    log: receives one line per file.

  Raises:
    FetchError: (one line) a file present or downloaded matches no recorded copy, the files
      form no one copy, or the hub cannot be reached.
  """
  out = Path(out).expanduser()
  present = {}
  for relative in SOURCES:
    target = out / relative
    if target.is_file():
      ids = identities(target.read_bytes())
      if not copies_matching({relative: ids}):
        raise FetchError(f"{target} exists and matches no recorded copy (sha256 {_sha256_of(ids)}; "
                         f"{_recorded(relative)}); move it away or choose another --out")
      present[relative] = ids
      log(f"kept {relative} (verified)")
  missing = [relative for relative in SOURCES if relative not in present]
  if missing:
    try:
      out.mkdir(parents=True, exist_ok=True)
      # The hub's own cache lives beside the data and goes with this call: only verified
      # files under their final names stay behind.
      with tempfile.TemporaryDirectory(dir=out, prefix=".hub-cache-") as cache_dir:
        for relative in missing:
          data = _download(SOURCES[relative], Path(cache_dir), endpoint)
          _write_verified(out / relative, relative, data)
          present[relative] = identities(data)
          log(f"downloaded {relative} (verified)")
    except OSError as e:  # --out is a file, unwritable, or the disk is full
      raise FetchError(f"cannot write the data under {out}: {e.strerror or e} "
                       f"({e.filename or out})") from None
  matching = copies_matching(present)
  if not matching:
    raise FetchError(f"the files in {out} verify one by one but together form no recorded copy "
                     f"({', '.join(COPIES)})")
  return Result(out=out, copy=matching[0], downloaded=tuple(missing),
                kept=tuple(relative for relative in SOURCES if relative not in missing))
