"""Checkpoint IO: export to transformers, sharded checkpoints, and every refusal's message."""

import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

from lla.model import hf_io, split
from lla.model.gpt2 import GPT2Config, init_params
from lla.model.hf_io import CheckpointError

transformers.logging.set_verbosity_error()

CONFIG = dict(n_layer=3, n_embd=48, n_head=3, vocab_size=101, n_positions=40)
TOKENS = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (2, 16), dtype=np.int32)


def assert_close(actual, reference, rtol, what=""):
  """max |actual - reference| <= rtol * max |reference|."""
  actual, reference = np.asarray(actual, np.float64), np.asarray(reference, np.float64)
  assert actual.shape == reference.shape, (what, actual.shape, reference.shape)
  err, scale = np.max(np.abs(actual - reference)), np.max(np.abs(reference))
  assert err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol:g} * {scale:.3g}"


def hf_model(seed: int) -> transformers.GPT2LMHeadModel:
  """A random HF GPT-2 (eval mode) whose LayerNorms and biases are not the trivial init."""
  torch.manual_seed(seed)
  eos = CONFIG["vocab_size"] - 1
  model = transformers.GPT2LMHeadModel(
      transformers.GPT2Config(bos_token_id=eos, eos_token_id=eos, **CONFIG)).eval()
  with torch.no_grad():
    for p in model.parameters():
      if p.ndim == 1:
        p.add_(0.1 * torch.randn_like(p))
  return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.from_numpy(tokens).long()).logits.numpy()


def load_error(directory) -> str:
  """The CheckpointError message of loading `directory`, checked to be one line."""
  with pytest.raises(CheckpointError) as info:
    hf_io.load_hf_dir(directory)
  message = str(info.value)
  assert "\n" not in message, message
  return message


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory); tests copy the directory before damaging it."""
  model = hf_model(seed=0)
  directory = tmp_path_factory.mktemp("hf")
  model.save_pretrained(directory)
  return model, directory


@pytest.fixture
def checkpoint(saved, tmp_path):
  """A fresh, writable copy of the saved checkpoint."""
  return shutil.copytree(saved[1], tmp_path / "ckpt")


def test_export_loads_in_transformers_with_identical_logits(tmp_path):
  cfg = GPT2Config(**CONFIG)
  rng = np.random.default_rng(1)
  # Every leaf random (LayerNorm scales too), so a misplaced tensor cannot go unnoticed.
  params = jax.tree.map(
      lambda p: jnp.asarray(rng.standard_normal(p.shape).astype(np.float32) * 0.1),
      jax.eval_shape(lambda key: init_params(cfg, key), jax.random.key(0)))
  hf_io.save_hf_dir(params, cfg, tmp_path / "out")

  model, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out",
                                                             output_loading_info=True)
  assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
  assert_close(hf_logits(model.eval(), TOKENS), split.logits(params, cfg, jnp.asarray(TOKENS)),
               1e-5, "exported logits")

  reloaded, cfg2 = hf_io.load_hf_dir(tmp_path / "out")
  assert cfg2 == cfg
  jax.tree.map(np.testing.assert_array_equal, reloaded, params)


def test_sharded_checkpoint(tmp_path):
  model = hf_model(seed=2)
  model.save_pretrained(tmp_path, max_shard_size="50KB")
  assert (tmp_path / hf_io.INDEX_FILE).exists() and not (tmp_path / hf_io.WEIGHTS_FILE).exists()
  assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
  params, cfg = hf_io.load_hf_dir(tmp_path)
  assert_close(split.logits(params, cfg, jnp.asarray(TOKENS)), hf_logits(model, TOKENS), 1e-4,
               "sharded logits")


def test_missing_directory(tmp_path):
  message = load_error(tmp_path / "no_such_ckpt")
  assert "no_such_ckpt" in message and "does not exist" in message


def test_missing_config(checkpoint):
  (checkpoint / "config.json").unlink()
  message = load_error(checkpoint)
  assert "config.json" in message and "missing" in message


def test_truncated_safetensors(checkpoint):
  weights = checkpoint / hf_io.WEIGHTS_FILE
  data = weights.read_bytes()
  weights.write_bytes(data[:len(data) // 2])
  message = load_error(checkpoint)
  assert hf_io.WEIGHTS_FILE in message and "truncated" in message


def test_missing_shard(tmp_path):
  hf_model(seed=2).save_pretrained(tmp_path, max_shard_size="50KB")
  shard = sorted(tmp_path.glob("model-*-of-*.safetensors"))[1]
  shard.unlink()
  message = load_error(tmp_path)
  assert shard.name in message and "missing" in message


def test_wrong_shape(checkpoint):
  weights = checkpoint / hf_io.WEIGHTS_FILE
  tensors = safetensors.numpy.load_file(weights)
  name = "transformer.h.1.attn.c_proj.weight"
  tensors[name] = tensors[name][:, :-1]
  safetensors.numpy.save_file(tensors, weights, metadata={"format": "pt"})
  message = load_error(checkpoint)
  assert all(s in message for s in (hf_io.WEIGHTS_FILE, "h.1.attn.c_proj.weight", "shape",
                                    "(48, 47)", "(48, 48)")), message


@pytest.mark.parametrize("n_layer, problem", [(5, "missing"), (2, "not in a GPT-2")])
def test_config_disagrees_with_weights(checkpoint, n_layer, problem):
  config = checkpoint / "config.json"
  config.write_text(config.read_text().replace('"n_layer": 3', f'"n_layer": {n_layer}'))
  message = load_error(checkpoint)
  assert all(s in message for s in (hf_io.WEIGHTS_FILE, "config.json", problem, "h.")), message


def test_pytorch_bin_only_is_refused(checkpoint, saved):
  # transformers 5 ignores safe_serialization=False, so write the legacy pickle directly.
  (checkpoint / hf_io.WEIGHTS_FILE).unlink()
  torch.save(saved[0].state_dict(), checkpoint / "pytorch_model.bin")
  message = load_error(checkpoint)
  assert "pytorch_model.bin" in message and "pickle" in message


def test_hub_unreachable_fails_fast(tmp_path, monkeypatch):
  # Point the hub at a closed local port with an empty cache: the same failure as an offline
  # machine, without downloading 500 MB on a machine that is online.
  import huggingface_hub.constants
  monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
  monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
  start = time.monotonic()
  with pytest.raises(CheckpointError) as info:
    hf_io.load_from_hub("gpt2")
  assert time.monotonic() - start < 20
  message = str(info.value)
  assert "\n" not in message and "'gpt2'" in message and "hub" in message, message
