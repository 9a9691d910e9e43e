"""A sweep crashed at each of its study's write points resumes to a study that verifies.

One tiny cell (ridge on the scale-out tests' random GPT-2, k = 2) on the local backend, in
this process. The crash is injected as in tests/test_evidence_recovery.py: the log's append
of one event fails after its file was written ("raised": the driver's `extending` still
finalizes the study on its way out; "killed": finalize is disabled too, as if the process
died), or a write raises after the one before it was written and logged. The resumed
sweep must run the cell again, write what an uninterrupted sweep writes (the same
predictions, byte for byte) and leave a study that verifies; a cell file the log does not
hold is never taken for a finished cell.
"""

import fcntl
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from configs import sweep as sweep_config
from lla.evidence import hashlog, rundir
from lla.sweep import driver, study as study_lib

import scaleout_inputs

REPO = pathlib.Path(__file__).resolve().parent.parent


class Crash(Exception):
  """The injected failure (an exception no writer catches)."""


class Died(BaseException):
  """The injected death of the process: nothing after it runs (finalize is disabled)."""


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
  root = tmp_path_factory.mktemp("sweep_recovery")
  scaleout_inputs.main(root)
  reference = root / "reference"
  summary = driver.run(_config(root), str(reference))
  assert summary.ran == 1 and rundir.verify(summary.study) == []
  return root, reference


def _config(root):
  config = sweep_config.get_config("test")
  cell = config.cell
  cell.target.hf_dir = cell.pretrained.hf_dir = str(root / "hf")
  cell.data.tokens_npy, cell.data.calibration_npy = str(root / "tokens.npy"), str(root / "cal.npy")
  cell.capture_batch_size = 6
  cell.attacks = ("ridge",)
  return config


def _predictions(workdir) -> dict[str, bytes]:
  return {p.name: p.read_bytes() for p in sorted((workdir / "study" / "predictions").iterdir())}


def _crash_on_append(monkeypatch, event_type, mode):
  original, error = hashlog.HashLog.append, Died if mode == "killed" else Crash
  fired = []

  def append(self, event, time=None):
    if event.get("type") == event_type and not fired:
      fired.append(event["file"])
      if mode == "killed":
        monkeypatch.setattr(rundir, "finalize", lambda *a, **k: None)
      raise error(event_type)
    return original(self, event, time=time)

  monkeypatch.setattr(hashlog.HashLog, "append", append)
  return error, fired


def _crash_before(monkeypatch, name, prefix=""):
  """`rundir.<name>` raises before it writes a file whose path starts with `prefix`: what
  came before it is written and logged."""
  original, fired = getattr(rundir, name), []

  def fail(run_dir, rel, *args, **kwargs):
    if rel.startswith(prefix) and not fired:
      fired.append(rel)
      raise Crash(name)
    return original(run_dir, rel, *args, **kwargs)

  monkeypatch.setattr(rundir, name, fail)
  return Crash, fired


@pytest.mark.parametrize("point, mode", [
    ("cell", "raised"), ("cell", "killed"),          # the cell file written, not logged
    ("record", "killed"), ("predictions", "killed"),  # a result written, not logged
    ("before_record", "raised"),                     # predictions logged, no record
    ("before_cell", "killed"),                       # results logged, no cell file
])
def test_a_crash_at_each_sweep_write_point_resumes_to_a_verifying_study(inputs, tmp_path,
                                                                        monkeypatch, point,
                                                                        mode):
  root, reference = inputs
  workdir = tmp_path / "sweep"
  study = workdir / "study"
  if point == "before_record":
    error, fired = _crash_before(monkeypatch, "save_record")
  elif point == "before_cell":
    error, fired = _crash_before(monkeypatch, "save_file", f"{rundir.CELLS}/")
  else:
    error, fired = _crash_on_append(monkeypatch, point, mode)
  with pytest.raises((error, driver.SweepError)):
    driver.run(_config(root), str(workdir))
  monkeypatch.undo()
  assert fired
  # What the crash left: a study that does not count the cell as finished.
  (cell,) = driver.cells_lib.expand(_config(root))
  assert study_lib.finished(str(study), cell) is None
  if mode == "raised":  # finalized on the way out: sealed without the unlogged file
    assert rundir.verify(str(study)) == []
  summary = driver.run(_config(root), str(workdir))
  assert (summary.ran, summary.skipped) == (1, 0)
  assert rundir.verify(str(study)) == []
  assert _predictions(workdir) == _predictions(reference)
  assert study_lib.finished(str(study), cell) is not None
  assert not (study / rundir.LOCK).exists()
  # Resumed again: finished, nothing runs, nothing is written.
  before = (study / rundir.LOG).read_bytes()
  assert driver.run(_config(root), str(workdir)).skipped == 1
  assert (study / rundir.LOG).read_bytes() == before


def test_a_cell_file_written_outside_the_log_does_not_verify(inputs, tmp_path):
  """An unlogged cell file is named by verify (cells/ is a logged directory), and a
  finalize discards it before the seal."""
  _, reference = inputs
  study = tmp_path / "study"
  shutil.copytree(reference / "study", study)
  (extra,) = (study / "cells").glob("*.json")
  copy = study / "cells" / "0000000000000000.json"
  copy.write_bytes(extra.read_bytes())
  problems = rundir.verify(str(study))
  assert f"cells/{copy.name}: not in log.jsonl (written outside the run's logged writers)" in (
      problems)


def test_the_sweep_binary_refuses_a_changed_result_in_one_line(inputs, tmp_path):
  """A finished cell whose predictions changed since its cell file (a StudyError): one
  stderr line naming the file, a non-zero exit, the study untouched."""
  root, reference = inputs
  workdir = tmp_path / "sweep"
  shutil.copytree(reference, workdir)
  (changed,) = (workdir / "study" / "predictions").glob("*.npy")
  changed.write_bytes(changed.read_bytes()[:-4] + b"\0\0\0\0")
  before = (workdir / "study" / rundir.LOG).read_bytes()
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
  cell = _config(root).cell
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.sweep", "--config=configs/sweep.py:test",
       f"--config.cell.target.hf_dir={cell.target.hf_dir}",
       f"--config.cell.pretrained.hf_dir={cell.pretrained.hf_dir}",
       f"--config.cell.data.tokens_npy={cell.data.tokens_npy}",
       f"--config.cell.data.calibration_npy={cell.data.calibration_npy}",
       "--config.cell.capture_batch_size=6", "--config.cell.attacks=ridge",
       f"--workdir={workdir}"], capture_output=True, text=True, cwd=REPO, timeout=300, env=env)
  assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  (line,) = proc.stderr.strip().splitlines()
  assert line.startswith(f"error: {changed}: missing or changed since"), line
  assert (workdir / "study" / rundir.LOG).read_bytes() == before


def test_a_sweep_on_a_locked_study_is_refused_before_it_writes(tmp_path):
  """Another writer holds the study's lock (an flock on STUDY/.lock, taken here by hand as
  another process's would be): the sweep is refused naming it before its first check of
  the study, so nothing is written (no log, no threat space, no cells)."""
  workdir = tmp_path / "sweep"
  study = workdir / "study"
  study.mkdir(parents=True)
  fd = os.open(study / rundir.LOCK, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.pwrite(fd, json.dumps({"pid": 1, "host": "elsewhere", "since": "then",
                              "what": "another sweep"}).encode(), 0)
    with pytest.raises(rundir.RunLockedError,
                       match=r"another writer holds .*pid 1 on elsewhere.*another sweep"):
      driver.run(_config(tmp_path), str(workdir))
    assert sorted(p.name for p in study.iterdir()) == [rundir.LOCK]
  finally:
    os.close(fd)
