"""One writer per run directory: the lock of lla.evidence.rundir.locked, in processes of
its own and through two replays of experiments/replay.py started on one workdir.

The holder named in a refusal is checked against the holder's own pid and host (known to
the test, not read back from the message's source); the run is checked with
experiments.verify and by recomputing every prediction's sha256 against its record.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from lla.capture import capture
from lla.evidence import files, manifest, rundir
from lla.model import hf_io
from lla.model.gpt2 import GPT2Config

from test_attacks_units import random_params

REPO = pathlib.Path(__file__).resolve().parent.parent
CFG = GPT2Config(vocab_size=512, n_positions=16, n_embd=32, n_head=4, n_layer=3)

_TRY_LOCK = textwrap.dedent("""
    import sys
    from lla.evidence import rundir
    try:
      with rundir.locked(sys.argv[1], float(sys.argv[2])):
        print("acquired", flush=True)
    except rundir.RunLockedError as e:
      print(e, file=sys.stderr)
      sys.exit(3)
""")

_HOLD_LOCK = textwrap.dedent("""
    import sys, time
    from lla.evidence import rundir
    with rundir.locked(sys.argv[1]):
      print("held", flush=True)
      time.sleep(600)
""")


def _python(code, *args, **kw):
  return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True,
                        text=True, cwd=REPO, timeout=120, **kw)


def test_a_second_process_is_refused_naming_the_holder(tmp_path):
  run = tmp_path / "run"
  with rundir.locked(str(run)):
    with rundir.locked(str(run)):  # re-entrant within a process
      pass
    holder = json.loads((run / rundir.LOCK).read_text())
    assert (holder["pid"], holder["host"]) == (os.getpid(), socket.gethostname())
    proc = _python(_TRY_LOCK, run, 0)
    assert proc.returncode == 3 and proc.stdout == ""
    line, = proc.stderr.strip().splitlines()
    assert f"pid {os.getpid()} on {socket.gethostname()}, since {holder['since']}" in line
    assert line.startswith(f"{run}: another writer holds")
    # The lock file is no part of the run: a manifest written now does not list it.
    (run / "x.txt").write_text("x")
    manifest.write_manifest(str(run))
    assert manifest.read_manifest(str(run / manifest.MANIFEST_NAME))[0].keys() == {"x.txt"}
  assert not (run / rundir.LOCK).exists()  # removed on release
  assert _python(_TRY_LOCK, run, 0).stdout == "acquired\n"


def test_a_waiting_process_gets_the_lock_when_it_is_released(tmp_path):
  run = tmp_path / "run"
  with rundir.locked(str(run)):
    waiter = subprocess.Popen([sys.executable, "-c", _TRY_LOCK, str(run), "60"], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.5)
    assert waiter.poll() is None  # still waiting
  out, err = waiter.communicate(timeout=60)
  assert waiter.returncode == 0 and out == "acquired\n", err
  # A new directory whose writer wrote nothing is removed again.
  assert not run.exists()


def test_the_lock_of_a_killed_holder_is_free(tmp_path):
  run = tmp_path / "run"
  holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(run)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(rundir.RunLockedError, match=f"pid {holder.pid} on "):
      with rundir.locked(str(run)):
        pass
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  with rundir.locked(str(run)):  # the kernel released it; the stale file is taken over
    assert json.loads((run / rundir.LOCK).read_text())["pid"] == os.getpid()


def test_the_main_job_refuses_a_workdir_whose_study_another_writer_holds(tmp_path, data_dir):
  """experiments.main_table on a --workdir whose study another process holds (a replay, a
  main job): one line naming the holder, exit non-zero, and nothing written."""
  workdir = tmp_path / "main"
  study = workdir / "study"
  holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(study)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline() == "held\n"
    since = rundir.lock_holder(str(study))["since"]
    job = subprocess.run(
        [sys.executable, "-m", "experiments.main_table", "--config=configs/main_table.py:tiny",
         f"--workdir={workdir}"], capture_output=True, text=True, cwd=REPO, timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu", LLA_DATA_DIR=str(data_dir)))
    assert job.returncode != 0 and "Traceback" not in job.stderr, job.stderr[-3000:]
    line, = job.stderr.strip().splitlines()
    assert line.startswith(f"error: {study}: another writer holds"), line
    assert f"pid {holder.pid} on {socket.gethostname()}, since {since}" in line
    assert sorted(p.relative_to(workdir).as_posix() for p in workdir.rglob("*")) == [
        "study", f"study/{rundir.LOCK}"]
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()


# An attack that waits for a file, so that its replay holds the run for as long as the test
# needs; its predictions are the documents' first calibration row (any valid ids do).
_GATE_PLUGIN = textwrap.dedent("""
    import os, time
    import numpy as np
    from lla.attacks import registry

    class Gate:
      spec = registry.AttackSpec("gate_plugin", "test", ("activations",))

      def __call__(self, ws, budget, key):
        deadline = time.time() + 240
        while not os.path.exists(os.environ["LLA_TEST_GATE"]) and time.time() < deadline:
          time.sleep(0.1)
        predictions = np.zeros((ws.num_docs, ws.seq_len), np.int32)
        return registry.AttackResult(predictions, 0.0)

    registry.register(Gate())
""")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("lock")
  params = random_params(CFG, seed=11, std=0.05)
  hf_io.save_hf_dir(params, CFG, root / "hf")
  params, _ = hf_io.load_hf_dir(root / "hf")
  rng = np.random.default_rng(11)
  tokens = rng.integers(0, CFG.vocab_size, (6, 8)).astype(np.int32)
  np.save(root / "cal.npy", rng.integers(0, CFG.vocab_size, (12, 8)).astype(np.int32))
  capture.capture_target(str(root / "cap"), params, CFG, tokens, range(6), 2, model_id="tiny",
                         batch_size=3)
  (root / "plugins").mkdir()
  (root / "plugins" / "lla_gate_plugin.py").write_text(_GATE_PLUGIN)
  return root


def _replay(root, workdir, attacks, *extra, gate):
  cmd = [sys.executable, "-m", "experiments.replay", "--config=configs/replay.py",
         f"--config.capture_dir={root / 'cap'}", f"--config.attacker.hf_dir={root / 'hf'}",
         f"--config.calibration.tokens_npy={root / 'cal.npy'}", f"--config.attacks={attacks}",
         "--config.plugins=lla_gate_plugin", f"--workdir={workdir}", *extra]
  env = dict(os.environ, JAX_PLATFORMS="cpu", LLA_TEST_GATE=str(gate),
             PYTHONPATH=f"{REPO}:{root / 'plugins'}")
  return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def _wait_for_holder(run: pathlib.Path, pid: int, proc) -> dict:
  deadline = time.time() + 120
  while time.time() < deadline:
    holder = rundir.lock_holder(str(run))
    if holder and holder.get("pid") == pid:
      return holder
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    time.sleep(0.1)
  raise AssertionError("the first replay never took the lock")


@pytest.mark.slow
def test_two_replays_on_one_workdir(setup, tmp_path):
  """A holds the run (its gate attack waits); B, started meanwhile, is refused with one
  line naming A; C, started meanwhile with --lock_wait_s, waits and then extends the run.
  The run verifies, and every attack of A and C is there with the predictions its record
  names."""
  root = setup
  run, gate = tmp_path / "run", tmp_path / "gate"
  first = _replay(root, run, "ridge,gate_plugin", gate=gate)
  try:
    holder = _wait_for_holder(run, first.pid, first)
    assert holder["host"] == socket.gethostname()
    second = _replay(root, run, "gradient_only", gate=gate)
    _, err = second.communicate(timeout=300)
    assert second.returncode != 0 and "Traceback" not in err, err[-3000:]
    line, = err.strip().splitlines()
    assert line.startswith(f"error: {run}: another writer holds")
    assert f"pid {first.pid} on {socket.gethostname()}, since {holder['since']}" in line
    third = _replay(root, run, "gradient_only", "--lock_wait_s=240", gate=gate)
    time.sleep(2.0)
    assert third.poll() is None  # waiting for the first
  finally:
    gate.write_text("go")
  _, err = first.communicate(timeout=300)
  assert first.returncode == 0, err[-3000:]
  _, err = third.communicate(timeout=300)
  assert third.returncode == 0, err[-3000:]

  verify = subprocess.run([sys.executable, "-m", "experiments.verify", f"--workdir={run}"],
                          capture_output=True, text=True, cwd=REPO, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert verify.returncode == 0, verify.stdout + verify.stderr
  records = {r.attack: r for r in rundir.load_records(str(run))}
  assert sorted(records) == ["gate_plugin", "gradient_only", "ridge"]
  for record in records.values():
    assert record.status == "ok"
    assert files.sha256_file(str(run / record.prediction_file)) == record.prediction_sha256
  assert np.load(run / records["gate_plugin"].prediction_file).sum() == 0
  # The writers did not interleave: the first's entries, its seal, then the third's reopen.
  events = [e["event"] for e in rundir.log(str(run)).entries()]
  kinds = [e["type"] for e in events]
  assert kinds.count("seal") == 2 and kinds.count("reopen") == 1
  first_seal = kinds.index("seal")
  assert kinds[first_seal + 1] == "reopen" and kinds[-1] == "seal"
  assert {e.get("file") for e in events[:first_seal]} >= {"records/ridge.json",
                                                           "records/gate_plugin.json"}
  assert "records/gradient_only.json" in {e.get("file") for e in events[first_seal:]}
  assert not (run / rundir.LOCK).exists()
