"""Scoring reads only files whose hashes the study vouches for, and a stale scorecard is
said to be stale (issue 49, item 3).

A sealed synthetic study with a scorecard: a truth file, a protocol file, a record and the
threat space, each changed after the seal, make scoring refuse in one line naming that
file (checked in-process and through `experiments.rescore`); the study then rescores
cleanly once the file is restored. A later write into the study (a replay resealing it)
leaves its scorecard stale: `experiments.verify` prints a STALE line, the report's seal
line and `bridge` say so, each with the rescore command.
"""

import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from lla.evidence import files, rundir
from lla.scoring import policy as policy_lib
from lla.scoring import scorecard
from lla.scoring import synthetic as syn
from lla.scoring import threat_space
from lla.study import bridge, report

REPO = pathlib.Path(__file__).resolve().parent.parent
POL = policy_lib.load_policy()
MODULES = [{"name": "activation", "family": "beam_inversion", "observations": ["activations"]}]


def _cli(module, *args):
  env = {k: v for k, v in os.environ.items() if k != "LLA_DATA_DIR"}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
  return subprocess.run([sys.executable, "-m", f"experiments.{module}", *args],
                        capture_output=True, text=True, cwd=REPO, timeout=300, env=env)


@pytest.fixture()
def study(tmp_path):
  """(capture, run): the run sealed with its threat space and a scorecard."""
  cap = tmp_path / "cap"
  syn.make_capture(str(cap), syn.truth_tokens(docs=16))
  run = tmp_path / "workdir" / "study"
  specs = [syn.Spec("activation", "beam_inversion", 3, m) for m in range(2)]
  syn.make_run(str(run), str(cap), specs, POL.sha256, finalize=False)
  threat_space.record(str(run), MODULES)
  scorecard.write(str(run), scorecard.build(str(run), POL, contrasts=False))
  rundir.finalize(str(run))
  assert rundir.verify(str(run)) == []
  return cap, run


def _flip_a_byte(path: pathlib.Path, offset: int = -1) -> bytes:
  data = path.read_bytes()
  changed = bytearray(data)
  changed[offset] ^= 1
  path.write_bytes(bytes(changed))
  return data


@pytest.mark.parametrize("which", ["truth", "protocol", "record", "threat_space"])
def test_a_file_scoring_reads_changed_after_the_seal_is_refused_naming_it(study, which):
  cap, run = study
  target = {"truth": cap / "truth.safetensors", "protocol": run / rundir.PROTOCOL,
            "record": next((run / rundir.RECORDS).iterdir()),
            "threat_space": run / threat_space.FILE}[which]
  if which == "truth":
    # Another truth of the same shape and dtype: loads fine, scores differently.
    from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
    original = target.read_bytes()
    tokens = load_file(str(target))["tokens"]
    save_file({"tokens": np.roll(tokens, 1, axis=1)}, str(target))
  elif which == "protocol":
    original = target.read_bytes()
    doc = files.read_json(str(target))
    doc["T"] = "edited"
    target.write_bytes(files.canonical_json(doc))
  else:
    original = _flip_a_byte(target, -2 if which == "record" else 12)
  name = os.path.basename(target)
  with pytest.raises(ValueError, match=name):
    scorecard.build(str(run), POL, contrasts=False)
  proc = _cli("rescore", f"--workdir={run}")
  assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  (line,) = proc.stderr.strip().splitlines()
  assert "cannot re-score" in line and name in line, line
  target.write_bytes(original)
  proc = _cli("rescore", f"--workdir={run}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "reproduced byte for byte" in proc.stdout


def test_a_reseal_after_the_scorecard_is_reported_stale(study):
  cap, run = study
  before = report.seal_line(run)
  assert "Stale" not in before
  # A later replay into the study: one more record (and its predictions), resealed.
  other = run.parent.parent / "other"
  syn.make_run(str(other), str(cap), [syn.Spec("activation", "beam_inversion", 5, 7)],
               POL.sha256)
  (record,) = rundir.load_records(str(other))
  with rundir.extending(str(run)):
    rel, sha = rundir.save_predictions(str(run), "later",
                                       rundir.load_predictions(str(other / record.prediction_file)))
    rundir.save_record(str(run), "later", record.__class__(**{
        **record.__dict__, "prediction_file": rel, "prediction_sha256": sha,
        "truth_file": os.path.relpath(cap / "truth.safetensors", run),
        "capture_dir": os.path.relpath(cap, run)}))
  assert rundir.verify(str(run)) == []
  expected = scorecard.stale_line(str(run), ["predictions/later.npy", "records/later.json"])
  assert "2 file(s)" in expected and f"experiments.rescore --workdir={run}" in expected
  proc = _cli("verify", f"--workdir={run}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert f"STALE {expected}" in proc.stdout.splitlines()
  assert expected in report.seal_line(run)
  with pytest.raises(bridge.BridgeError, match="is stale"):
    bridge.read(run.parent)
  proc = _cli("bridge", f"--workdirs={run.parent}")
  assert proc.returncode != 0 and proc.stderr.strip() == f"error: {expected}", proc.stderr
  # Rescored: no longer stale.
  proc = _cli("rescore", f"--workdir={run}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  proc = _cli("verify", f"--workdir={run}")
  assert proc.returncode == 0 and "STALE" not in proc.stdout, proc.stdout
  shutil.rmtree(other)
