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
