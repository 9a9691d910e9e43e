"""Laying out and verifying a run directory (docs/run_format.md).

    RUN/protocol.json  predictions/<attack>.npy  records/<attack>.json
        scorecard.json scorecard.md  log.jsonl  manifest.sha256

Order of a run: `create` -> `save_predictions` / `save_record` (each logged)
-> scorecard -> `finalize` (seal the log, then write the manifest, which
therefore covers the sealed log).
"""

import datetime
import io
import os

import numpy as np

from lla.evidence import files
from lla.evidence import hashlog
from lla.evidence import manifest
from lla.evidence.records import AttackRecord

PROTOCOL = "protocol.json"
PREDICTIONS = "predictions"
RECORDS = "records"
SCORECARD_JSON = "scorecard.json"
SCORECARD_MD = "scorecard.md"
LOG = "log.jsonl"
# A study holds the records of several protocol tuples (the main table: depths,
# knowledge settings, defenses): protocol.json is then a header, and each E is stored
# as protocols/<e_hash>.json.
STUDY_SCHEMA = "lla.study.v1"
PROTOCOLS = "protocols"


def e_hash(protocol: dict) -> str:
  """sha256 of the canonical protocol tuple E: the run's identity."""
  return files.sha256_bytes(files.canonical_json(protocol))


def create(run_dir: str, protocol: dict, time: str | None = None) -> str:
  """Creates an empty run directory for `protocol`; returns its e_hash."""
  if os.path.exists(run_dir) and os.listdir(run_dir):
    raise FileExistsError(f"{run_dir}: run directory exists and is not empty")
  for sub in (PREDICTIONS, RECORDS):
    os.makedirs(os.path.join(run_dir, sub), exist_ok=True)
  files.atomic_write_json(os.path.join(run_dir, PROTOCOL), protocol)
  h = e_hash(protocol)
  log(run_dir).append({"type": "run_started", "e_hash": h}, time=time)
  return h


def create_study(run_dir: str, header: dict) -> None:
  """Creates an empty study directory; `header` holds at least G (policy)."""
  create(run_dir, {"schema": STUDY_SCHEMA, **header})
  os.makedirs(os.path.join(run_dir, PROTOCOLS), exist_ok=True)


def is_study(run_dir: str) -> bool:
  path = os.path.join(run_dir, PROTOCOL)
  return os.path.exists(path) and files.read_json(path).get("schema") == STUDY_SCHEMA


def add_protocol(run_dir: str, protocol: dict) -> str:
  """Stores one E of a study (idempotent); returns its e_hash."""
  h = e_hash(protocol)
  path = os.path.join(run_dir, PROTOCOLS, f"{h}.json")
  if not os.path.exists(path):
    files.atomic_write_json(path, protocol)
    log(run_dir).append({"type": "protocol", "e_hash": h})
  return h


def _accepted_e_hashes(run_dir: str) -> tuple[set[str], list[str]]:
  """The e_hashes records may name, and problems with stored protocols."""
  path = os.path.join(run_dir, PROTOCOL)
  header = files.read_json(path)
  accepted = {e_hash(header), files.sha256_file(path)}
  problems = []
  if header.get("schema") == STUDY_SCHEMA:
    directory = os.path.join(run_dir, PROTOCOLS)
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
      h = e_hash(files.read_json(os.path.join(directory, name)))
      if name != f"{h}.json":
        problems.append(f"{PROTOCOLS}/{name}: content hashes to {h[:12]}..., not its name")
      accepted.add(h)
  return accepted, problems


def log(run_dir: str) -> hashlog.HashLog:
  return hashlog.HashLog(os.path.join(run_dir, LOG))


def save_predictions(run_dir: str, name: str,
                     tokens: np.ndarray) -> tuple[str, str]:
  """Writes predictions/<name>.npy ([B, T] int32); returns (relpath, sha256)."""
  tokens = np.asarray(tokens)
  if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f"predictions {name!r}: expected [B, T] integers, got "
                     f"{tokens.dtype}{list(tokens.shape)}")
  buf = io.BytesIO()
  np.save(buf, tokens.astype(np.int32), allow_pickle=False)
  rel = f"{PREDICTIONS}/{name}.npy"
  files.atomic_write_bytes(os.path.join(run_dir, rel), buf.getvalue())
  sha = files.sha256_bytes(buf.getvalue())
  log(run_dir).append({"type": "predictions", "file": rel, "sha256": sha})
  return rel, sha


def save_record(run_dir: str, name: str, record) -> str:
  """Writes records/<name>.json (an AttackRecord) and logs its hash."""
  rel = f"{RECORDS}/{name}.json"
  data = record.to_json()
  files.atomic_write_bytes(os.path.join(run_dir, rel), data)
  log(run_dir).append({"type": "record", "file": rel, "run_id": record.run_id,
                       "status": record.status,
                       "sha256": files.sha256_bytes(data)})
  return rel


def finalize(run_dir: str, time: str | None = None) -> None:
  """Seals the log and writes the manifest over everything, log included."""
  log(run_dir).seal(time=time)
  manifest.write_manifest(run_dir)


def resolve(run_dir: str, path: str) -> str:
  """A record's path, relative to the run directory unless absolute."""
  return path if os.path.isabs(path) else os.path.join(run_dir, path)


def load_predictions(path: str) -> np.ndarray:
  return files.load_token_matrix(path, "predictions")


def load_truth(path: str) -> np.ndarray:
  """tokens [B, T] int32 from a capture's truth.safetensors."""
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  try:
    tensors = load_file(path)
  except FileNotFoundError:
    raise FileNotFoundError(f"{path}: truth file not found") from None
  except Exception as e:  # safetensors raises its own error types.
    raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
  if "tokens" not in tensors:
    raise ValueError(f"{path}: no tensor 'tokens' (has {sorted(tensors)})")
  tokens = tensors["tokens"]
  if tokens.ndim != 2 or tokens.dtype != np.int32:
    raise ValueError(f"{path}: tokens is {tokens.dtype}{list(tokens.shape)}, "
                     "expected int32 [B, T]")
  return tokens


def run_started(run_dir: str) -> datetime.date | None:
  """Date of the log's first entry, or None without a readable log."""
  path = os.path.join(run_dir, LOG)
  if not os.path.exists(path):
    return None
  try:
    first = hashlog.HashLog(path).entries()[0]
    return datetime.datetime.fromisoformat(first["time"]).date()
  except (ValueError, IndexError):
    return None


def load_records(run_dir: str) -> list:
  """All records/*.json, sorted by run_id; run_ids must be unique."""
  rec_dir = os.path.join(run_dir, RECORDS)
  if not os.path.isdir(rec_dir):
    raise FileNotFoundError(f"{rec_dir}: records directory missing")
  records, seen = [], {}
  for name in sorted(os.listdir(rec_dir)):
    if not name.endswith(".json"):
      continue
    path = os.path.join(rec_dir, name)
    r = AttackRecord.load(path)
    if r.run_id in seen:
      raise ValueError(f"{path}: run_id {r.run_id!r} already used by "
                       f"{seen[r.run_id]}")
    seen[r.run_id] = path
    records.append(r)
  return sorted(records, key=lambda r: r.run_id)


def verify(run_dir: str, check_capture: bool = True) -> list[str]:
  """Every problem with a finished run directory, each naming its file.

  Checks the manifest (changed / missing / extra files), the sealed hash
  chain of the log, the protocol hash in every record, every prediction's
  sha256, the presence of truth files and, if `check_capture`, each capture's
  manifest hash and contents.
  """
  problems = [f"{manifest.MANIFEST_NAME}: {p}"
              for p in manifest.verify_manifest(run_dir).problems()]
  problems += [f"{LOG}: {p}" for p in
               hashlog.verify_log(os.path.join(run_dir, LOG)).problems]
  try:
    accepted, protocol_problems = _accepted_e_hashes(run_dir)
  except (FileNotFoundError, ValueError) as e:
    return problems + [str(e)]
  problems += protocol_problems
  try:
    records = load_records(run_dir)
  except (FileNotFoundError, ValueError) as e:
    return problems + [str(e)]
  captures = {}
  for r in records:
    where = f"record {r.run_id!r}"
    if r.e_hash not in accepted:
      problems.append(f"{where}: e_hash {r.e_hash[:12]}... does not match "
                      f"{PROTOCOL}")
    if r.status == "ok":
      p = resolve(run_dir, r.prediction_file)
      if not os.path.exists(p):
        problems.append(f"{r.prediction_file}: missing ({where})")
      elif files.sha256_file(p) != r.prediction_sha256:
        problems.append(f"{r.prediction_file}: sha256 differs from {where}")
      if not os.path.exists(resolve(run_dir, r.truth_file)):
        problems.append(f"{r.truth_file}: truth file missing ({where})")
    if check_capture and r.capture_dir not in captures:
      captures[r.capture_dir] = _check_capture(
          resolve(run_dir, r.capture_dir), r.capture_sha256)
      problems += captures[r.capture_dir]
  return problems


def _check_capture(capture_dir: str, expected: str) -> list[str]:
  path = os.path.join(capture_dir, manifest.MANIFEST_NAME)
  if not os.path.exists(path):
    return [f"{path}: capture manifest missing"]
  if files.sha256_file(path) != expected:
    return [f"{path}: sha256 differs from the records' capture_sha256"]
  return [f"capture {capture_dir}: {p}"
          for p in manifest.verify_manifest(capture_dir).problems()]
