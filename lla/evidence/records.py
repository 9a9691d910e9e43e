"""`AttackRecord`: one attack run, schema `lla.attack_record.v2`.

The field list is the contract of docs/run_format.md; `from_json` rejects
missing, unknown or mistyped fields with an error naming the file, because a
silently defaulted field would change how a run is scored.

Paths in a record are POSIX paths relative to the run directory. The prediction
file lies inside the run directory; the capture is a locator (it may live beside
the run, e.g. `../captures/x`) checked by the hash of its manifest, never an
absolute path; the truth file is a file of that capture, so the capture's
manifest covers it. `check_files` checks a record's hashes against the files.
"""

import dataclasses
import json
import os
import posixpath
import re
import types
import typing
from typing import Any

from lla.evidence import files

SCHEMA = "lla.attack_record.v2"
STATUSES = ("ok", "crashed", "skipped")
# "all": every position; "t>=1": an attack that cannot see position 0 (it reads g[t-1]);
# "after_bos": every position after the capture's known BOS (E.C.known_prefix), public.
SCORED_POSITIONS = ("all", "t>=1", "after_bos")
KNOWLEDGE = ("public", "trained", "none")
UNDEFENDED = "none"
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclasses.dataclass(frozen=True)
class AttackRecord:
  """One attack run; see docs/run_format.md for the meaning of each field."""
  run_id: str
  attack: str
  family: str
  status: str
  error: str | None
  e_hash: str
  capture_dir: str
  capture_sha256: str
  truth_file: str
  prediction_file: str | None
  prediction_sha256: str | None
  scored_positions: str
  baseline_token: int
  model_id: str
  model_seed: int
  cut: int
  knowledge: str
  corpus: str
  defense: str
  defense_params: dict
  reference: str | None
  seed: int
  budget: dict
  flops: float | None
  flops_source: str | None
  flops_analytic: float | None
  wall_s: float | None
  compile_s: float | None
  stages: dict
  details: dict
  provenance: dict
  # The attack's AttackSpec.revision when the record was made (records written before
  # the field existed were made at revision 1).
  attack_revision: int = 1
  # The attack's code identity when the record was made (lla.attacks.registry
  # code_identity: its module and every lla module it imports); None in records written
  # before the field, and in records of writers that run no registered code.
  attack_code_sha256: str | None = None
  # What this process compiled while the attack ran, from JAX's monitoring events
  # (lla.runtime.compile_since): seconds tracing, lowering and in the backend, executables
  # built and loaded from the persistent cache, beside the attack's own wall and run
  # (wall - compile) seconds; None in records written before the field.
  jax_compile: dict | None = None
  schema: str = SCHEMA

  def __post_init__(self):
    where = f"record {self.run_id!r}"
    if self.schema != SCHEMA:
      raise ValueError(f"{where}: schema {self.schema!r}, expected {SCHEMA!r}")
    if self.status not in STATUSES:
      raise ValueError(f"{where}: status {self.status!r} not in {STATUSES}")
    if self.scored_positions not in SCORED_POSITIONS:
      raise ValueError(f"{where}: scored_positions {self.scored_positions!r} "
                       f"not in {SCORED_POSITIONS}")
    if self.knowledge not in KNOWLEDGE:
      raise ValueError(f"{where}: knowledge {self.knowledge!r} not in "
                       f"{KNOWLEDGE}")
    if self.status == "ok" and not self.prediction_file:
      raise ValueError(f"{where}: status 'ok' needs a prediction_file")
    if self.status != "ok" and not self.error:
      raise ValueError(f"{where}: status {self.status!r} needs an error "
                       "message saying why")
    for name in ("e_hash", "capture_sha256", "prediction_sha256", "attack_code_sha256"):
      value = getattr(self, name)
      if not (value is None and name in ("prediction_sha256", "attack_code_sha256")) and (
          not _HEX64.fullmatch(value)):
        raise ValueError(f"{where}: {name} {value!r} is not a sha256 (64 hex digits)")
    if self.prediction_file is not None:
      inside("prediction_file", self.prediction_file)
    locator("capture_dir", self.capture_dir)
    locator("truth_file", self.truth_file)
    if not within(self.truth_file, self.capture_dir):
      raise ValueError(f"{where}: truth_file {self.truth_file!r} is not a file of "
                       f"its capture {self.capture_dir!r}")

  @property
  def measured(self) -> bool:
    return self.status == "ok"

  @property
  def defended(self) -> bool:
    return self.defense != UNDEFENDED

  def to_json(self) -> bytes:
    """Canonical JSON bytes (sorted keys), stable for hashing."""
    return files.canonical_json(dataclasses.asdict(self))

  @classmethod
  def from_json(cls, data: bytes | str | dict,
                source: str = "<json>") -> "AttackRecord":
    """Parses and type-checks a record; `source` names it in errors."""
    if isinstance(data, (bytes, str)):
      try:
        data = json.loads(data)
      except json.JSONDecodeError as e:
        raise ValueError(f"{source}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
      raise ValueError(f"{source}: a record is a JSON object")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    missing = sorted(n for n, f in fields.items() if n not in data and
                     f.default is dataclasses.MISSING)
    unknown = sorted(set(data) - set(fields))
    if missing or unknown:
      raise ValueError(f"{source}: missing fields {missing}, unknown fields "
                       f"{unknown}")
    hints = typing.get_type_hints(cls)
    for name, value in data.items():
      if not _type_ok(value, hints[name]):
        raise ValueError(f"{source}: field {name!r} = {value!r} is not "
                         f"{hints[name]}")
    try:
      return cls(**data)
    except ValueError as e:
      raise ValueError(f"{source}: {e}") from None

  @classmethod
  def load(cls, path: str) -> "AttackRecord":
    with open(path, "rb") as f:
      return cls.from_json(f.read(), source=path)

  def save(self, path: str, overwrite: bool = False) -> None:
    files.atomic_write_bytes(path, self.to_json(), overwrite=overwrite)


def locator(field: str, path: str) -> str:
  """A relative POSIX path (it may climb out with '..'), normalised; raises ValueError."""
  if not isinstance(path, str) or not path or "\\" in path or "\0" in path:
    raise ValueError(f"{field} {path!r}: expected a relative POSIX path")
  if posixpath.isabs(path) or os.path.isabs(path):
    raise ValueError(f"{field} {path!r}: absolute paths are refused (paths are relative "
                     "to the run directory)")
  return posixpath.normpath(path)


def inside(field: str, path: str) -> str:
  """A relative path that stays inside its directory ('..' never escapes); raises."""
  norm = locator(field, path)
  if norm == "." or norm == ".." or norm.startswith("../"):
    raise ValueError(f"{field} {path!r}: leaves its directory")
  return norm


def within(path: str, directory: str) -> bool:
  """Whether relative `path` names a file inside relative `directory`."""
  rel = posixpath.relpath(posixpath.normpath(path), posixpath.normpath(directory))
  return rel != "." and not rel.startswith("..")


def check_files(record: AttackRecord, run_dir: str) -> list[str]:
  """Problems of a record against the files it names, each naming the file: the
  predictions' sha256 (measured records) and the truth file's place in its capture's
  manifest (whose own hash `capture_sha256` is checked by the caller)."""
  from lla.evidence import manifest  # pylint: disable=g-import-not-at-top
  where = f"record {record.run_id!r}"
  problems = []
  if record.status == "ok":
    path = os.path.join(run_dir, inside("prediction_file", record.prediction_file))
    if not os.path.exists(path):
      problems.append(f"{record.prediction_file}: missing ({where})")
    elif files.sha256_file(path) != record.prediction_sha256:
      problems.append(f"{record.prediction_file}: sha256 differs from {where}")
  capture = os.path.join(run_dir, locator("capture_dir", record.capture_dir))
  truth = posixpath.relpath(posixpath.normpath(record.truth_file),
                            posixpath.normpath(record.capture_dir))
  listed = os.path.join(capture, manifest.MANIFEST_NAME)
  if not os.path.exists(os.path.join(run_dir, record.truth_file)):
    problems.append(f"{record.truth_file}: truth file missing ({where})")
  elif os.path.exists(listed) and truth not in manifest.read_manifest(listed)[0]:
    problems.append(f"{record.truth_file}: not listed in its capture's manifest ({where})")
  return problems


def _type_ok(value: Any, hint) -> bool:
  if isinstance(hint, types.UnionType):
    return any(_type_ok(value, h) for h in typing.get_args(hint))
  if hint is type(None):
    return value is None
  if hint is float:  # JSON does not distinguish 3 from 3.0.
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  if hint is int:
    return isinstance(value, int) and not isinstance(value, bool)
  return isinstance(value, hint)
