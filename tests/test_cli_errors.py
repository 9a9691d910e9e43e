"""Bad input to the capture and replay binaries: one line on stderr, a non-zero exit, nothing
written, as a new user would meet it.

Each case runs the binary as a subprocess on a tiny random GPT-2 (V = 512, 3 layers,
n_positions 16) and checks the exit status, that stderr is exactly one line (no traceback)
naming the problem with values the test computes itself (the array's own min and max, the
config's vocabulary and layer count, the path given), and that no output was left behind.
"""

import concurrent.futures
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from lla.capture import capture
from lla.model import hf_io
from lla.model.gpt2 import GPT2Config

from test_attacks_units import random_params

REPO = pathlib.Path(__file__).resolve().parent.parent
CFG = GPT2Config(vocab_size=512, n_positions=16, n_embd=32, n_head=4, n_layer=3)
CUT = 2


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", f"experiments.{module}", *args],
                        capture_output=True, text=True, cwd=REPO, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))


def _tree(directory: pathlib.Path) -> dict[str, str]:
  return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(directory.rglob("*")) if p.is_file()}


def _one_line(proc: subprocess.CompletedProcess, what) -> str:
  """The single stderr line of a failed run (asserting there is exactly one)."""
  assert proc.returncode != 0, (what, proc.stdout[-2000:])
  assert "Traceback" not in proc.stderr, (what, proc.stderr[-3000:])
  lines = proc.stderr.strip("\n").split("\n")
  assert len(lines) == 1 and lines[0].strip(), (what, proc.stderr[-3000:])
  return lines[0]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("cli")
  params = random_params(CFG, seed=7, std=0.05)
  hf_io.save_hf_dir(params, CFG, root / "hf")
  params, _ = hf_io.load_hf_dir(root / "hf")
  rng = np.random.default_rng(7)
  good = rng.integers(0, CFG.vocab_size, (4, 8)).astype(np.int32)
  np.save(root / "good.npy", good)
  capture.capture_target(str(root / "cap"), params, CFG, good, range(4), CUT, model_id="tiny",
                         batch_size=2)
  capture.capture_target(str(root / "cap_other"), params, CFG, good[:2], range(2), CUT,
                         model_id="tiny", batch_size=2)
  return root, good


def _token_cases(root: pathlib.Path, good: np.ndarray) -> list:
  """(name, array or None for a missing file, allow_pickle, the facts the line must hold)."""
  high = good.copy()
  high[1, 3] = CFG.vocab_size + 5
  negative = good.copy()
  negative[0, 0] = -4
  obj = np.empty((2, 2), dtype=object)
  obj[:] = 1
  long_docs = np.random.default_rng(1).integers(0, CFG.vocab_size, (2, CFG.n_positions + 4))
  return [
      ("high", high, [f"[0, {CFG.vocab_size})", f"[{high.min()}, {high.max()}]"]),
      ("negative", negative, [f"[0, {CFG.vocab_size})", f"[{negative.min()}, {negative.max()}]"]),
      ("float", good.astype(np.float32), ["float32", "[4, 8]", "integer"]),
      ("one_d", good[0], ["[8]", "[B, T]"]),
      ("object", obj, ["Object arrays", "allow_pickle"]),
      ("too_long", long_docs, [f"T={CFG.n_positions + 4}", f"n_positions={CFG.n_positions}"]),
      ("no_documents", np.zeros((0, 8), np.int32), ["empty", "[0, 8]", "no documents"]),
      ("no_tokens", np.zeros((3, 0), np.int32), ["empty", "[3, 0]"]),
      ("missing", None, ["not found"]),
  ]


@pytest.mark.slow
def test_capture_binary_bad_inputs_are_one_line(setup, tmp_path):
  root, good = setup
  cases = []  # (what, args, facts, workdir)
  for name, array, facts in _token_cases(root, good):
    path = tmp_path / f"{name}.npy"
    if array is not None:
      np.save(path, array, allow_pickle=array.dtype == object)
    cases.append((name, [f"--config.data.tokens_npy={path}", f"--config.cut={CUT}"],
                  [str(path), *facts]))
  good_tokens = f"--config.data.tokens_npy={root / 'good.npy'}"
  for cut in (0, -1, CFG.n_layer, CFG.n_layer + 5):
    facts = [f"cut={cut}", "out of range"] + ([f"<= {CFG.n_layer - 1}"] if cut > 0 else [])
    cases.append((f"cut {cut}", [good_tokens, f"--config.cut={cut}"], facts))
  cases.append(("missing model", [good_tokens, f"--config.cut={CUT}",
                                  f"--config.model.hf_dir={tmp_path / 'no_model'}"],
                [str(tmp_path / "no_model"), "no such directory"]))
  cases.append(("no model", [good_tokens, f"--config.cut={CUT}", "--config.model.hf_dir=",
                             "--config.model.checkpoint=", "--config.model.hub="],
                ["names no gguf, gguf_package, hf_dir, checkpoint or hub"]))
  cases.append(("existing workdir", [good_tokens, f"--config.cut={CUT}"], ["exists"]))

  def run(case):
    what, args, facts = case
    workdir = root / "cap" if what == "existing workdir" else tmp_path / f"out_{what}"
    model = [] if any(a.startswith("--config.model.hf_dir") for a in args) else [
        f"--config.model.hf_dir={root / 'hf'}"]
    return _run("capture", "--config=configs/capture.py", *model, *args, f"--workdir={workdir}")

  before = _tree(root / "cap")
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    results = list(pool.map(run, cases))
  for (what, _, facts), proc in zip(cases, results):
    line = _one_line(proc, what)
    assert line.startswith("capture: "), (what, line)
    for fact in facts:
      assert fact in line, (what, fact, line)
  # Nothing written: no capture directory, no staging directory, the existing one as it was.
  assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".npy")) == []
  assert sorted(p.name for p in root.iterdir()) == ["cap", "cap_other", "good.npy", "hf"]
  assert _tree(root / "cap") == before


def test_capture_binary_writes_the_same_capture_for_good_input(setup, tmp_path):
  """The checks refuse nothing valid: the binary's capture of the fixture's tokens is the
  capture written in-process (same manifest bytes)."""
  root, _ = setup
  proc = _run("capture", "--config=configs/capture.py", f"--config.model.hf_dir={root / 'hf'}",
              f"--config.data.tokens_npy={root / 'good.npy'}", f"--config.cut={CUT}",
              "--config.batch_size=2", f"--workdir={tmp_path / 'cap'}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  for name in ("messages.safetensors", "truth.safetensors"):
    assert (tmp_path / "cap" / name).read_bytes() == (root / "cap" / name).read_bytes()


def _replay(root, capture_dir, workdir, *extra):
  return _run("replay", "--config=configs/replay.py", f"--config.capture_dir={capture_dir}",
              f"--config.attacker.hf_dir={root / 'hf'}",
              f"--config.calibration.tokens_npy={root / 'good.npy'}", "--config.attacks=ridge",
              f"--workdir={workdir}", *extra)


def test_replay_binary_refuses_a_capture_as_workdir_and_a_bad_process_id(setup, tmp_path):
  root, _ = setup
  before = {name: _tree(root / name) for name in ("cap", "cap_other")}
  cases = [
      ("workdir is the capture", (root / "cap", root / "cap"),
       [f"--workdir={root / 'cap'}", "capture being replayed"]),
      ("workdir is another capture", (root / "cap", root / "cap_other"),
       [f"--workdir={root / 'cap_other'}", "is a capture directory"]),
      ("process_id out of range", (root / "cap", tmp_path / "run"),
       ["--process_id=2", "out of range", "0..1"]),
      ("process_id without the job", (root / "cap", tmp_path / "run"),
       ["--coordinator_address", "--num_processes"]),
  ]
  extra = {"process_id out of range": ["--coordinator_address=127.0.0.1:1", "--num_processes=2",
                                       "--process_id=2"],
           "process_id without the job": ["--process_id=1"]}

  def run(case):
    what, (capture_dir, workdir), _ = case
    return _replay(root, capture_dir, workdir, *extra.get(what, []))

  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    results = list(pool.map(run, cases))
  for (what, _, facts), proc in zip(cases, results):
    line = _one_line(proc, what)
    for fact in facts:
      assert fact in line, (what, fact, line)
  assert not (tmp_path / "run").exists()
  assert {name: _tree(root / name) for name in ("cap", "cap_other")} == before


@pytest.mark.slow
def test_regenerate_binary_checks_a_run_and_refuses_what_it_cannot_regenerate(setup, tmp_path):
  """A replayed run regenerates bit for bit (whole and as a one-record-per-module sample); a
  missing run, and a run whose protocol lacks a budget field its module now declares (a run
  older than the field), are one line each, and neither run is changed."""
  root, _ = setup
  run = tmp_path / "run"
  proc = _replay(root, root / "cap", run)
  assert proc.returncode == 0, proc.stderr[-3000:]
  for extra, what in (([], "every prediction"), (["--per_attack=1"], "1 sampled prediction")):
    proc = _run("regenerate", f"--workdir={run}", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"OK {run}: {what}" in proc.stdout.splitlines()[-1], proc.stdout
  old = tmp_path / "old"
  shutil.copytree(run, old)
  protocol = old / "protocol.json"
  e = json.loads(protocol.read_text())
  del e["B"]["fields"]["candidates"]
  protocol.write_text(json.dumps(e))
  before = {name: _tree(tmp_path / name) for name in ("run", "old")}
  cases = [(tmp_path / "absent", [str(tmp_path / "absent"), "records directory missing"]),
           (old, ["'ridge'", "candidates", "does not hold", "predates"])]
  for workdir, facts in cases:
    line = _one_line(_run("regenerate", f"--workdir={workdir}"), workdir)
    assert line.startswith("error: "), line
    for fact in facts:
      assert fact in line, (fact, line)
  assert {name: _tree(tmp_path / name) for name in ("run", "old")} == before
  assert not (tmp_path / "absent").exists()


def test_main_job_refuses_a_workdir_whose_study_another_binary_started(tmp_path):
  """A sealed study without the main job's config (as a sweep leaves): one line before any
  phase runs, nothing written."""
  from lla.evidence import rundir  # pylint: disable=g-import-not-at-top
  study = tmp_path / "study"
  rundir.create_study(str(study), {"sweep": "cpu"})
  rundir.finalize(str(study))
  before = _tree(tmp_path)
  line = _one_line(_run("main_table", "--config=configs/main_table.py:tiny",
                        f"--workdir={tmp_path}"), "foreign study")
  assert line == (f"error: {study}: this workdir's study was started with a different config "
                  "(or by another binary, e.g. a sweep); resume it with the same config or use "
                  "a new --workdir"), line
  assert _tree(tmp_path) == before


def test_main_job_refuses_more_phase_documents_than_it_draws(tmp_path):
  """defense_docs or published.docs above data.n_eval would run on fewer documents than
  asked, silently: one line naming both values, and no workdir."""
  for flag, field in (("--config.defense_docs=49", "defense_docs = 49"),
                      ("--config.published.docs=49", "published.docs = 49")):
    workdir = tmp_path / field.split()[0]
    line = _one_line(_run("main_table", "--config=configs/main_table.py:tiny",
                          "--config.data.n_eval=48", flag, f"--workdir={workdir}"), flag)
    assert line == (f"error: config.{field} exceeds config.data.n_eval = 48, the evaluation "
                    "documents it is taken from; raise data.n_eval or lower it"), line
    assert not workdir.exists()


def test_mixup_linking_refuses_a_bad_mixture_and_a_missing_model_in_one_line():
  line = _one_line(_run("mixup_linking", "--docs=40", "--m=9"), "m")
  assert line == ("error: --m=9: every capture batch needs at least m documents (--docs=40 "
                  "in batches of 32)"), line
  line = _one_line(_run("mixup_linking", "--config.model.gguf=/nonexistent.gguf"), "gguf")
  assert line == "error: /nonexistent.gguf: GGUF file does not exist", line


def test_sweep_binary_refuses_a_bad_grid_before_writing(tmp_path):
  """An unknown cell id, attack or plugin: one line naming it, and no sweep directory."""
  workdir = tmp_path / "sweep"
  cases = [("--cells=no_such_cell", ["--cells", "no_such_cell"]),
           ("--config.cell.attacks=no_such_attack", ["no attack named 'no_such_attack'"]),
           ("--config.cell.plugins=no_such.module", ["plugin 'no_such.module'",
                                                      "could not be imported"])]

  def run(case):
    return _run("sweep", "--config=configs/sweep.py:cpu", f"--workdir={workdir}", case[0])

  with concurrent.futures.ThreadPoolExecutor(3) as pool:
    results = list(pool.map(run, cases))
  for (flag, facts), proc in zip(cases, results):
    line = _one_line(proc, flag)
    assert line.startswith("error: "), (flag, line)
    for fact in facts:
      assert fact in line, (flag, fact, line)
  assert not workdir.exists()


def _rope_scaled_dir(directory: pathlib.Path) -> pathlib.Path:
  """A llama config whose RoPE scaling (dynamic NTK) lla does not implement; no weights are
  needed: the config is refused first."""
  directory.mkdir()
  (directory / "config.json").write_text(json.dumps({
      "model_type": "llama", "vocab_size": CFG.vocab_size, "hidden_size": 32,
      "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
      "num_key_value_heads": 4, "max_position_embeddings": 16, "rms_norm_eps": 1e-6,
      "hidden_act": "silu", "rope_theta": 10000.0,
      "rope_scaling": {"type": "dynamic", "factor": 2.0}}))
  return directory


def test_every_binary_turns_an_input_or_state_error_into_one_line(setup, tmp_path):
  """The CLI error matrix (issue 49): each binary, each error class a new user meets, one
  stderr line naming it, a non-zero exit, no traceback; a --workdir the binary would have
  created is not left behind (empty or not), and a directory that was there is unchanged."""
  from lla.scoring import synthetic as syn  # pylint: disable=g-import-not-at-top
  root, _ = setup
  no_model = tmp_path / "no_model"
  replay_run = tmp_path / "replay_run"  # a run directory, as a replay leaves one
  syn.make_run(str(replay_run), str(root / "cap"), [syn.Spec("ridge", "ridge", 1, 0)], None)
  sweep_dir = tmp_path / "sweep_over_a_run"  # its study/ is a run, not a study
  syn.make_run(str(sweep_dir / "study"), str(root / "cap"), [syn.Spec("ridge", "ridge", 1, 0)],
               None)
  rope = _rope_scaled_dir(tmp_path / "rope")
  tiny_main = "--config=configs/main_table.py:tiny"
  new = lambda name: tmp_path / f"new_{name}"  # pylint: disable=unnecessary-lambda-assignment
  # (what, binary, args, facts the line holds, the workdir (None: none), it existed before)
  cases = [
      ("main: plugin", "main_table", [tiny_main, "--config.plugins=no_such.module"],
       ["plugin 'no_such.module' could not be imported", "No module named 'no_such'"]),
      ("main: model dir", "main_table", [tiny_main, f"--config.model.hf_dir={no_model}"],
       [str(no_model), "does not exist"]),
      ("main: variant", "main_table", ["--config=configs/main_table.py:nosuch"],
       ["unknown variant 'nosuch'", "tiny"]),
      ("main: replay run", "main_table", [tiny_main], [str(replay_run), "holds a run"]),
      ("sweep: variant", "sweep", ["--config=configs/sweep.py:nosuch"],
       ["unknown variant 'nosuch'", "test"]),
      ("sweep: study error", "sweep", ["--config=configs/sweep.py:test"],
       [str(sweep_dir / "study"), "a run directory, not a study"]),
      ("decoy: model dir", "decoy_leak", ["--config=configs/decoy_leak.py:tiny",
                                          f"--config.model.hf_dir={no_model}"],
       [str(no_model), "does not exist"]),
      ("replay: rope scaling", "replay", [
          "--config=configs/replay.py", f"--config.capture_dir={root / 'cap'}",
          f"--config.attacker.hf_dir={rope}", f"--config.calibration.tokens_npy={root / 'good.npy'}",
          "--config.attacks=ridge"], ["rope_type 'dynamic'", "unsupported"]),
      ("active: model dir", "active_server", ["--config=configs/active.py:tiny",
                                              f"--config.model.hf_dir={no_model}"],
       [str(no_model), "does not exist"]),
      ("real_weights: variant", "real_weights", ["--config=configs/real_weights.py:nosuch"],
       ["unknown variant 'nosuch'"]),
      ("rescore: not a run", "rescore", [], ["not a run directory"]),
      ("verify: not a run", "verify", [], ["problem(s)"]),
      ("bridge: not a workdir", "bridge", [], []),
  ]
  workdirs = {"main: replay run": replay_run, "sweep: study error": sweep_dir}

  def run(case):
    what, binary, args, _ = case
    workdir = workdirs.get(what, new(what.split(":")[0] + "_" + str(len(what))))
    flag = f"--workdirs={workdir}" if binary == "bridge" else f"--workdir={workdir}"
    return workdir, _run(binary, *args, flag)

  before = {p: _tree(p) for p in workdirs.values()}
  with concurrent.futures.ThreadPoolExecutor(3) as pool:
    results = list(pool.map(run, cases))
  for (what, _, _, facts), (workdir, proc) in zip(cases, results):
    line = _one_line(proc, what)
    for fact in facts:
      assert fact in line, (what, fact, line)
    if workdir in before:
      assert _tree(workdir) == before[workdir], what
    else:
      assert not workdir.exists(), (what, sorted(workdir.rglob("*")))
