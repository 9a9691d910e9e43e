"""Laying out and verifying a run directory (docs/run_format.md).

    RUN/protocol.json  predictions/<attack>.npy  records/<attack>.json  inputs/
        protocols/ (studies)  scorecard.json scorecard.md  log.jsonl  seals/
        manifest.sha256

Order of a run: `create` -> `save_predictions` / `save_record` / `save_file` (each
written atomically, then logged with its sha256) -> scorecard -> `finalize` (seal the
log, then write the manifest, which therefore covers the sealed log). `finalize` is
idempotent and completes a run interrupted between the seal and the manifest.

A finished run is extended (more attacks, a new scorecard) by `reopen`: it verifies
the run, appends a `reopen` entry naming the seal and the manifest's sha256, and moves
that manifest to seals/manifest.<seal index>.sha256. `verify` then proves that nothing
changed between the seal and the reopen: the archived manifest's hash of log.jsonl is
the hash of the log up to that seal, and every file it lists is unchanged unless a log
entry after the reopen rewrote or removed it.

`verify` compares every file of predictions/, records/, inputs/, protocols/ and the
scorecard with the sha256 the hash-chained log recorded when it was written, so a
consistent rewrite (a prediction, its record's hash and the manifest) is caught.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os

import numpy as np

from lla.evidence import files
from lla.evidence import hashlog
from lla.evidence import manifest
from lla.evidence import records as records_lib
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
INPUTS = "inputs"
SEALS = "seals"
# Every file of these directories is written by a logged writer, so the log holds its hash.
LOGGED_DIRS = (PREDICTIONS, RECORDS, INPUTS, PROTOCOLS)
# Log events that remove a file they name (a crashed record retried, an orphan discarded).
REMOVALS = ("retry", "discard_orphan", "discard_unlogged")


def e_hash(protocol: dict) -> str:
  """sha256 of the canonical protocol tuple E: the run's identity."""
  return files.sha256_bytes(files.canonical_json(protocol))


def create(run_dir: str, protocol: dict, time: str | None = None) -> str:
  """Creates an empty run directory for `protocol`; returns its e_hash."""
  if os.path.exists(run_dir) and os.listdir(run_dir):
    raise FileExistsError(f"{run_dir}: run directory exists and is not empty")
  for sub in (PREDICTIONS, RECORDS):
    os.makedirs(os.path.join(run_dir, sub), exist_ok=True)
  data = files.canonical_json(protocol)
  files.atomic_write_bytes(os.path.join(run_dir, PROTOCOL), data)
  h = e_hash(protocol)
  log(run_dir).append({"type": "run_started", "e_hash": h, "file": PROTOCOL,
                       "sha256": files.sha256_bytes(data)}, time=time)
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
  rel = f"{PROTOCOLS}/{h}.json"
  if not os.path.exists(os.path.join(run_dir, rel)):
    save_file(run_dir, rel, files.canonical_json(protocol), "protocol", e_hash=h)
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


def save_file(run_dir: str, rel: str, data: bytes, event_type: str, overwrite: bool = False,
              **fields) -> str:
  """Writes `data` to run_dir/rel atomically, then logs {type, file, sha256, **fields}.

  Returns the sha256. `rel` must stay inside the run directory.
  """
  rel = records_lib.inside("file", rel)
  if os.path.exists(os.path.join(run_dir, LOG)) and log(run_dir).sealed:
    # Refused before the file is touched: a sealed run's files stay what its manifest says.
    raise ValueError(f"{run_dir}: run is sealed; reopen it to add {rel} "
                     "(lla.evidence.rundir.extending)")
  path = os.path.join(run_dir, rel)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  files.atomic_write_bytes(path, data, overwrite=overwrite)
  sha = files.sha256_bytes(data)
  log(run_dir).append({"type": event_type, "file": rel, "sha256": sha, **fields})
  return sha


def remove_file(run_dir: str, rel: str, event_type: str, **fields) -> None:
  """Removes a result that is not one (a crashed record, an orphan) and logs it."""
  if event_type not in REMOVALS:
    raise ValueError(f"{event_type!r} is not a removal event ({REMOVALS})")
  rel = records_lib.inside("file", rel)
  os.remove(os.path.join(run_dir, rel))
  log(run_dir).append({"type": event_type, "file": rel, **fields})


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
  return rel, save_file(run_dir, rel, buf.getvalue(), "predictions")


def save_record(run_dir: str, name: str, record) -> str:
  """Writes records/<name>.json (an AttackRecord) and logs its hash."""
  rel = f"{RECORDS}/{name}.json"
  save_file(run_dir, rel, record.to_json(), "record", run_id=record.run_id,
            status=record.status)
  return rel


def logged_files(run_dir: str) -> dict[str, tuple[str, int]]:
  """rel path -> (sha256, log line) of every file the log says is in the run now."""
  path = os.path.join(run_dir, LOG)
  return _file_state(hashlog.entries_of(path) if os.path.exists(path) else [])


def _file_state(entries: list[dict]) -> dict[str, tuple[str, int]]:
  state = {}
  for entry in entries:
    event = entry["event"]
    rel = event.get("file")
    if not isinstance(rel, str):
      continue
    if event["type"] in REMOVALS:
      state.pop(rel, None)
    elif isinstance(event.get("sha256"), str):
      state[rel] = (event["sha256"], entry["_line"])
  return state


def finalize(run_dir: str, time: str | None = None) -> None:
  """Seals the log and writes the manifest over everything, log included.

  Idempotent: a sealed log is not sealed again, and a manifest already there must verify
  (a run interrupted between the seal and the manifest gets its manifest now).
  """
  _complete_reopen(run_dir)
  lg = log(run_dir)
  if not lg.sealed:
    lg.seal(time=time)
  if os.path.exists(os.path.join(run_dir, manifest.MANIFEST_NAME)):
    report = manifest.verify_manifest(run_dir)
    if not report.ok:
      raise ValueError(f"{run_dir}: finalized run's manifest does not verify: "
                       + "; ".join(report.problems()))
    return
  manifest.write_manifest(run_dir)


def reopen(run_dir: str, time: str | None = None) -> bool:
  """Makes a finished (sealed) run writable again; returns whether it was sealed.

  The run must verify first (a run that does not is never extended). The reopen entry
  names the seal and the sha256 of the manifest, which moves to seals/.
  """
  _complete_reopen(run_dir)
  lg = log(run_dir)
  last = lg.last()
  if last is None or last["event"]["type"] != hashlog.SEAL:
    return False
  if not os.path.exists(os.path.join(run_dir, manifest.MANIFEST_NAME)):
    finalize(run_dir)  # Interrupted between the seal and the manifest.
  problems = verify(run_dir, check_capture=False)
  if problems:
    raise ValueError(f"{run_dir}: refusing to extend a run that fails verification: "
                     + "; ".join(problems[:5]))
  sha = files.sha256_file(os.path.join(run_dir, manifest.MANIFEST_NAME))
  entry = lg.reopen(sha, f"{SEALS}/manifest.{last['index']}.sha256", time=time)
  _complete_reopen(run_dir, entry["event"])
  return True


@contextlib.contextmanager
def extending(run_dir: str, always_finalize: bool = False):
  """Writes into a run: reopens it if sealed, and finalizes it on the way out if it was
  sealed (or always, with `always_finalize`), even when the body raised."""
  was_sealed = os.path.exists(os.path.join(run_dir, LOG)) and reopen(run_dir)
  try:
    yield
  finally:
    if (always_finalize or was_sealed) and os.path.exists(os.path.join(run_dir, LOG)):
      finalize(run_dir)


def written_since(run_dir: str, rel: str) -> list[str]:
  """Files of the logged directories written or removed after the log's last entry for
  `rel` (all of them if `rel` was never logged): what a derived file does not reflect."""
  path = os.path.join(run_dir, LOG)
  entries = hashlog.entries_of(path) if os.path.exists(path) else []
  last = max((e["_line"] for e in entries if e["event"].get("file") == rel), default=0)
  return sorted({e["event"]["file"] for e in entries if e["_line"] > last and
                 isinstance(e["event"].get("file"), str) and
                 e["event"]["file"].split("/")[0] in (PREDICTIONS, RECORDS)})


def _complete_reopen(run_dir: str, event: dict | None = None) -> None:
  """Moves the manifest a reopen entry names to seals/ (if a crash left it in place)."""
  if event is None:
    path = os.path.join(run_dir, LOG)
    reopens = [e["event"] for e in (hashlog.entries_of(path) if os.path.exists(path) else [])
               if e["event"]["type"] == hashlog.REOPEN]
    if not reopens:
      return
    event = reopens[-1]
  current = os.path.join(run_dir, manifest.MANIFEST_NAME)
  archived = os.path.join(run_dir, records_lib.inside("manifest_file", event["manifest_file"]))
  if os.path.exists(archived) or not os.path.exists(current):
    return
  if files.sha256_file(current) != event["manifest_sha256"]:
    raise ValueError(f"{current}: not the manifest the reopen entry names; refusing to "
                     "move it")
  os.makedirs(os.path.dirname(archived), exist_ok=True)
  os.rename(current, archived)


def resolve(run_dir: str, path: str) -> str:
  """A record's path (a relative locator, never absolute) joined to the run directory."""
  return os.path.join(run_dir, records_lib.locator("path", path))


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

  Checks the manifest (changed / missing / extra files); the sealed hash chain of the
  log; every logged file against the sha256 the log recorded for it (and every file of
  the logged directories is in the log); each reopen against the manifest it archived;
  the protocol hash in every record, every prediction's sha256, the truth file's place
  in its capture and, if `check_capture`, each capture's manifest hash and contents.
  """
  problems = [f"{manifest.MANIFEST_NAME}: {p}"
              for p in manifest.verify_manifest(run_dir).problems()]
  log_path = os.path.join(run_dir, LOG)
  problems += [f"{LOG}: {p}" for p in hashlog.verify_log(log_path).problems]
  entries = hashlog.entries_of(log_path) if os.path.exists(log_path) else []
  problems += _against_log(run_dir, entries)
  problems += _reopens(run_dir, entries)
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
    problems += records_lib.check_files(r, run_dir)
    if check_capture and r.capture_dir not in captures:
      captures[r.capture_dir] = _check_capture(
          resolve(run_dir, r.capture_dir), r.capture_sha256)
      problems += captures[r.capture_dir]
  return problems


def check_against_log(run_dir: str) -> list[str]:
  """Files of the run that differ from (or are missing in) the hash-chained log: what
  scoring refuses to read. Empty for a run without a log."""
  path = os.path.join(run_dir, LOG)
  return _against_log(run_dir, hashlog.entries_of(path)) if os.path.exists(path) else []


def _logged_paths(run_dir: str) -> list[str]:
  out = [rel for rel in (PROTOCOL, SCORECARD_JSON, SCORECARD_MD)
         if os.path.exists(os.path.join(run_dir, rel))]
  for sub in LOGGED_DIRS:
    if os.path.isdir(os.path.join(run_dir, sub)):
      out += [f"{sub}/{rel}" for rel in manifest.list_files(os.path.join(run_dir, sub))]
  return out


def _against_log(run_dir: str, entries: list[dict]) -> list[str]:
  """Files that differ from the sha256 the log recorded when they were written."""
  state = _file_state(entries)
  problems = []
  for rel, (sha, line) in sorted(state.items()):
    try:
      path = os.path.join(run_dir, records_lib.inside("file", rel))
    except ValueError as e:
      problems.append(f"{LOG}: line {line}: {e}")
      continue
    if not os.path.exists(path):
      problems.append(f"{rel}: missing (written at {LOG} line {line})")
    elif files.sha256_file(path) != sha:
      problems.append(f"{rel}: sha256 differs from the one {LOG} recorded at line {line} "
                      "(changed after it was written)")
  for rel in _logged_paths(run_dir):
    if rel not in state:
      problems.append(f"{rel}: not in {LOG} (written outside the run's logged writers)")
  return problems


def _reopens(run_dir: str, entries: list[dict]) -> list[str]:
  """Each reopen's archived manifest proves the run unchanged between its seal and it."""
  problems = []
  log_lines = None
  for i, entry in enumerate(entries):
    event = entry["event"]
    if event["type"] != hashlog.REOPEN:
      continue
    where = f"{LOG}: line {entry['_line']} (reopen)"
    try:
      rel = records_lib.inside("manifest_file", event.get("manifest_file"))
    except ValueError as e:
      problems.append(f"{where}: {e}")
      continue
    path = os.path.join(run_dir, rel)
    if not os.path.exists(path):
      problems.append(f"{rel}: missing ({where} archived it)")
      continue
    if files.sha256_file(path) != event.get("manifest_sha256"):
      problems.append(f"{rel}: sha256 differs from the one {where} recorded")
      continue
    archived, errors = manifest.read_manifest(path)
    problems += errors
    if log_lines is None:
      with open(os.path.join(run_dir, LOG), "rb") as f:
        log_lines = f.read().split(b"\n")
    seal_line = int(event.get("seal_index", -1)) + 1
    sealed_log = b"".join(l + b"\n" for l in log_lines[:seal_line])
    if archived.get(LOG) != files.sha256_bytes(sealed_log):
      problems.append(f"{rel}: its {LOG} hash is not that of the log up to the seal "
                      f"{where} follows (the log was rewritten)")
    later = {e["event"].get("file") for e in entries[i + 1:]}
    for name, sha in sorted(archived.items()):
      if name == LOG or name in later:
        continue
      current = os.path.join(run_dir, name)
      if not os.path.exists(current):
        problems.append(f"{name}: removed after the seal {where} follows, with no log entry")
      elif files.sha256_file(current) != sha:
        problems.append(f"{name}: changed after the seal {where} follows, with no log entry")
  return problems


def _check_capture(capture_dir: str, expected: str) -> list[str]:
  path = os.path.join(capture_dir, manifest.MANIFEST_NAME)
  if not os.path.exists(path):
    return [f"{path}: capture manifest missing"]
  if files.sha256_file(path) != expected:
    return [f"{path}: sha256 differs from the records' capture_sha256"]
  return [f"capture {capture_dir}: {p}"
          for p in manifest.verify_manifest(capture_dir).problems()]
