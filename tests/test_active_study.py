"""The standalone active tier's study (experiments.active_server, lla.active.run.run):
sealed as the main job's studies are, one writer at a time.

A cut-down tiny experiment (one seed, the FSHA server only, no decoy probe) runs
into its own study, which must end sealed and verify; a second run on the finished study
reuses everything and leaves the study's files as they were. A run started while another
process holds the study's lock is refused by the binary in one stderr line, before it
trains anything.
"""

import hashlib
import os
import pathlib
import subprocess
import sys

import pytest

from configs import active
from lla.active import run
from lla.evidence import rundir

REPO = pathlib.Path(__file__).resolve().parent.parent


def _config():
  config = active.get_config("tiny")
  config.seeds, config.calibration_seeds = (0,), (100,)
  config.attacks = (("fsha", 1.0),)
  config.fsha.pretrain_steps = 4
  config.public.n_docs = 32
  config.replay.honest, config.replay.hijacked = ("ridge",), ("fsha_decode",)
  config.decoy_probe.enabled = False
  return config


def _tree(directory: pathlib.Path) -> dict[str, str]:
  return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_its_own_study_is_sealed_and_verifies(tmp_path, data_dir, monkeypatch):
  monkeypatch.setenv("LLA_DATA_DIR", str(data_dir))
  workdir = tmp_path / "active"
  summary = run.run(_config(), str(workdir))
  study = str(workdir / "study")
  assert rundir.log(study).sealed and rundir.anchor(study) is not None
  assert rundir.verify(study) == []
  # Two judged runs (honest, fsha) x two captures, one attack each, all in the study.
  records = rundir.load_records(study)
  assert sorted(r.attack for r in records) == ["fsha_decode"] * 2 + ["ridge"] * 2
  assert {row["attack"] for row in summary["recovery"]} == {"ridge", "fsha_decode"}
  assert not (workdir / "study" / rundir.LOCK).exists()
  # Again on the finished study: verified, summarised from its records, nothing written.
  before = _tree(workdir / "study")
  again = run.run(_config(), str(workdir))
  assert _tree(workdir / "study") == before
  assert again["recovery"] == summary["recovery"]


def test_a_locked_study_is_refused_in_one_line(tmp_path):
  workdir = tmp_path / "active"
  study = workdir / "study"
  with rundir.locked(str(study), what="the test"):
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.active_server", "--config=configs/active.py:tiny",
         f"--workdir={workdir}"], capture_output=True, text=True, cwd=REPO, timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip("\n").split("\n")
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"active_server: {study}: another writer holds this run "
                               "directory's lock"), lines[0]
    assert f"pid {os.getpid()}" in lines[0] and "the test" in lines[0]
    # Refused before anything was made: the workdir holds only the lock the test took.
    assert [p.name for p in workdir.rglob("*")] == ["study", rundir.LOCK]
