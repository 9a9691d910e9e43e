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
consistent rewrite (a prediction, its record's hash and the manifest) is caught. A
rewrite that also re-chains the whole log is caught only against the seal's hash
published elsewhere (`anchor`, printed by experiments/verify.py).

Crash safety: a writer interrupted between writing a file and logging it leaves a file the
log does not hold. The next writer of that file (`save_file`, hence `create`,
`add_protocol` and the replay's pinned inputs) logs it as `recovered` when its bytes are
those it re-derives from its inputs, and otherwise removes it with a logged
`discard_unlogged` entry and writes it again; removals are logged before the file goes.
A writer that raised is still finalized (`extending`): `finalize` discards (logged) what
the log does not hold before it seals, so the sealed run verifies and can be reopened.

One writer at a time: `locked` (taken by `extending` and by the replay driver) holds an
flock on RUN/.lock naming the holder's pid, host and start time; a second writer waits or
is refused with one line naming it. The kernel releases the lock when its holder dies.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import io
import json
import os
import socket
import time as time_lib

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
CELLS = "cells"  # a sweep study's finished cells (lla.sweep.study)
LOGGED_DIRS = (PREDICTIONS, RECORDS, INPUTS, PROTOCOLS, CELLS)
# Log events that remove a file they name (a crashed record retried, an orphan discarded).
REMOVALS = ("retry", "discard_orphan", "discard_unlogged", "supersede")
# A file found written but not logged (a writer interrupted between the two) whose bytes equal
# those re-derived from the writer's inputs: logged then with this event, naming the event
# it was written for (`written_as`).
RECOVERED = "recovered"
# The run directory's lock (flock): one writer at a time. Never part of the run (the manifest
# does not list it); removed when its holder releases it, released by the kernel when the
# holder dies.
LOCK = manifest.LOCK_NAME


class RunLockedError(ValueError):
  """Another process is writing the run directory; the message names it (pid, host, since)."""


def e_hash(protocol: dict) -> str:
  """sha256 of the canonical protocol tuple E: the run's identity."""
  return files.sha256_bytes(files.canonical_json(protocol))


def create(run_dir: str, protocol: dict, time: str | None = None) -> str:
  """Creates an empty run directory for `protocol`; returns its e_hash.

  A directory left by a `create` interrupted between writing protocol.json and logging it
  (nothing else in it, no log) is taken over: protocol.json is logged as `recovered` if it
  holds `protocol`, else discarded (logged) and written anew.
  """
  if started(run_dir) or _present_files(run_dir) not in ([], [PROTOCOL]):
    raise FileExistsError(f"{run_dir}: run directory exists and is not empty")
  for sub in (PREDICTIONS, RECORDS):
    os.makedirs(os.path.join(run_dir, sub), exist_ok=True)
  h = e_hash(protocol)
  _write_logged(run_dir, PROTOCOL, files.canonical_json(protocol),
                {"type": "run_started", "e_hash": h}, time=time)
  return h


def _present_files(run_dir: str) -> list[str]:
  """Every file below `run_dir` but its lock (empty if it does not exist)."""
  if not os.path.isdir(run_dir):
    return []
  return [rel for rel in manifest.list_files(run_dir) if rel != LOCK]


def started(run_dir: str) -> bool:
  """Whether `run_dir` is a run: its log exists (it is created with protocol.json's entry)."""
  return os.path.exists(os.path.join(run_dir, LOG))


def is_run_dir(run_dir: str) -> bool:
  """Whether `run_dir` may be written as a run: absent, empty (but for a lock left by a
  holder that died, or the leftovers of an interrupted `create`), or a run."""
  if not os.path.exists(run_dir):
    return True
  if not os.path.isdir(run_dir):
    return False
  return started(run_dir) or _present_files(run_dir) in ([], [PROTOCOL])


def create_study(run_dir: str, header: dict) -> None:
  """Creates an empty study directory; `header` holds at least G (policy)."""
  create(run_dir, {"schema": STUDY_SCHEMA, **header})
  os.makedirs(os.path.join(run_dir, PROTOCOLS), exist_ok=True)


def is_study(run_dir: str) -> bool:
  path = os.path.join(run_dir, PROTOCOL)
  return os.path.exists(path) and files.read_json(path).get("schema") == STUDY_SCHEMA


def add_protocol(run_dir: str, protocol: dict) -> str:
  """Stores one E of a study (idempotent); returns its e_hash.

  A protocols/<e_hash>.json written but never logged (an interruption between the two) is
  logged now as `recovered` when it holds `protocol` (its hash re-derived from E), else
  discarded and written again (save_file).
  """
  h = e_hash(protocol)
  rel = f"{PROTOCOLS}/{h}.json"
  if rel not in logged_files(run_dir):
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

  Returns the sha256. `rel` must stay inside the run directory. A file already there that
  the log does not hold (written, then interrupted before its log entry) is not a result:
  if its bytes are `data` (re-derived by the caller from the same inputs) it is logged as
  {type: "recovered", written_as: event_type, file, sha256, **fields}; otherwise it is
  removed with a logged `discard_unlogged` entry and `data` written in its place. A logged
  file is never overwritten unless `overwrite`.
  """
  return _write_logged(run_dir, records_lib.inside("file", rel), data,
                       {"type": event_type, **fields}, overwrite=overwrite)


def _write_logged(run_dir: str, rel: str, data: bytes, event: dict, overwrite: bool = False,
                  time: str | None = None) -> str:
  if started(run_dir) and log(run_dir).sealed:
    # Refused before the file is touched: a sealed run's files stay what its manifest says.
    raise ValueError(f"{run_dir}: run is sealed; reopen it to add {rel} "
                     "(lla.evidence.rundir.extending)")
  path = os.path.join(run_dir, rel)
  sha = files.sha256_bytes(data)
  fields = {k: v for k, v in event.items() if k != "type"}
  if os.path.exists(path) and rel not in logged_files(run_dir):
    if files.sha256_file(path) == sha:
      log(run_dir).append({"type": RECOVERED, "written_as": event["type"], "file": rel,
                           "sha256": sha, **fields}, time=time)
      return sha
    remove_file(run_dir, rel, "discard_unlogged",
                reason="written but never logged, and not the bytes its inputs give")
  elif overwrite and rel in logged_files(run_dir) and files.sha256_file(path) != sha:
    logged = logged_files(run_dir)[rel]
    if files.sha256_file(path) != logged[0]:
      raise ValueError(f"{path}: differs from the sha256 {LOG} recorded at line {logged[1]}; "
                       "refusing to replace it: run verify")
    # Replacing a logged file (a threat space, a scorecard): its removal is logged first,
    # so that a crash between the new bytes and their entry leaves a file the log does not
    # hold (discarded or recovered by the next writer, discarded by finalize), never a
    # logged file whose bytes differ from the log, which verifies no more and so could
    # never be reopened.
    log(run_dir).append({"type": "supersede", "file": rel,
                         "sha256_before": files.sha256_file(path)}, time=time)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  files.atomic_write_bytes(path, data, overwrite=overwrite)
  log(run_dir).append({"type": event["type"], "file": rel, "sha256": sha, **fields}, time=time)
  return sha


def remove_file(run_dir: str, rel: str, event_type: str, **fields) -> None:
  """Removes a result that is not one (a crashed record, an orphan) and logs it.

  The removal is logged first: an interruption before the file is gone leaves a file the
  log does not hold, which the next writer discards (or recovers) again, never a logged
  file that is missing.
  """
  if event_type not in REMOVALS:
    raise ValueError(f"{event_type!r} is not a removal event ({REMOVALS})")
  rel = records_lib.inside("file", rel)
  log(run_dir).append({"type": event_type, "file": rel, **fields})
  with contextlib.suppress(FileNotFoundError):
    os.remove(os.path.join(run_dir, rel))


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


def finished_record(run_dir: str, name: str):
  """The stored record records/<name>.json if it finished and its predictions are intact;
  None where the attack must run (again). What every resuming writer of records calls.

  A crashed attack's record, a record written but never logged, and predictions whose
  record was never logged (an interruption between two writes) are not results: they
  are removed, logged (`retry`, `discard_unlogged`, `discard_orphan`), so that writing
  them again succeeds. A logged file that differs from its log entry is refused.
  """
  rel_record, rel_predictions = f"{RECORDS}/{name}.json", f"{PREDICTIONS}/{name}.npy"
  path = os.path.join(run_dir, rel_record)
  if os.path.exists(path):
    logged = logged_files(run_dir).get(rel_record)
    if logged is None:
      remove_file(run_dir, rel_record, "discard_unlogged")
    elif logged[0] != files.sha256_file(path):
      raise ValueError(f"{path}: differs from the sha256 the run's log recorded (line "
                       f"{logged[1]}); refusing to resume over it: run verify")
    else:
      record = AttackRecord.load(path)
      if record.status == "ok":
        stored = resolve(run_dir, record.prediction_file)
        if not os.path.exists(stored) or files.sha256_file(stored) != record.prediction_sha256:
          raise ValueError(f"{stored}: predictions missing or changed since {path} was "
                           "written; refusing to resume over them")
        return record
      remove_file(run_dir, rel_record, "retry", attack=name, previous_status=record.status)
  if os.path.exists(os.path.join(run_dir, rel_predictions)):
    remove_file(run_dir, rel_predictions, "discard_orphan")
  return None


def read_logged_json(run_dir: str, rel: str):
  """The JSON of run file `rel` as the log holds it: None where it is absent or was written
  but never logged (an interrupted writer's leftover, which its next write discards or
  recovers and finalize discards).

  Raises:
    ValueError naming the file when its bytes differ from the log's entry.
  """
  path = os.path.join(run_dir, rel)
  if not os.path.exists(path):
    return None
  logged = logged_files(run_dir).get(rel)
  if logged is None:
    return None
  if logged[0] != files.sha256_file(path):
    raise ValueError(f"{path}: differs from the sha256 {LOG} recorded at line {logged[1]} "
                     "(changed after it was written); run verify")
  return files.read_json(path)


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
  (a run interrupted between the seal and the manifest gets its manifest now). Files the
  log does not hold are removed (each with a logged `discard_unlogged`) before the seal.
  """
  _complete_reopen(run_dir)
  lg = log(run_dir)
  if not lg.sealed:
    # A writer stopped by an exception between a file and its log entry is finalized on its
    # way out (`extending`): what the log does not hold is no part of the sealed run.
    for rel in unlogged(run_dir):
      if rel != PROTOCOL:  # The header stays (verify names it); `create` recovers it.
        remove_file(run_dir, rel, "discard_unlogged", reason="not logged when the run was sealed")
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
def extending(run_dir: str, always_finalize: bool = False, lock_wait_s: float = 0.0):
  """Writes into a run: takes its lock (`locked`), reopens it if sealed, and finalizes it on
  the way out if it was sealed (or always, with `always_finalize`), even when the body
  raised."""
  with locked(run_dir, lock_wait_s):
    was_sealed = os.path.exists(os.path.join(run_dir, LOG)) and reopen(run_dir)
    try:
      yield
    finally:
      if (always_finalize or was_sealed) and os.path.exists(os.path.join(run_dir, LOG)):
        finalize(run_dir)


# (device, inode) of a run directory -> [fd of its lock file, nesting depth] for the locks
# this process holds: a holder may take its own lock again (a replay inside `extending`).
# Keyed by the directory's identity, not its path: module state that an attack could read
# while the replay holds the lock names no run (tests/isolation_probe.py).
_HELD: dict[tuple[int, int], list] = {}


def _identity(run_dir: str) -> tuple[int, int] | None:
  try:
    st = os.stat(run_dir)
  except FileNotFoundError:
    return None
  return st.st_dev, st.st_ino


def lock_holder(run_dir: str) -> dict | None:
  """{pid, host, since} of the process that holds (or last held) the run's lock, or None."""
  try:
    with open(os.path.join(run_dir, LOCK), "rb") as f:
      holder = json.loads(f.read().decode("utf-8"))
  except (OSError, ValueError):
    return None
  return holder if isinstance(holder, dict) else None


def _holder_text(holder: dict | None) -> str:
  if not holder:
    return "a process that has not yet written its name into the lock"
  return (f"pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('since')}"
          + (f", {holder['what']}" if holder.get("what") else ""))


@contextlib.contextmanager
def locked(run_dir: str, wait_s: float = 0.0, what: str = ""):
  """Holds the run directory's lock (an flock on RUN/.lock) for the body: one writer at a
  time. The holder's pid, host and start time are written into the lock file; the lock is
  released (and its file removed) on the way out, and by the kernel if the process dies.

  Re-entrant within a process. A directory that does not exist is created (and removed
  again on the way out if nothing was written into it).

  Raises:
    RunLockedError: another process holds the lock and did not release it within `wait_s`
      seconds (0: refused at once); the message names the holder.
  """
  key = _identity(run_dir)
  if key is not None and key in _HELD:
    _HELD[key][1] += 1
    try:
      yield
    finally:
      _HELD[key][1] -= 1
    return
  created = False
  path = os.path.join(run_dir, LOCK)
  deadline = time_lib.monotonic() + max(0.0, float(wait_s))
  while True:
    if not os.path.isdir(run_dir):  # (again: a holder that made it removes it when empty)
      os.makedirs(run_dir, exist_ok=True)
      created = True
    try:
      fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except FileNotFoundError:  # removed between the two
      continue
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      os.close(fd)
      if time_lib.monotonic() >= deadline:
        holder = lock_holder(run_dir)
        if created:
          _remove_if_empty(run_dir)
        waited = f" (waited {float(wait_s):g} s)" if wait_s else ""
        raise RunLockedError(
            f"{run_dir}: another writer holds this run directory's lock ({_holder_text(holder)})"
            f"{waited}; retry when it has finished, or use another run directory") from None
      time_lib.sleep(0.2)
      continue
    # The previous holder removes the file as it releases: a lock taken on a removed file
    # locks nothing, so take it again on the file now at `path`.
    try:
      same = os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
      same = False
    if same:
      break
    os.close(fd)
  holder = {"pid": os.getpid(), "host": socket.gethostname(),
            "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
  if what:
    holder["what"] = what
  os.ftruncate(fd, 0)
  os.pwrite(fd, json.dumps(holder, sort_keys=True).encode("utf-8"), 0)
  key = _identity(run_dir)
  _HELD[key] = [fd, 1]
  try:
    yield
  finally:
    del _HELD[key]
    with contextlib.suppress(FileNotFoundError):
      os.remove(path)
    os.close(fd)
    if created:
      _remove_if_empty(run_dir)


def _remove_if_empty(run_dir: str) -> None:
  with contextlib.suppress(OSError):
    os.rmdir(run_dir)


def anchor(run_dir: str) -> dict | None:
  """The run's seal, the anchor to publish beside its results: {"hash", "index"} of the last
  log entry when it is a seal (None for an unsealed run or no log). The seal's hash chains
  every entry before it, so it commits to every logged file's sha256; a run rewritten and
  re-chained from scratch verifies on its own, but not against this hash."""
  last = log(run_dir).last() if started(run_dir) else None
  if last is None or last["event"].get("type") != hashlog.SEAL:
    return None
  return {"hash": last["hash"], "index": last["index"]}


def written_since(run_dir: str, rel: str) -> list[str]:
  """Files of the logged directories written or removed after the log's last entry for
  `rel` (all of them if `rel` was never logged): what a derived file does not reflect."""
  path = os.path.join(run_dir, LOG)
  entries = hashlog.entries_of(path) if os.path.exists(path) else []
  last = max((e["_line"] for e in entries if e["event"].get("file") == rel), default=0)
  return sorted({e["event"]["file"] for e in entries if e["_line"] > last and
                 isinstance(e["event"].get("file"), str) and
                 e["event"]["file"].split("/")[0] in (PREDICTIONS, RECORDS)})


def unlogged(run_dir: str) -> list[str]:
  """Files of the run's logged paths that the log does not hold (written, then interrupted
  before their log entry)."""
  state = logged_files(run_dir)
  return [rel for rel in _logged_paths(run_dir) if rel not in state]


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
