"""Defended captures of the main job are reused only when their identity matches.

A defended capture (lla.study.defense_sweep) records the model it was captured from, the
defense's public parameters and the hash of the defender's secret. On resume it is reused
only if all of them match what this job would capture now: a lost key store (a new secret
drawn) or a fine-tune done again (another model id) is refused with one line naming what
differs, before anything is paired with it. A defended fine-tune made with another secret
is refused the same way, and the main job's CLI reports either as one line, no traceback.
"""

import hashlib
import json
import pathlib
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

from configs import finetune as finetune_config
from lla import defenses
from lla.capture import store
from lla.data import passages
from lla.model import checkpoint as ckpt
from lla.model.gpt2 import GPT2Config, init_params
from lla.study import defense_sweep
from lla.train import finetune

REPO = pathlib.Path(__file__).resolve().parent.parent
CFG = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=3, n_head=2)
K = 2
LABEL = "gaussian_sigma0.5"
HASHES = {"evaluation": "e" * 64, "calibration": "c" * 64}


def commitment(value: int) -> str:
  """The secret's public hash, written out here (PROTOCOL section 5a, lla.defenses.seed_hash)."""
  return hashlib.sha256(f"lla.defense.seed/{value}".encode()).hexdigest()


def stored_secret(path: pathlib.Path, target: str) -> int:
  return int(json.loads(path.read_text())[target])


@pytest.fixture(scope="module")
def model():
  params = init_params(CFG, jax.random.key(0))
  tokens = np.random.default_rng(1).integers(0, CFG.vocab_size, (6, 8)).astype(np.int32)
  return params, tokens


def capture(directory, target, secret, tokens):
  return defense_sweep.defended_capture(
      directory, target, defenses.make("gaussian", sigma=0.5), secret, LABEL, False, tokens,
      list(range(len(tokens))), K, "synthetic", HASHES, 4)


def snapshot(directory: pathlib.Path) -> dict:
  return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_lost_key_store_or_new_fine_tune_is_refused_naming_what_differs(model, tmp_path):
  params, tokens = model
  store_path = tmp_path / "workdir" / defense_sweep.KEY_STORE
  directory = tmp_path / "captures" / f"def_{LABEL}_m0"
  target = types.SimpleNamespace(params=params, cfg=CFG, model_id="model-a")
  secret = defense_sweep.KeyStore(store_path).secret(f"{LABEL}/m0")
  sha = capture(directory, target, secret, tokens)
  first = commitment(stored_secret(store_path, f"{LABEL}/m0"))
  t = json.loads((directory / "metadata.json").read_text())["protocol"]["T"]
  assert (t["model_id"], t["defense"], t["defense_seed_sha256"]) == ("model-a", "gaussian", first)
  assert t["defense_params"]["label"] == LABEL
  before = snapshot(directory)

  # Resumed with the same key store: the same secret, the capture reused as it is.
  again = defense_sweep.KeyStore(store_path).secret(f"{LABEL}/m0")
  assert capture(directory, target, again, tokens) == sha
  assert snapshot(directory) == before

  # The key store lost: a new secret is drawn, and the capture made with the old one is
  # refused (the fine-tune, utility and records would otherwise use another secret).
  store_path.unlink()
  fresh = defense_sweep.KeyStore(store_path).secret(f"{LABEL}/m0")
  second = commitment(stored_secret(store_path, f"{LABEL}/m0"))
  assert second != first
  with pytest.raises(store.CaptureError) as refused:
    capture(directory, target, fresh, tokens)
  message = str(refused.value)
  assert "\n" not in message and message.startswith(str(directory))
  assert f"T.defense_seed_sha256 (stored '{first}', expected '{second}')" in message
  assert "T.model_id" not in message
  assert snapshot(directory) == before

  # The fine-tune done again (another model id), same secret: refused, naming the model.
  redone = types.SimpleNamespace(params=params, cfg=CFG, model_id="model-b")
  with pytest.raises(store.CaptureError) as refused_model:
    capture(directory, redone, again, tokens)
  message_model = str(refused_model.value)
  assert "\n" not in message_model
  assert "T.model_id (stored 'model-a', expected 'model-b')" in message_model
  assert "T.defense_seed_sha256" not in message_model
  assert snapshot(directory) == before

  # The main job's CLI: the refusal is one line on stderr and a non-zero exit.
  code = ("import sys\n"
          "from absl import app\n"
          "import experiments.main_table as cli\n"
          "from lla.capture import store\n"
          "def run(config, workdir):\n"
          "  raise store.CaptureError(sys.argv[1])\n"
          "cli.main_table.run = run\n"
          "app.run(cli.main, argv=['main_table', '--workdir=' + sys.argv[2]])\n")
  done = subprocess.run([sys.executable, "-c", code, message, str(tmp_path / "workdir")],
                        cwd=REPO, capture_output=True, text=True, timeout=240,
                        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin",
                             "PYTHONPATH": str(REPO), "HOME": str(tmp_path)})
  assert done.returncode == 1, done.stderr
  assert done.stderr.strip() == f"error: {message}"


def _splits():
  rng = np.random.default_rng(0)
  windows = rng.integers(0, 128, (32, 12)).astype(np.int32)
  make = lambda ids: passages.make_passages(windows, np.asarray(ids), "train")
  return passages.Splits(corpus="synthetic", seq_len=12, seed=0, calibration=make(range(8)),
                         training=make(range(8, 16)), evaluation=make(range(16, 32)),
                         provenance={})


def test_defended_fine_tune_made_with_another_secret_is_refused(tmp_path):
  config = finetune_config.get_config("tiny")
  config.model.update(vocab_size=128, n_positions=16)
  config.update({"num_models": 1, "batch_size": 8, "num_epochs": 1})
  from lla.model import loading  # pylint: disable=g-import-not-at-top
  cfg = loading.architecture(config.model)
  params = init_params(cfg, jax.random.key(0))
  model_id, info = loading.identify(ckpt.params_sha256(params), cfg, None)
  base = loading.LoadedModel(params, cfg, None, model_id, "test", info)
  defense = defenses.make("gaussian", sigma=0.5)
  first, second = defenses.Secret.explicit(11), defenses.Secret.explicit(12)
  made = finetune.finetune(config, tmp_path, _splits(), base, defense=defense, secret=first)
  assert finetune.finetune(config, tmp_path, _splits(), base, defense=defense,
                           secret=first)[0].sha256 == made[0].sha256
  with pytest.raises(finetune.CheckpointMismatch) as refused:
    finetune.finetune(config, tmp_path, _splits(), base, defense=defense, secret=second)
  message = str(refused.value)
  assert "\n" not in message
  assert "differs in run_config.defense.secret_sha256)" in message
