"""An attack written outside lla (examples/knn_attack.py) through replay, scoring and verify."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from lla.attacks import registry
from lla.capture import capture
from lla.evidence import rundir
from lla.model import hf_io
from lla.model.gpt2 import GPT2Config
from lla.scoring import scorecard

from test_attacks_units import random_params

REPO = pathlib.Path(__file__).resolve().parent.parent
CFG = GPT2Config(vocab_size=256, n_positions=16, n_embd=32, n_head=4, n_layer=3)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("plugin")
  params = random_params(CFG, seed=5, std=0.05)
  hf_io.save_hf_dir(params, CFG, root / "hf")
  params, _ = hf_io.load_hf_dir(root / "hf")
  rng = np.random.default_rng(5)
  # Documents made of a few calibration rows, so nearest neighbours have something to find.
  cal = rng.integers(0, CFG.vocab_size, (16, 8)).astype(np.int32)
  tokens = cal[rng.integers(0, 16, 6)]
  np.save(root / "cal.npy", cal)
  capture.capture_target(str(root / "cap"), params, CFG, tokens, range(6), 2, model_id="tiny",
                         training=False)
  return root, tokens


def replay_binary(root, workdir, *extra):
  cmd = [sys.executable, "-m", "experiments.replay", "--config=configs/replay.py",
         f"--config.capture_dir={root / 'cap'}", f"--config.attacker.hf_dir={root / 'hf'}",
         f"--config.calibration.tokens_npy={root / 'cal.npy'}", f"--workdir={workdir}", *extra]
  return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_plugin_replays_scores_and_verifies(setup, tmp_path):
  root, tokens = setup
  run = tmp_path / "run"
  proc = replay_binary(root, run, "--config.plugins=examples.knn_attack",
                       "--config.attacks=knn", "--config.plugin_budget=knn_neighbours=1")
  assert proc.returncode == 0, proc.stderr[-3000:]
  record, = rundir.load_records(str(run))
  assert (record.attack, record.family, record.status) == ("knn", "nearest_neighbour", "ok")
  assert record.budget == {"knn_neighbours": 1}
  assert record.flops > 0 and "calibration_activations" in record.stages
  predictions = rundir.load_predictions(str(run / record.prediction_file))
  # Every document is a calibration document: the nearest row at each position is its own.
  assert np.mean(predictions == tokens) == 1.0
  card = scorecard.build(str(run), modules=registry.module_entries())
  row, = card["rows"]
  assert row["metrics"]["token_recovery"] == 1.0
  assert rundir.verify(str(run)) == []


def test_plugin_errors_are_one_line(setup, tmp_path):
  root, _ = setup
  proc = replay_binary(root, tmp_path / "a", "--config.plugins=examples.no_such_module",
                       "--config.attacks=knn")
  assert proc.returncode != 0
  assert "plugin 'examples.no_such_module' could not be imported" in proc.stderr
  proc = replay_binary(root, tmp_path / "b", "--config.plugins=examples.knn_attack",
                       "--config.attacks=knn", "--config.plugin_budget=knn_neighbours=0")
  assert proc.returncode != 0
  assert "budget field knn_neighbours=0 is not allowed: expected [1, 64] (int)" in proc.stderr
  proc = replay_binary(root, tmp_path / "c", "--config.plugins=examples.knn_attack",
                       "--config.attacks=activation", "--config.plugin_budget=knn_neighbours=2")
  assert proc.returncode != 0
  assert "knn_neighbours=2 is read by none of the requested attacks (activation)" in proc.stderr
  assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
  assert not (tmp_path / "c").exists()
