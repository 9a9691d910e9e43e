"""Append-only, hash-chained JSONL log.

Line i is the canonical JSON of
  {"index": i, "prev": <hash of line i-1, or 64 zeros>, "time": ISO-8601 UTC,
   "event": {...}, "hash": sha256(canonical JSON of the other four fields)}.
Editing an entry breaks its own hash; deleting, inserting or reordering breaks
the index sequence and the `prev` links, located at the first line affected.
Truncating the tail is only visible against an anchor, so a finished log ends
with a `seal` entry that states how many entries precede it (and the run's
manifest covers the log file).

A sealed log is extended only through a `reopen` entry that names the seal it
follows (its index and hash) and the sha256 of the manifest that covered the
sealed log (lla.evidence.rundir archives that manifest, so that `verify` can
show nothing changed between the seal and the reopen). A log verifies as
finished only if its last entry is a seal.

Appending is O(1): the line is appended and fsync'ed, and the chain head is
read back from the file's tail. The whole chain is verified once per process
when a log is first appended to, and again whenever the file is not what this
process last wrote (another writer, an edit). A torn final line (an append
interrupted mid-write, never acknowledged) is cut off before the next append,
and the cut is logged as a `repair` entry naming its size and sha256.
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import json
import os

from absl import logging

from lla.evidence import files

GENESIS = "0" * 64
SEAL = "seal"
REOPEN = "reopen"
REPAIR = "repair"
_FIELDS = ("index", "prev", "time", "event", "hash")
_TAIL_BLOCK = 1 << 16


def entry_hash(entry: dict) -> str:
  body = {k: entry[k] for k in ("index", "prev", "time", "event")}
  return files.sha256_bytes(files.canonical_json(body))


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds")


@dataclasses.dataclass(frozen=True)
class LogReport:
  """Verification result: `problems` are 'line N: ...' strings, first first."""
  n_entries: int
  sealed: bool
  head: str
  problems: tuple[str, ...]

  @property
  def ok(self) -> bool:
    return not self.problems


@dataclasses.dataclass(frozen=True)
class _Head:
  """What this process knows of a log it verified: the last entry and the file's state
  right after this process last wrote it."""
  n_entries: int
  last: dict | None
  size: int
  mtime_ns: int
  inode: int


# (device, inode) of the log file -> _Head of every log this process verified or appended
# to. Keyed by the file's identity, not its path: module state that an attack could read
# holds no path to a run (tests/isolation_probe.py walks module globals).
_HEADS: dict[tuple[int, int], _Head] = {}


class HashLog:
  """An append-only hash-chained log stored at `path`."""

  def __init__(self, path: str):
    self.path = path

  def entries(self) -> list[dict]:
    """The log's entries; raises ValueError naming the file if it is broken."""
    report = verify_log(self.path, require_sealed=False)
    if not report.ok:
      raise ValueError(f"{self.path}: log fails verification: "
                       + "; ".join(report.problems))
    return [_strip(e) for e in _parse(_read(self.path))[0]]

  def last(self) -> dict | None:
    """The last complete entry, read from the tail (not verified; None if empty)."""
    if not os.path.exists(self.path):
      return None
    with open(self.path, "rb") as f:
      return _tail_entry(f)[0]

  @property
  def sealed(self) -> bool:
    last = self.last()
    return last is not None and last["event"].get("type") == SEAL

  def append(self, event: dict, time: str | None = None) -> dict:
    """Appends `event`; refuses to extend a broken log, or a sealed one except with
    a `reopen` entry naming that seal (see `reopen`)."""
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
      raise ValueError(f"{self.path}: an event is a dict with a 'type' key")
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    with os.fdopen(fd, "r+b") as f:
      fcntl.flock(f.fileno(), fcntl.LOCK_EX)
      head = self._head(f)
      last = head.last
      if last is not None and last["event"]["type"] == SEAL:
        if event["type"] != REOPEN:
          raise ValueError(f"{self.path}: log is sealed; nothing may follow but a "
                           "reopen entry (lla.evidence.rundir.reopen)")
        if (event.get("seal_index"), event.get("seal_hash")) != (last["index"], last["hash"]):
          raise ValueError(f"{self.path}: a reopen entry must name the seal it follows "
                           f"(entry {last['index']})")
      elif event["type"] == REOPEN:
        raise ValueError(f"{self.path}: only a sealed log can be reopened")
      return self._write(f, head, event, time).last

  def seal(self, time: str | None = None) -> dict:
    """Appends the seal entry, which states how many entries precede it."""
    return self.append({"type": SEAL, "n_entries": self._count()}, time=time)

  def reopen(self, manifest_sha256: str, manifest_file: str,
             time: str | None = None) -> dict:
    """Extends a sealed log: the entry names the seal and the manifest that covered it."""
    last = self.last()
    if last is None or last["event"].get("type") != SEAL:
      raise ValueError(f"{self.path}: only a sealed log can be reopened")
    return self.append({"type": REOPEN, "seal_index": last["index"],
                        "seal_hash": last["hash"], "manifest_sha256": manifest_sha256,
                        "manifest_file": manifest_file}, time=time)

  def _count(self) -> int:
    last = self.last()
    return 0 if last is None else last["index"] + 1

  def _head(self, f) -> _Head:
    """The verified head of the open, locked log `f`."""
    stat = os.fstat(f.fileno())
    known = _HEADS.get((stat.st_dev, stat.st_ino))
    last, torn = _tail_entry(f)
    if (known is not None and not torn and
        (known.size, known.mtime_ns, known.inode) == (stat.st_size, stat.st_mtime_ns,
                                                      stat.st_ino) and
        (known.last or {}).get("hash") == (last or {}).get("hash")):
      return known
    return self._verify_fully(f, torn)

  def _verify_fully(self, f, torn: bytes) -> _Head:
    """Verifies the whole chain once; cuts off a torn final line (logging the cut)."""
    f.seek(0)
    data = f.read()
    data = data[:len(data) - len(torn)]
    entries, problems = _parse(data)
    problems += _chain_problems(entries)[0]
    if problems:
      raise ValueError(f"{self.path}: log fails verification: " + "; ".join(problems))
    head = _Head(len(entries), _strip(entries[-1]) if entries else None, 0, 0, 0)
    if torn:
      logging.warning("%s: cutting off a torn final line of %d bytes (an interrupted "
                      "append that never completed)", self.path, len(torn))
      f.truncate(len(data))
      f.flush()
      os.fsync(f.fileno())
      # A sealed log takes nothing but a reopen, so the cut is only logged as a warning.
      if head.last is None or head.last["event"]["type"] != SEAL:
        return self._write(f, head, {"type": REPAIR, "torn_bytes": len(torn),
                                     "torn_sha256": files.sha256_bytes(torn)}, None)
    return self._remember(f, head.n_entries, head.last)

  def _write(self, f, head: _Head, event: dict, time: str | None) -> _Head:
    entry = {"index": head.n_entries, "prev": head.last["hash"] if head.last else GENESIS,
             "time": time or _now(), "event": event}
    entry["hash"] = entry_hash(entry)
    f.seek(0, os.SEEK_END)
    f.write(files.canonical_json(entry))
    f.flush()
    os.fsync(f.fileno())
    return self._remember(f, head.n_entries + 1, entry)

  def _remember(self, f, n_entries: int, last: dict | None) -> _Head:
    stat = os.fstat(f.fileno())
    head = _Head(n_entries, last, stat.st_size, stat.st_mtime_ns, stat.st_ino)
    _HEADS[(stat.st_dev, stat.st_ino)] = head
    return head


def _strip(entry: dict) -> dict:
  return {k: v for k, v in entry.items() if k != "_line"}


def _read(path: str) -> bytes:
  with open(path, "rb") as f:
    return f.read()


def _tail_entry(f) -> tuple[dict | None, bytes]:
  """(last complete entry or None, the bytes of a torn final line or b"") of an open log,
  read from its tail."""
  end = f.seek(0, os.SEEK_END)
  block = min(end, _TAIL_BLOCK)
  while end:
    f.seek(end - block)
    data = f.read(block)
    last_newline = data.rfind(b"\n")
    start = data.rfind(b"\n", 0, max(last_newline, 0))
    if (last_newline < 0 or start < 0) and block < end:
      block = min(end, 2 * block)
      continue
    if last_newline < 0:
      return None, data
    torn, line = data[last_newline + 1:], data[start + 1:last_newline]
    try:
      entry = json.loads(line.decode("utf-8"))
    except ValueError:
      return None, torn
    return (entry if _field_problem(entry) is None else None), torn
  return None, b""


def _field_problem(entry: dict) -> str | None:
  """Why a parsed JSON object is not a well-typed log entry (None if it is)."""
  if not isinstance(entry, dict) or set(entry) != set(_FIELDS):
    return "not a log entry"
  if not isinstance(entry["index"], int) or isinstance(entry["index"], bool) \
      or entry["index"] < 0:
    return f"not a log entry (index {entry['index']!r} is not a non-negative integer)"
  if not all(isinstance(entry[k], str) for k in ("prev", "time", "hash")):
    return "not a log entry (prev, time and hash must be strings)"
  if not isinstance(entry["event"], dict) or not isinstance(entry["event"].get("type"), str):
    return "not a log entry (event must be an object with a string 'type')"
  return None


def _parse(data: bytes) -> tuple[list[dict], list[str]]:
  """Entries that parse, plus problems for lines that do not."""
  lines = data.split(b"\n")
  torn = lines[-1] != b""
  if not torn:
    lines = lines[:-1]
  entries, problems = [], []
  for i, raw in enumerate(lines, 1):
    try:
      entry = json.loads(raw.decode("utf-8"))
    except ValueError:
      entry, why = None, "not a log entry"
    else:
      why = _field_problem(entry)
    if why is None:
      entry["_line"] = i
      entries.append(entry)
    else:
      problems.append(f"line {i}: " + ("torn final line (truncated write)"
                                       if torn and i == len(lines) else why))
  return entries, problems


def _chain_problems(entries: list[dict]) -> tuple[list[str], bool, str]:
  """(problems, ends with a seal, head hash) of parsed entries, in order."""
  present = {e["index"] for e in entries}
  problems = []
  prev_hash, prev_index, seal = GENESIS, -1, None
  for e in entries:
    line = e["_line"]
    event = e["event"]
    if seal is not None and not (event["type"] == REOPEN and
                                 event.get("seal_index") == seal["index"] and
                                 event.get("seal_hash") == seal["hash"]):
      problems.append(f"line {line}: entry after the seal (appended later)")
    if seal is None and event["type"] == REOPEN:
      problems.append(f"line {line}: reopen entry that follows no seal")
    if entry_hash(e) != e["hash"]:
      problems.append(f"line {line}: entry {e['index']} edited "
                      "(its hash does not match its contents)")
    skipped = range(prev_index + 1, e["index"])
    later = [i for i in skipped if i in present]
    if later:
      problems.append(f"line {line}: entry {e['index']} out of order: entry "
                      f"{later[0]} appears elsewhere (reordered)")
    elif skipped:
      missing = (f"{skipped[0]}" if len(skipped) == 1 else
                 f"{skipped[0]}..{skipped[-1]}")
      problems.append(f"line {line}: entries {missing} deleted before "
                      f"entry {e['index']}")
    elif e["index"] <= prev_index:
      problems.append(f"line {line}: entry {e['index']} out of order "
                      f"after entry {prev_index} (reordered or duplicated)")
    elif e["prev"] != prev_hash:
      problems.append(f"line {line}: chain broken: prev link of entry "
                      f"{e['index']} does not match the entry before it")
    seal = None
    if event["type"] == SEAL:
      seal = e
      if event.get("n_entries") != e["index"]:
        problems.append(f"line {line}: seal states {event.get('n_entries')}"
                        f" entries but follows {e['index']}")
    prev_hash, prev_index = e["hash"], e["index"]
  return problems, seal is not None, prev_hash


def verify_log(path: str, require_sealed: bool = True) -> LogReport:
  """Checks the chain and locates every edit, deletion, reorder or truncation.

  Args:
    path: the JSONL log.
    require_sealed: a log whose last entry is not a seal is reported as truncated.
  """
  if not os.path.exists(path):
    return LogReport(0, False, GENESIS, (f"{path}: log missing",))
  entries, problems = _parse(_read(path))
  chain, sealed, head = _chain_problems(entries)
  problems += chain
  if require_sealed and not sealed:
    problems.append(f"line {len(entries)}: log not sealed: truncated after "
                    "this line, or the run never finished")
  problems.sort(key=lambda p: int(p.split()[1].rstrip(":"))
                if p.startswith("line ") else -1)
  return LogReport(len(entries), sealed, head, tuple(problems))


def entries_of(path: str) -> list[dict]:
  """Every parseable entry of a log with its 1-based `_line`, unverified (for locating)."""
  return _parse(_read(path))[0]
