"""Defended captures from the config / CLI: secrets, records and bad input."""

import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import capture as capture_config
from lla import defenses
from lla.capture import runner, store
from lla.model import hf_io, split
from lla.model.gpt2 import GPT2Config, init_params

CFG = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=3, n_head=2)
K = 2
# Large enough that its digits cannot appear in a file by chance.
SEED = 2**100 + 918273645


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
  root = tmp_path_factory.mktemp("inputs")
  params = init_params(CFG, jax.random.key(0))
  hf_io.save_hf_dir(params, CFG, root / "model")
  tokens = np.random.default_rng(1).integers(0, CFG.vocab_size, (6, 8)).astype(np.int32)
  np.save(root / "tokens.npy", tokens)
  return root, params, tokens


def config_for(inputs, training=False, **defense):
  root, _, _ = inputs
  config = capture_config.get_config("tiny")
  config.model.hf_dir = str(root / "model")
  config.data.tokens_npy = str(root / "tokens.npy")
  config.cut, config.training, config.batch_size = K, training, 4
  for key, value in defense.items():
    config.defense[key] = value
  return config


def metadata(directory):
  return json.loads((pathlib.Path(directory) / "metadata.json").read_text())


def test_same_public_configuration_gets_different_os_secrets(inputs, tmp_path):
  _, params, tokens = inputs
  for run in ("a", "b"):
    runner.capture_from_config(config_for(inputs, name="projection", kind="haar"), tmp_path / run)
  a, b = (metadata(tmp_path / r)["protocol"]["T"] for r in ("a", "b"))
  assert a["defense"] == b["defense"] == "projection"
  assert a["defense_params"] == b["defense_params"]
  assert dict(a["defense_params"])["secret_source"] == "os_random_128"
  assert len(a["defense_seed_sha256"]) == 64 and a["defense_seed_sha256"] != b["defense_seed_sha256"]
  # Different secret rotations of the same clean messages: the rows differ, their Gram
  # matrices agree with the undefended client's.
  h = np.asarray(split.client(params, CFG, tokens, K), np.float64)
  ha, hb = (store.load_capture(tmp_path / r).activations.astype(np.float64) for r in ("a", "b"))
  assert not np.allclose(ha, hb, atol=1e-3)
  gram = lambda x: np.einsum("btd,bsd->bts", x, x)
  np.testing.assert_allclose(gram(ha), gram(h), rtol=1e-4, atol=1e-4 * np.abs(gram(h)).max())
  np.testing.assert_allclose(gram(hb), gram(h), rtol=1e-4, atol=1e-4 * np.abs(gram(h)).max())


def test_explicit_seed_is_marked_reproducible_and_never_written(inputs, tmp_path):
  config = config_for(inputs, training=True, name="gaussian", sigma=0.5, secret_seed=SEED)
  for run in ("a", "b"):
    runner.capture_from_config(config, tmp_path / run)
  a, b = store.load_capture(tmp_path / "a"), store.load_capture(tmp_path / "b")
  np.testing.assert_array_equal(a.activations, b.activations)
  assert a.gradients is not None
  target = a.metadata["protocol"]["T"]
  assert dict(target["defense_params"]) == {"clip_norm": None, "sigma": 0.5, "strength": 0.5,
                                            "secret_source": "explicit_seed"}
  assert target["defense_seed_sha256"] == defenses.seed_hash(SEED)
  assert a.metadata["batch_size"] == 4 and a.metadata["step"] == [0, 0, 0, 0, 1, 1]
  for path in (tmp_path / "a").rglob("*"):
    data = path.read_bytes()
    for form in (str(SEED), hex(SEED)[2:], SEED.to_bytes(16, "little").hex()):
      assert form.encode() not in data, path


@pytest.mark.parametrize("defense,message", [
    (dict(name="nope"), "unknown defense 'nope'"),
    (dict(name="topk", sigma=0.3), "defense 'topk' does not declare parameter(s) sigma"),
    (dict(name="topk", sparsity=1.5), "sparsity=1.5 must lie in [0, 1)"),
    (dict(name="topk", sparsity=0.5, secret_seed=3), "has no secret"),
    (dict(name="gradient_clip_noise"), "inference capture"),
    (dict(sigma=1.0), "without a defense"),
])
def test_bad_defense_input_is_refused_before_anything_is_written(inputs, tmp_path, defense,
                                                                 message):
  with pytest.raises(defenses.DefenseError) as error:
    runner.capture_from_config(config_for(inputs, **defense), tmp_path / "out")
  assert message in str(error.value) and "\n" not in str(error.value)
  assert not (tmp_path / "out").exists()


def test_cli_exits_non_zero_with_one_line(inputs, tmp_path):
  root, _, _ = inputs
  out = tmp_path / "out"
  result = subprocess.run(
      [sys.executable, "-m", "experiments.capture", "--config=configs/capture.py:tiny",
       f"--config.model.hf_dir={root / 'model'}", f"--config.data.tokens_npy={root / 'tokens.npy'}",
       f"--config.cut={K}", "--config.defense.name=mixup", "--config.defense.m=0",
       f"--workdir={out}"],
      capture_output=True, text=True, timeout=120,
      cwd=pathlib.Path(__file__).resolve().parent.parent)
  assert result.returncode != 0
  assert result.stderr.strip().splitlines()[-1] == "capture: defense 'mixup': m=0 must be >= 1"
  assert not out.exists()
