"""`python -m experiments.qualify`: a study's checks run and logged, or one line of error.

The study is synthetic: one measured module, `good`, whose declared check is a fast test of
this repository, and one that was not measured, `idle`, whose check must not run.
"""

import subprocess
import sys

from lla.evidence import rundir
from lla.scoring import policy as policy_lib
from lla.scoring import synthetic as syn
from lla.scoring import threat_space
from lla.study import qualification

POL = policy_lib.load_policy()
CHECK = "tests/test_scoring_per_document.py::test_malformed_claims_are_refused_in_one_line"
IDLE = "tests/test_scoring_per_document.py::test_the_pairing_is_the_best_one_to_one_map"
MODULES = [{"name": "good", "family": "beam_inversion", "observations": ["activations"],
            "checks": [["synthetic", CHECK, "claims checked"]]},
           {"name": "idle", "family": "beam_inversion", "observations": ["activations"],
            "checks": [["synthetic", IDLE, "never run here"]]}]


def qualify(*args):
  return subprocess.run([sys.executable, "-m", "experiments.qualify", *args],
                        capture_output=True, text=True, timeout=600)


def test_qualify_runs_the_measured_modules_checks_into_the_study(tmp_path):
  cap, run = str(tmp_path / "cap"), str(tmp_path / "run")
  syn.make_capture(cap, syn.truth_tokens(docs=4))
  syn.make_run(run, cap, [syn.Spec("good", "beam_inversion", 3, 0)], POL.sha256,
               finalize=False)
  threat_space.record(run, MODULES)
  rundir.finalize(run)
  proc = qualify(f"--workdir={run}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  document = qualification.recorded_outcomes(run)
  assert document["modules"] == ["good"] and sorted(document["tests"]) == [CHECK]
  status = "pass" if document["git_dirty"] is False else "partial"
  assert f"good synthetic {status} {CHECK}" in proc.stdout.splitlines()
  assert IDLE not in proc.stdout
  assert rundir.verify(run) == []  # resealed


def test_qualify_refuses_in_one_line(tmp_path):
  proc = qualify(f"--workdir={tmp_path / 'nothing'}")
  assert proc.returncode == 1 and "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines() == [
      f"error: {tmp_path / 'nothing'}: not a run directory (no {rundir.LOG})"]
  cap, run = str(tmp_path / "cap"), str(tmp_path / "run")
  syn.make_capture(cap, syn.truth_tokens(docs=4))
  syn.make_run(run, cap, [syn.Spec("good", "beam_inversion", 3, 0)], POL.sha256)
  proc = qualify(f"--workdir={run}")
  assert proc.returncode == 1 and "Traceback" not in proc.stderr
  (line,) = proc.stderr.strip().splitlines()
  assert line.startswith("error: ") and "records no threat space" in line
