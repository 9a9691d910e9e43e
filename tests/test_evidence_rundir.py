"""Run directories: consistent tampering, reopen/reseal, crash-safe finalize, confined paths.

Synthetic runs (lla.scoring.synthetic: a capture of known tokens and predictions written
through the run's own writers) are tampered with the way a careful forger would: the file,
every hash that names it, and the manifest, so that only the hash-chained log can tell.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from lla.evidence import files, hashlog, manifest, rundir
from lla.evidence.records import AttackRecord
from lla.scoring import synthetic as syn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECS = [syn.Spec("activation", "beam_inversion", 20, m) for m in range(2)]
PRED = "predictions/k6__public__none__m0__s0__activation.npy"
RECORD = "records/k6__public__none__m0__s0__activation.json"


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  root = tmp_path_factory.mktemp("rundir")
  syn.make_capture(str(root / "captures" / "cap"), syn.truth_tokens(docs=8, seq_len=8))
  syn.make_run(str(root / "study"), str(root / "captures" / "cap"), SPECS, "0" * 64)
  return root


@pytest.fixture
def run(finished, tmp_path):
  """A private copy of the finished run and its capture (same relative layout)."""
  shutil.copytree(finished, tmp_path / "root")
  return tmp_path / "root" / "study"


def _rewrite_manifest(run_dir):
  os.remove(run_dir / manifest.MANIFEST_NAME)
  manifest.write_manifest(str(run_dir))


def _verify_binary(run_dir):
  return subprocess.run([sys.executable, "-m", "experiments.verify", f"--workdir={run_dir}"],
                        capture_output=True, text=True, cwd=REPO, timeout=120)


def test_finished_synthetic_run_verifies(run):
  assert rundir.verify(str(run)) == []
  # The capture lives beside the study: its locator climbs out, and is not absolute.
  record = AttackRecord.load(str(run / RECORD))
  assert record.capture_dir == "../captures/cap"
  assert record.truth_file == "../captures/cap/truth.safetensors"


def test_consistent_prediction_tamper_is_caught_by_the_binary(run):
  pred = np.load(run / PRED)
  pred[0, 0] = (pred[0, 0] + 1) % 50
  os.remove(run / PRED)
  np.save(run / PRED, pred)
  record = files.read_json(str(run / RECORD))
  record["prediction_sha256"] = files.sha256_file(str(run / PRED))
  os.remove(run / RECORD)
  files.atomic_write_json(str(run / RECORD), record)
  _rewrite_manifest(run)
  assert manifest.verify_manifest(str(run)).ok  # Everything the forger could rewrite agrees.
  proc = _verify_binary(run)
  assert proc.returncode != 0
  assert f"FAIL {PRED}: sha256 differs from the one log.jsonl recorded" in proc.stdout
  assert f"FAIL {RECORD}: sha256 differs from the one log.jsonl recorded" in proc.stdout
  # Scoring refuses to read it too, naming the file.
  from lla.scoring import scorecard  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match="predictions/k6__public__none__m0__s0__activation.npy"):
    scorecard.build(str(run))


def test_record_field_tamper_is_caught(run):
  record = files.read_json(str(run / RECORD))
  record["baseline_token"] = 7
  os.remove(run / RECORD)
  files.atomic_write_json(str(run / RECORD), record)
  _rewrite_manifest(run)
  problems = rundir.verify(str(run))
  assert problems == [f"{RECORD}: sha256 differs from the one log.jsonl recorded at line 3 "
                      "(changed after it was written)"]


def test_log_line_tamper_is_caught(run):
  """The forger also rewrites the log's hash for the file: the chain breaks there."""
  pred = np.load(run / PRED)
  pred[1, 1] = (pred[1, 1] + 1) % 50
  os.remove(run / PRED)
  np.save(run / PRED, pred)
  lines = (run / rundir.LOG).read_bytes().split(b"\n")[:-1]
  entry = json.loads(lines[1])
  assert entry["event"]["file"] == PRED
  entry["event"]["sha256"] = files.sha256_file(str(run / PRED))
  lines[1] = files.canonical_json(entry)[:-1]
  (run / rundir.LOG).write_bytes(b"".join(l + b"\n" for l in lines))
  _rewrite_manifest(run)
  problems = rundir.verify(str(run))
  assert "log.jsonl: line 2: entry 1 edited (its hash does not match its contents)" in problems


def test_capture_file_tamper_is_caught(run):
  cap = run.parent / "captures" / "cap"
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  truth = rundir.load_truth(str(cap / "truth.safetensors"))
  truth[0, 0] += 1
  os.remove(cap / "truth.safetensors")
  save_file({"tokens": truth}, str(cap / "truth.safetensors"))
  _rewrite_manifest(cap)
  problems = rundir.verify(str(run))
  assert problems and all("captures/cap/manifest.sha256: sha256 differs from the records' "
                          "capture_sha256" in p for p in problems)


def test_reopen_extends_and_reseals(run):
  events = len(rundir.log(str(run)).entries())
  assert rundir.reopen(str(run))
  assert not (run / manifest.MANIFEST_NAME).exists()
  archived = run / "seals" / f"manifest.{events - 1}.sha256"
  assert archived.exists()
  rundir.save_predictions(str(run), "extra", np.zeros((8, 8), np.int32))
  rundir.finalize(str(run))
  assert rundir.verify(str(run)) == []
  kinds = [e["event"]["type"] for e in rundir.log(str(run)).entries()]
  assert kinds[events - 1:] == ["seal", "reopen", "predictions", "seal"]
  # A forger who changes a file after a reopen and reseals by hand (seal entry, new
  # manifest) is caught by the log's hash and by the manifest the reopen archived.
  assert rundir.reopen(str(run))
  protocol = run / rundir.PROTOCOL
  protocol.write_bytes(protocol.read_bytes().replace(b"synthetic", b"synthetix"))
  rundir.log(str(run)).seal()
  manifest.write_manifest(str(run))
  problems = rundir.verify(str(run))
  assert problems[0] == ("protocol.json: sha256 differs from the one log.jsonl recorded at "
                         "line 1 (changed after it was written)")
  assert any(p.startswith("protocol.json: changed after the seal log.jsonl: line") for p in
             problems)


def test_a_sealed_run_refuses_a_write_before_touching_the_file(run):
  scorecard = run / rundir.SCORECARD_JSON
  before = scorecard.read_bytes() if scorecard.exists() else None
  with pytest.raises(ValueError, match="run is sealed; reopen it to add scorecard.json"):
    rundir.save_file(str(run), rundir.SCORECARD_JSON, b"{}", "scorecard", overwrite=True)
  assert (scorecard.read_bytes() if scorecard.exists() else None) == before
  assert rundir.verify(str(run)) == []


def test_reopen_refuses_a_run_that_fails_verification(run):
  (run / "notes.txt").write_text("extra\n")
  with pytest.raises(ValueError, match="refusing to extend a run that fails verification: "
                     "manifest.sha256: extra: notes.txt"):
    rundir.reopen(str(run))
  assert rundir.log(str(run)).sealed


def test_crash_between_seal_and_manifest_resumes(tmp_path, monkeypatch):
  syn.make_capture(str(tmp_path / "cap"), syn.truth_tokens(docs=8, seq_len=8))
  run = tmp_path / "run"
  syn.make_run(str(run), str(tmp_path / "cap"), SPECS, "0" * 64, finalize=False)

  def crash(*args, **kwargs):
    raise KeyboardInterrupt("killed after the seal")
  monkeypatch.setattr(manifest, "write_manifest", crash)
  with pytest.raises(KeyboardInterrupt):
    rundir.finalize(str(run))
  monkeypatch.undo()
  assert rundir.log(str(run)).sealed and not (run / manifest.MANIFEST_NAME).exists()
  rundir.finalize(str(run))  # The resume: no second seal, the manifest is written.
  rundir.finalize(str(run))  # Idempotent.
  assert rundir.verify(str(run)) == []
  assert [e["event"]["type"] for e in rundir.log(str(run)).entries()].count("seal") == 1
  # A crash after the reopen entry but before the manifest moved is completed too.
  original = os.rename
  monkeypatch.setattr(os, "rename", crash)
  with pytest.raises(KeyboardInterrupt):
    rundir.reopen(str(run))
  monkeypatch.setattr(os, "rename", original)
  rundir.save_predictions(str(run), "later", np.ones((8, 8), np.int32))
  rundir.finalize(str(run))
  assert rundir.verify(str(run)) == []


@pytest.mark.parametrize("change,match", [
    ({"prediction_file": "../elsewhere/x.npy"}, "prediction_file '../elsewhere/x.npy': leaves"),
    ({"prediction_file": "/tmp/x.npy"}, "absolute paths are refused"),
    ({"capture_dir": "/data/cap", "truth_file": "/data/cap/truth.safetensors"},
     "capture_dir '/data/cap': absolute paths are refused"),
    ({"truth_file": "../other/truth.safetensors"}, "is not a file of its capture"),
    ({"e_hash": "../../etc"}, "e_hash '../../etc' is not a sha256"),
])
def test_record_paths_are_confined(run, change, match):
  data = files.read_json(str(run / RECORD))
  with pytest.raises(ValueError, match=match):
    AttackRecord.from_json({**data, **change}, source="x.json")


def test_writers_refuse_paths_outside_the_run(run):
  with pytest.raises(ValueError, match="leaves its directory"):
    rundir.save_file(str(run), "../outside.txt", b"x", "predictions")
  with pytest.raises(ValueError, match="absolute paths are refused"):
    rundir.resolve(str(run), "/etc/passwd")
  assert not (run.parent / "outside.txt").exists()


def test_policy_name_from_capture_metadata_is_confined():
  from lla.scoring import policy  # pylint: disable=g-import-not-at-top
  for name in ("../x.json", "../x", "sub/name", "/etc/passwd"):
    with pytest.raises(ValueError, match="not a path"):
      policy.load_named_policy(name)
  with pytest.raises(ValueError, match="not a path"):
    policy.load_policy("../../x")
  assert policy.load_named_policy("scorecard-policy.v3").policy_id == "scorecard-policy.v3"


def test_verify_log_reports_a_non_integer_index(run):
  lines = (run / rundir.LOG).read_bytes().split(b"\n")[:-1]
  entry = json.loads(lines[2])
  entry["index"] = "2"
  lines[2] = json.dumps(entry).encode()
  (run / rundir.LOG).write_bytes(b"".join(l + b"\n" for l in lines))
  report = hashlog.verify_log(str(run / rundir.LOG))
  assert report.problems[0] == "line 3: not a log entry (index '2' is not a non-negative integer)"
  assert any("log.jsonl: line 3: not a log entry" in p for p in rundir.verify(str(run)))


def test_replay_inputs_are_logged_with_their_hash(run):
  """Every file of the logged directories must be in the log: a file dropped in by hand
  (here an input) is named even when the manifest is rewritten to include it."""
  os.makedirs(run / "inputs")
  (run / "inputs" / "calibration_x.npy").write_bytes(b"not logged")
  _rewrite_manifest(run)
  assert rundir.verify(str(run)) == [
      "inputs/calibration_x.npy: not in log.jsonl (written outside the run's logged writers)"]
