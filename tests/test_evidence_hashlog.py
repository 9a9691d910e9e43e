"""Hash-chained log: every tampering is detected and located."""

import json

import pytest

from lla.evidence import files
from lla.evidence import hashlog


@pytest.fixture
def log(tmp_path):
  lg = hashlog.HashLog(str(tmp_path / "log.jsonl"))
  for i in range(5):
    lg.append({"type": "step", "i": i}, time="2026-12-01T00:00:00+00:00")
  lg.seal(time="2026-12-01T00:00:01+00:00")
  return lg


def _lines(lg):
  return open(lg.path, "rb").read().split(b"\n")[:-1]


def _write(lg, lines):
  open(lg.path, "wb").write(b"".join(l + b"\n" for l in lines))
  return list(hashlog.verify_log(lg.path).problems)


def test_chain_is_recomputable_independently(log):
  prev = "0" * 64
  for i, raw in enumerate(_lines(log)):
    e = json.loads(raw)
    body = {k: e[k] for k in ("index", "prev", "time", "event")}
    assert e["index"] == i and e["prev"] == prev
    assert e["hash"] == files.sha256_bytes(
        (json.dumps(body, sort_keys=True, separators=(",", ":")) + "\n").encode())
    prev = e["hash"]
  rep = hashlog.verify_log(log.path)
  assert rep.ok and rep.sealed and rep.n_entries == 6 and rep.head == prev


def test_edit(log):
  lines = _lines(log)
  lines[2] = lines[2].replace(b'"i":2', b'"i":7')
  assert _write(log, lines) == [
      "line 3: entry 2 edited (its hash does not match its contents)"]


def test_edit_with_recomputed_hash_breaks_next_link(log):
  lines = _lines(log)
  e = json.loads(lines[2])
  e["event"]["i"] = 7
  e["hash"] = hashlog.entry_hash(e)
  lines[2] = files.canonical_json(e)[:-1]
  assert _write(log, lines) == [
      "line 4: chain broken: prev link of entry 3 does not match the entry "
      "before it"]


def test_delete_reorder_truncate_torn(log):
  lines = _lines(log)
  assert _write(log, lines[:1] + lines[2:]) == [
      "line 2: entries 1 deleted before entry 2"]
  probs = _write(log, [lines[0], lines[3], lines[1], lines[2]] + lines[4:])
  assert probs[0] == ("line 2: entry 3 out of order: entry 1 appears "
                      "elsewhere (reordered)")
  assert _write(log, lines[:4]) == [
      "line 4: log not sealed: truncated after this line, or the run never "
      "finished"]
  open(log.path, "wb").write(b"".join(l + b"\n" for l in lines) + b'{"ind')
  assert hashlog.verify_log(log.path).problems[0] == (
      "line 7: torn final line (truncated write)")


def test_sealed_log_refuses_appends(log):
  with pytest.raises(ValueError, match="sealed"):
    log.append({"type": "late"})
  with pytest.raises(ValueError, match="'type'"):
    hashlog.HashLog(log.path + "2").append({"no": "type"})


def test_torn_final_line_is_cut_and_logged(tmp_path):
  lg = hashlog.HashLog(str(tmp_path / "log.jsonl"))
  for i in range(3):
    lg.append({"type": "step", "i": i})
  complete = open(lg.path, "rb").read()
  torn = b'{"event":{"type":"step","i":3},"ha'  # An append killed mid-write.
  open(lg.path, "ab").write(torn)
  fresh = hashlog.HashLog(lg.path)  # as a resumed process would open it
  hashlog._HEADS.clear()
  fresh.append({"type": "step", "i": 3})
  data = open(lg.path, "rb").read()
  assert data.startswith(complete) and torn not in data
  events = [e["event"] for e in fresh.entries()]
  assert events[3] == {"type": "repair", "torn_bytes": len(torn),
                       "torn_sha256": files.sha256_bytes(torn)}
  assert events[4] == {"type": "step", "i": 3}
  assert hashlog.verify_log(lg.path, require_sealed=False).ok


def test_append_notices_an_edit_made_behind_its_back(tmp_path):
  lg = hashlog.HashLog(str(tmp_path / "log.jsonl"))
  for i in range(3):
    lg.append({"type": "step", "i": i})
  lines = open(lg.path, "rb").read().split(b"\n")
  lines[1] = lines[1].replace(b'"i":1', b'"i":9')
  open(lg.path, "wb").write(b"\n".join(lines))
  with pytest.raises(ValueError, match="line 2: entry 1 edited"):
    lg.append({"type": "step", "i": 3})


def test_reopen_names_its_seal(log):
  last = log.last()
  with pytest.raises(ValueError, match="must name the seal it follows"):
    log.append({"type": "reopen", "seal_index": 0, "seal_hash": last["hash"]})
  entry = log.reopen("a" * 64, "seals/manifest.5.sha256")
  assert entry["event"] == {"type": "reopen", "seal_index": 5, "seal_hash": last["hash"],
                            "manifest_sha256": "a" * 64,
                            "manifest_file": "seals/manifest.5.sha256"}
  report = hashlog.verify_log(log.path)
  assert report.problems == ("line 7: log not sealed: truncated after this line, or the run "
                             "never finished",)
  log.append({"type": "step", "i": 5})
  log.seal()
  assert hashlog.verify_log(log.path).ok
  with pytest.raises(ValueError, match="only a sealed log can be reopened"):
    hashlog.HashLog(log.path + "x").append({"type": "reopen"})
  # A reopen forged after a seal that names another seal breaks the rule.
  lines = open(log.path, "rb").read().split(b"\n")[:-1]
  forged = json.loads(lines[6])
  forged["event"]["seal_index"] = 2
  forged["hash"] = hashlog.entry_hash(forged)
  lines[6] = files.canonical_json(forged)[:-1]
  assert "line 7: entry after the seal (appended later)" in _write(log, lines)
