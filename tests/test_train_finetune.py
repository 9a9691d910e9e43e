"""Seeded fine-tuning and pretraining drivers on a small model and synthetic passages."""

import json

import jax
import numpy as np
import pytest

from configs import finetune as finetune_config
from configs import pretrain as pretrain_config
from lla.data import passages
from lla.model.gpt2 import init_params
from lla.model import checkpoint as ckpt
from lla.train import finetune
from lla.train import loop
from lla.model import loading
from lla.train import pretrain

SMALL = dict(vocab_size=128, n_positions=16)


def _model_config(config):
  config.model.update(SMALL)
  return config


def _splits():
  rng = np.random.default_rng(0)
  windows = rng.integers(0, SMALL["vocab_size"], (48, 12)).astype(np.int32)
  make = lambda ids: passages.make_passages(windows, np.asarray(ids), "train")
  return passages.Splits(corpus="synthetic", seq_len=12, seed=0, calibration=make(range(8)),
                         training=make(range(8, 24)), evaluation=make(range(24, 48)),
                         provenance={})


@pytest.fixture(scope="module")
def base():
  config = _model_config(finetune_config.get_config("tiny"))
  cfg = loading.architecture(config.model)
  params = init_params(cfg, jax.random.key(0))
  model_id, info = loading.identify(ckpt.params_sha256(params), cfg, None)
  return loading.LoadedModel(params, cfg, None, model_id, "test", info)


def _config(**changes):
  config = _model_config(finetune_config.get_config("tiny"))
  config.update({"num_models": 2, "batch_size": 8, "num_epochs": 1, **changes})
  return config


def test_seeds_reproducible_and_distinct(tmp_path, base):
  splits = _splits()
  first = finetune.finetune(_config(), tmp_path / "a", splits, base)
  again = finetune.finetune(_config(first_seed=1, num_models=1), tmp_path / "b", splits, base)
  assert [c.metadata["seed"] for c in first] == [0, 1]
  assert first[0].sha256 != first[1].sha256  # Different seeds differ.
  assert again[0].sha256 == first[1].sha256  # Same seed, another run: identical.
  manifest = json.loads((tmp_path / "a" / finetune.MANIFEST_FILE).read_text())
  assert [m["params_sha256"] for m in manifest] == [c.sha256 for c in first]
  assert first[0].metadata["knowledge"] == "public"
  # The base is cut by GPT-2's tokenizer: each copy records it, so that it is cut as its
  # base whatever its vocabulary (here 128, which alone would not say GPT-2's).
  assert all(c.metadata["tokenizer"] == {"kind": ckpt.GPT2_TOKENS} for c in first)
  assert all(loading.load_model({"checkpoint": str(c.path)}).tokenizer_kind
             == loading.GPT2_TOKENIZER for c in first)


@pytest.mark.parametrize("train_client_layers", [False, True])
def test_client_layers_follow_the_switch(tmp_path, base, train_client_layers):
  config = _config(num_models=1, train_client_layers=train_client_layers)
  (tuned,) = finetune.finetune(config, tmp_path, _splits(), base)
  for name in ("wte", "wpe", *(f"h_{i}" for i in range(config.k))):  # GPT-2's client
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
               zip(jax.tree.leaves(base.params[name]), jax.tree.leaves(tuned.params[name])))
    assert same == (not train_client_layers), name
  assert tuned.metadata["knowledge"] == ("trained" if train_client_layers else "public")


def test_finished_seeds_are_reused(tmp_path, base, monkeypatch):
  splits = _splits()
  first = finetune.finetune(_config(num_models=1), tmp_path, splits, base)
  monkeypatch.setattr(loop, "train", lambda *a, **k: pytest.fail("retrained a finished seed"))
  again = finetune.finetune(_config(num_models=1), tmp_path, splits, base)
  assert again[0].sha256 == first[0].sha256
  with pytest.raises(ValueError, match="different config"):
    finetune.finetune(_config(num_models=1, batch_size=4), tmp_path, splits, base)


def test_pretrain_cached_and_config_checked(tmp_path, monkeypatch):
  config = _model_config(pretrain_config.get_config("tiny"))
  config.update(dict(seq_len=12, num_steps=3, batch_size=4, export_hf=False))
  windows = _splits().calibration.tokens
  first = pretrain.pretrain(config, tmp_path, windows, windows)
  assert first.metadata["valid"]["perplexity"] > 1
  # Trained on GPT-2's tokens (the data directory's tokenizer): recorded, no tokenizer file.
  assert first.metadata["tokenizer"] == {"kind": ckpt.GPT2_TOKENS}
  assert not (first.path / ckpt.TOKENIZER_FILE).exists()
  monkeypatch.setattr(loop, "train", lambda *a, **k: pytest.fail("retrained a cached model"))
  assert pretrain.pretrain(config, tmp_path, windows, windows).sha256 == first.sha256
  config.seed = 1
  with pytest.raises(ValueError, match="different config"):
    pretrain.pretrain(config, tmp_path, windows, windows)
