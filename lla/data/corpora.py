"""Corpora: named sources of text that become one int32 token stream per split.

Every corpus has the splits "train", "valid" and "test", each a list of
documents (strings). `Corpus.tokens(split)` tokenizes them line by line and
joins the documents with `<|endoftext|>`, the way GPT-2 separates documents;
the stream is cached as .npy under a key that hashes the source text, the
tokenizer definition and this tokenization scheme, so it is computed once.

  * `WikiText2`: WikiText-2 files from a data directory (or the HF hub).
  * `ClinicalTemplates`: rule-generated clinical notes, deterministic in a seed.
  * `PythonStdlibCode`: the running interpreter's own standard library sources.
"""

from __future__ import annotations

import abc
import functools
import hashlib
import json
import os
import platform
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lla.data import fetch
from lla.data import paths
from lla.data import tokenizer as tokenizer_lib

SPLITS = ("train", "valid", "test")
CACHE_ENV_VAR = "LLA_CACHE_DIR"
# Part of every cache key: bump when the text -> ids scheme below changes.
_TOKENIZATION_SCHEME = "lines-keepends+eot-between-documents.v1"


def default_cache_dir() -> Path:
  """`$LLA_CACHE_DIR`, else `$XDG_CACHE_HOME/lla/tokens`, else `~/.cache/lla/tokens`."""
  if os.environ.get(CACHE_ENV_VAR):
    return Path(os.environ[CACHE_ENV_VAR]).expanduser()
  xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
  return Path(xdg) / "lla" / "tokens"


def _check_split(split: str) -> None:
  if split not in SPLITS:
    raise ValueError(f"Unknown split {split!r}; expected one of {SPLITS}.")


def _sha256_documents(documents: Sequence[str]) -> str:
  digest = hashlib.sha256()
  for document in documents:
    data = document.encode("utf-8")
    # Length-prefixed so that ["ab", "c"] and ["a", "bc"] hash differently.
    digest.update(len(data).to_bytes(8, "little"))
    digest.update(data)
  return digest.hexdigest()


def wikitext2_file(data_dir: Path, split: str) -> Path:
  """The WikiText-2 text of `split` under `data_dir`, in any of its distributed layouts."""
  _check_split(split)
  candidates = [
      f"wikitext-2/{split}.txt",
      f"wikitext-2/wiki.{split}.tokens",
      f"wikitext-2/wiki.{split}.raw",
      f"wikitext-2-raw/wiki.{split}.raw",
  ]
  return paths.find_file(data_dir, candidates, f"WikiText-2 {split} split")


def encode_documents(tokenizer: tokenizer_lib.Tokenizer, documents: Sequence[str]) -> np.ndarray:
  """Tokenizes documents line by line, `<|endoftext|>` between them: int32 [n].

  Raises:
    ValueError: several documents and a tokenizer without `<|endoftext|>` to separate them.
  """
  if len(documents) > 1 and tokenizer.eot_id is None:
    raise ValueError(f"tokenizer {tokenizer.source} has no {tokenizer_lib.EOT_TOKEN} to put "
                     f"between this corpus's {len(documents)} documents")
  lines_per_document = [document.splitlines(keepends=True) for document in documents]
  line_ids = iter(tokenizer.encode_batch([line for lines in lines_per_document for line in lines]))
  separator = np.asarray([tokenizer.eot_id if len(documents) > 1 else 0], np.int32)
  pieces = []
  for index, lines in enumerate(lines_per_document):
    if index:
      pieces.append(separator)
    pieces.extend(next(line_ids) for _ in lines)
  return np.concatenate(pieces) if pieces else np.zeros([0], np.int32)


def _save_atomically(path: Path, array: np.ndarray) -> None:
  # Several processes may fill the same cache; a reader must never see half a file.
  path.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".npy.tmp", delete=False) as f:
    np.save(f, array)
  os.replace(f.name, path)


class Corpus(abc.ABC):
  """A named text source with splits "train", "valid", "test".

  Subclasses define the documents; tokenization and caching are shared.
  """

  name: str

  def __init__(self, tokenizer: tokenizer_lib.Tokenizer, cache_dir: str | os.PathLike[str] | None = None):
    self.tokenizer = tokenizer
    self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()

  @abc.abstractmethod
  def documents(self, split: str) -> list[str]:
    """The text of `split`, as a list of documents."""

  def source_sha256(self, split: str) -> str:
    """Fingerprint of the text of `split` (keys the token cache)."""
    return _sha256_documents(self.documents(split))

  @abc.abstractmethod
  def metadata(self) -> dict[str, Any]:
    """JSON-serialisable description of where the text came from."""

  def cache_path(self, split: str) -> Path:
    key = json.dumps(
        {
            "corpus": self.name,
            "split": split,
            "source_sha256": self.source_sha256(split),
            "tokenizer_sha256": self.tokenizer.sha256,
            "scheme": _TOKENIZATION_SCHEME,
        },
        sort_keys=True,
    )
    return self.cache_dir / f"{self.name}-{split}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.npy"

  def tokens(self, split: str) -> np.ndarray:
    """The token stream of `split`, int32 [n], read-only; tokenized once, then cached."""
    _check_split(split)
    path = self.cache_path(split)
    if path.is_file():
      ids = np.load(path)
    else:
      ids = encode_documents(self.tokenizer, self.documents(split))
      _save_atomically(path, ids)
    ids = np.asarray(ids, np.int32)
    ids.setflags(write=False)
    return ids


class WikiText2(Corpus):
  """WikiText-2 from files: `wikitext-2/{split}.txt` (or the original names).

  File names tried, in order, for split s: `wikitext-2/s.txt`,
  `wikitext-2/wiki.s.tokens`, `wikitext-2/wiki.s.raw`,
  `wikitext-2-raw/wiki.s.raw`. The first found is used and recorded in
  `metadata()`; the tokenized variant (with `<unk>`) comes first.
  """

  name = "wikitext2"

  def __init__(
      self,
      tokenizer: tokenizer_lib.Tokenizer,
      data_dir: str | os.PathLike[str] | None = None,
      cache_dir: str | os.PathLike[str] | None = None,
  ):
    super().__init__(tokenizer, cache_dir)
    self.data_dir = paths.resolve_data_dir(data_dir)

  def file(self, split: str) -> Path:
    return wikitext2_file(self.data_dir, split)

  def documents(self, split: str) -> list[str]:
    # One document: WikiText is a single article stream with no separators.
    return [self.file(split).read_text(encoding="utf-8")]

  def source_sha256(self, split: str) -> str:
    # The file's own sha256 (as in SHA256SUMS), without decoding it.
    return hashlib.sha256(self.file(split).read_bytes()).hexdigest()

  def metadata(self) -> dict[str, Any]:
    files = {}
    for split in SPLITS:
      try:
        files[split] = str(self.file(split).relative_to(self.data_dir))
      except paths.DataNotFoundError:
        files[split] = None
    # The recorded copy the three splits form (lla.data.fetch.COPIES), whatever their file names.
    copy = (fetch.identify({fetch.WIKITEXT_FILES[split]: self.file(split) for split in SPLITS})
            if all(files.values()) else fetch.UNRECOGNISED)
    return {"corpus": self.name, "source": str(self.data_dir), "files": files, "copy": copy}


class WikiText2Hub(Corpus):
  """WikiText-2 through Hugging Face `datasets` (optional dependency, needs network or its cache)."""

  name = "wikitext2"
  _HF_SPLITS = {"train": "train", "valid": "validation", "test": "test"}

  def __init__(
      self,
      tokenizer: tokenizer_lib.Tokenizer,
      cache_dir: str | os.PathLike[str] | None = None,
      dataset: str = "Salesforce/wikitext",
      config: str = "wikitext-2-v1",
  ):
    super().__init__(tokenizer, cache_dir)
    self.dataset, self.config = dataset, config

  def documents(self, split: str) -> list[str]:
    _check_split(split)
    where = f"Hugging Face dataset {self.dataset!r} config {self.config!r} split {self._HF_SPLITS[split]!r}"
    try:
      import datasets  # pylint: disable=g-import-not-at-top  # Optional dependency.
    except ImportError as e:
      raise paths.DataNotFoundError(
          "WikiText-2 from the hub", [f"{where}: the `datasets` package is not installed"]
      ) from e
    try:
      rows = datasets.load_dataset(self.dataset, self.config, split=self._HF_SPLITS[split])
    except Exception as e:  # Network and hub errors come in many types.
      raise paths.DataNotFoundError("WikiText-2 from the hub", [f"{where}: {type(e).__name__}: {e}"]) from e
    # Rows are the file's lines, its blank line " \n" an empty row: put back, the text is the
    # file's byte for byte (lla.data.fetch.text_from_rows).
    return [fetch.text_from_rows(rows["text"], where).decode("utf-8")]

  def metadata(self) -> dict[str, Any]:
    return {"corpus": self.name, "source": f"hub:{self.dataset}/{self.config}"}


# The grammar of ClinicalTemplates. Medications carry their own plausible
# doses, units, routes and frequencies so that notes are internally consistent.
_MEDICATIONS = (
    # name, doses, unit, routes, frequencies
    ("metformin", (500, 850, 1000), "mg", ("PO",), ("once daily", "twice daily")),
    ("lisinopril", (5, 10, 20, 40), "mg", ("PO",), ("once daily",)),
    ("atorvastatin", (10, 20, 40, 80), "mg", ("PO",), ("once daily", "at bedtime")),
    ("amlodipine", (2.5, 5, 10), "mg", ("PO",), ("once daily",)),
    ("metoprolol tartrate", (12.5, 25, 50, 100), "mg", ("PO",), ("twice daily",)),
    ("furosemide", (20, 40, 80), "mg", ("PO", "IV"), ("once daily", "twice daily")),
    ("heparin", (5000,), "units", ("SC",), ("every 8 hours", "every 12 hours")),
    ("insulin glargine", (10, 14, 20, 30), "units", ("SC",), ("at bedtime",)),
    ("ceftriaxone", (1, 2), "g", ("IV",), ("once daily",)),
    ("vancomycin", (1, 1.25, 1.5), "g", ("IV",), ("every 12 hours",)),
    ("piperacillin-tazobactam", (3.375, 4.5), "g", ("IV",), ("every 6 hours", "every 8 hours")),
    ("acetaminophen", (500, 650, 1000), "mg", ("PO",), ("every 6 hours as needed",)),
    ("ondansetron", (4, 8), "mg", ("IV", "PO"), ("every 8 hours as needed",)),
    ("pantoprazole", (20, 40), "mg", ("PO", "IV"), ("once daily", "twice daily")),
    ("albuterol", (2.5,), "mg", ("nebulized",), ("every 4 hours as needed",)),
    ("prednisone", (10, 20, 40, 60), "mg", ("PO",), ("once daily",)),
    ("apixaban", (2.5, 5), "mg", ("PO",), ("twice daily",)),
    ("warfarin", (2, 3, 5), "mg", ("PO",), ("once daily",)),
    ("levothyroxine", (25, 50, 75, 100), "mcg", ("PO",), ("once daily",)),
    ("morphine", (2, 4), "mg", ("IV",), ("every 4 hours as needed",)),
)
_DIAGNOSES = (
    "community-acquired pneumonia",
    "congestive heart failure exacerbation",
    "type 2 diabetes mellitus",
    "essential hypertension",
    "acute kidney injury",
    "COPD exacerbation",
    "urinary tract infection",
    "cellulitis of the left lower extremity",
    "atrial fibrillation with rapid ventricular response",
    "sepsis secondary to pneumonia",
    "diabetic ketoacidosis",
    "acute pancreatitis",
    "deep vein thrombosis",
    "asthma exacerbation",
    "upper gastrointestinal bleed",
    "hypothyroidism",
    "chest pain, rule out acute coronary syndrome",
    "syncope",
)
_SEXES = (  # word, abbreviation, pronoun
    ("male", "M", "He"),
    ("female", "F", "She"),
)
_OPENINGS = (
    "{age}-year-old {sex} presenting with {diagnosis}.",
    "Patient is a {age} y/o {sex_abbrev} admitted for {diagnosis}.",
    "{age} yo {sex} with a history of {history}, admitted with {diagnosis}.",
    "Chief complaint: {diagnosis}. {age}-year-old {sex} with a past medical history of {history}.",
)
_VITALS = (
    "Vitals: BP {sbp}/{dbp} mmHg, HR {hr} bpm, T {temp} C, SpO2 {spo2}% on {oxygen}.",
    "BP {sbp}/{dbp}, HR {hr}, Temp {temp} C, SpO2 {spo2}% on {oxygen}.",
    "On arrival temperature was {temp} C, heart rate {hr}, blood pressure {sbp}/{dbp} and saturation {spo2}% on {oxygen}.",
)
_ORDERS = (
    "Started {medication} {dose} {unit} {route} {frequency}.",
    "Plan: continue {medication} {dose} {unit} {route} {frequency}.",
    "{pronoun} was given {medication} {dose} {unit} {route} and will continue it {frequency}.",
    "Medication: {medication} {dose} {unit} {route} {frequency}.",
)
_CLOSINGS = (
    "Follow up in clinic in {weeks} weeks.",
    "Repeat labs in the morning.",
    "Discussed the plan with the patient, who agrees.",
    "Will reassess in {hours} hours.",
    "Diagnosis: {diagnosis}.",
)


def _format_number(value: float) -> str:
  return f"{value:g}"


class ClinicalTemplates(Corpus):
  """Synthetic clinical notes from a seeded grammar (no real patient data).

  A note is one paragraph: an opening (age, sex, diagnosis, history), vitals
  (BP, HR, temperature, SpO2), one or two medication orders (dose, unit,
  route, frequency) and a closing sentence. Split s of seed `seed` draws from
  `numpy.random.default_rng([seed, SPLITS.index(s)])`, so the splits are
  independent and each is a pure function of (seed, split, n_notes).
  """

  name = "clinical"

  def __init__(
      self,
      tokenizer: tokenizer_lib.Tokenizer,
      cache_dir: str | os.PathLike[str] | None = None,
      seed: int = 0,
      n_notes: dict[str, int] | None = None,
  ):
    super().__init__(tokenizer, cache_dir)
    self.seed = seed
    # About 75 tokens a note: enough for thousands of 32-token passages in train.
    self.n_notes = {"train": 4000, "valid": 1000, "test": 1000, **(n_notes or {})}

  def documents(self, split: str) -> list[str]:
    _check_split(split)
    rng = np.random.default_rng([self.seed, SPLITS.index(split)])
    return [self._note(rng) for _ in range(self.n_notes[split])]

  @staticmethod
  def _note(rng: np.random.Generator) -> str:
    def pick(options):
      return options[rng.integers(len(options))]

    sex, sex_abbrev, pronoun = pick(_SEXES)
    diagnosis_index, history_index = rng.choice(len(_DIAGNOSES), size=2, replace=False)
    sbp = int(rng.integers(88, 191))
    fields = {
        "age": int(rng.integers(18, 96)),
        "sex": sex,
        "sex_abbrev": sex_abbrev,
        "pronoun": pronoun,
        "diagnosis": _DIAGNOSES[diagnosis_index],
        "history": _DIAGNOSES[history_index],
        "sbp": sbp,
        "dbp": int(rng.integers(45, min(sbp - 25, 115) + 1)),
        "hr": int(rng.integers(48, 141)),
        "temp": f"{rng.integers(355, 401) / 10:.1f}",
        "spo2": int(rng.integers(85, 101)),
        "oxygen": pick(("room air", "room air", f"{rng.integers(1, 7)} L nasal cannula")),
        "weeks": int(rng.integers(1, 7)),
        "hours": int(pick((4, 6, 12, 24, 48))),
    }
    sentences = [pick(_OPENINGS).format(**fields), pick(_VITALS).format(**fields)]
    for medication_index in rng.choice(len(_MEDICATIONS), size=int(rng.integers(1, 3)), replace=False):
      medication, doses, unit, routes, frequencies = _MEDICATIONS[medication_index]
      sentences.append(
          pick(_ORDERS).format(
              **fields,
              medication=medication,
              dose=_format_number(pick(doses)),
              unit=unit,
              route=pick(routes),
              frequency=pick(frequencies),
          )
      )
    sentences.append(pick(_CLOSINGS).format(**fields))
    return " ".join(sentences) + "\n"

  def metadata(self) -> dict[str, Any]:
    return {"corpus": self.name, "source": "generated", "seed": self.seed, "n_notes": dict(self.n_notes)}


class PythonStdlibCode(Corpus):
  """Python source files of the running interpreter's standard library.

  Files are enumerated in sorted order (for determinism) under
  `sysconfig.get_paths()["stdlib"]`, skipping installed packages and test
  suites (the tests are larger than the library and hold deliberately
  malformed files). Each file goes to one split by the sha256 of its relative
  path (80% train, 10% valid, 10% test), so a file keeps its split across
  Python versions. The text depends on the Python version, which
  `metadata()` records; passage hashes tell two versions apart.
  """

  name = "code"
  _EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})

  def __init__(
      self,
      tokenizer: tokenizer_lib.Tokenizer,
      cache_dir: str | os.PathLike[str] | None = None,
      stdlib_dir: str | os.PathLike[str] | None = None,
  ):
    super().__init__(tokenizer, cache_dir)
    self.stdlib_dir = Path(stdlib_dir) if stdlib_dir is not None else Path(sysconfig.get_paths()["stdlib"])

  @staticmethod
  def split_of(relative_path: str) -> str:
    bucket = int(hashlib.sha256(relative_path.encode("utf-8")).hexdigest()[:8], 16) % 10
    return "train" if bucket < 8 else SPLITS[bucket - 7]

  @functools.cached_property
  def _relative_paths(self) -> list[str]:
    found = []
    for directory, subdirectories, file_names in os.walk(self.stdlib_dir):
      # Pruned in place so that site-packages (often gigabytes) is never walked.
      subdirectories[:] = [name for name in subdirectories if name not in self._EXCLUDED_DIRS]
      relative_dir = Path(directory).relative_to(self.stdlib_dir)
      found.extend((relative_dir / name).as_posix() for name in file_names if name.endswith(".py"))
    return sorted(found)

  def files(self, split: str) -> list[Path]:
    """The split's source files, sorted by relative path."""
    _check_split(split)
    selected = [self.stdlib_dir / relative for relative in self._relative_paths if self.split_of(relative) == split]
    if not selected:
      raise paths.DataNotFoundError(
          f"Python standard library sources ({split} split)",
          [f"{self.stdlib_dir}/**/*.py"],
          hint="This interpreter ships without .py sources; pass stdlib_dir= pointing at a CPython Lib/ tree.",
      )
    return selected

  def documents(self, split: str) -> list[str]:
    return [path.read_text(encoding="utf-8") for path in self.files(split)]

  def source_sha256(self, split: str) -> str:
    digest = hashlib.sha256()
    for path in self.files(split):
      digest.update(path.relative_to(self.stdlib_dir).as_posix().encode("utf-8") + b"\0")
      digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()

  def metadata(self) -> dict[str, Any]:
    return {
        "corpus": self.name,
        "source": str(self.stdlib_dir),
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "n_files": {split: len(self.files(split)) for split in SPLITS},
    }
