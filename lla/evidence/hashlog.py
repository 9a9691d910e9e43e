"""Append-only, hash-chained JSONL log.

Line i is the canonical JSON of
  {"index": i, "prev": <hash of line i-1, or 64 zeros>, "time": ISO-8601 UTC,
   "event": {...}, "hash": sha256(canonical JSON of the other four fields)}.
Editing an entry breaks its own hash; deleting, inserting or reordering breaks
the index sequence and the `prev` links, located at the first line affected.
Truncating the tail is only visible against an anchor, so a finished log ends
with a `seal` entry that states how many entries precede it (and the run's
manifest covers the log file).

Each append rewrites the file through a temporary file and `os.replace`, so an
interrupted append leaves the previous complete log; logs are small.
"""

import dataclasses
import datetime
import json
import os

from lla.evidence import files

GENESIS = "0" * 64
SEAL = "seal"


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
    return _parse(self.path)[0]

  def append(self, event: dict, time: str | None = None) -> dict:
    """Appends `event`; refuses to extend a broken or sealed log."""
    if not isinstance(event, dict) or "type" not in event:
      raise ValueError(f"{self.path}: an event is a dict with a 'type' key")
    old = b""
    entries = []
    if os.path.exists(self.path):
      entries = self.entries()
      with open(self.path, "rb") as f:
        old = f.read()
    if entries and entries[-1]["event"]["type"] == SEAL:
      raise ValueError(f"{self.path}: log is sealed; nothing may follow")
    entry = {"index": len(entries),
             "prev": entries[-1]["hash"] if entries else GENESIS,
             "time": time or _now(), "event": event}
    entry["hash"] = entry_hash(entry)
    files.atomic_write_bytes(self.path, old + files.canonical_json(entry),
                             overwrite=True)
    return entry

  def seal(self, time: str | None = None) -> dict:
    n = len(self.entries()) if os.path.exists(self.path) else 0
    return self.append({"type": SEAL, "n_entries": n}, time=time)


def _parse(path: str) -> tuple[list[dict], list[str]]:
  """Entries that parse, plus problems for lines that do not."""
  with open(path, "rb") as f:
    data = f.read()
  lines = data.split(b"\n")
  torn = lines[-1] != b""
  if not torn:
    lines = lines[:-1]
  entries, problems = [], []
  for i, raw in enumerate(lines, 1):
    try:
      entry = json.loads(raw.decode("utf-8"))
      if not isinstance(entry, dict) or set(entry) != {
          "index", "prev", "time", "event", "hash"}:
        raise ValueError("wrong fields")
      entry["_line"] = i
      entries.append(entry)
    except ValueError:
      kind = ("torn final line (truncated write)" if torn and i == len(lines)
              else "not a log entry")
      problems.append(f"line {i}: {kind}")
  return entries, problems


def verify_log(path: str, require_sealed: bool = True) -> LogReport:
  """Checks the chain and locates every edit, deletion, reorder or truncation.

  Args:
    path: the JSONL log.
    require_sealed: a log without a final seal entry is reported as truncated.
  """
  if not os.path.exists(path):
    return LogReport(0, False, GENESIS, (f"{path}: log missing",))
  entries, problems = _parse(path)
  present = {e["index"] for e in entries if isinstance(e["index"], int)}
  prev_hash, prev_index, sealed = GENESIS, -1, False
  for e in entries:
    line = e["_line"]
    if sealed:
      problems.append(f"line {line}: entry after the seal (appended later)")
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
    if isinstance(e["event"], dict) and e["event"].get("type") == SEAL:
      sealed = True
      if e["event"].get("n_entries") != e["index"]:
        problems.append(f"line {line}: seal states {e['event'].get('n_entries')}"
                        f" entries but follows {e['index']}")
    prev_hash, prev_index = e["hash"], e["index"]
  if require_sealed and not sealed:
    problems.append(f"line {len(entries)}: log not sealed: truncated after "
                    "this line, or the run never finished")
  problems.sort(key=lambda p: int(p.split()[1].rstrip(":"))
                if p.startswith("line ") else -1)
  return LogReport(len(entries), sealed, prev_hash, tuple(problems))
