"""Split fine-tuning runs (lla.active.run): determinism, captures, fsha_decode replay."""

import hashlib
import json
import pathlib

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from configs import active
from lla.active import attack as fsha_attack
from lla.active import client, detectors, fsha, run
from lla.replay import regenerate, driver as replay
from lla.capture import store
from lla.data import passages
from lla.evidence import rundir
from lla.model import checkpoint as ckpt
from lla.model import gpt2, loading

V, T = 64, 8
SEED = 10  # With 8 steps its SplitGuard plan has fake batches after R1 and R2 fill.


def _setup(tmp: pathlib.Path, cfg=None, params=None, num_steps: int = 8) -> run.Setup:
  """A tiny experiment (cut 1, batches of 4, SplitGuard from step 0) on `cfg` and `params`
  (default: a random 3-layer GPT-2 of V = 64), captures at step 0 and `num_steps`."""
  config = active.get_config("tiny")
  config.batch_size, config.num_steps, config.cut = 4, num_steps, 1
  config.capture_steps = (0, num_steps)
  config.detectors.splitguard_warmup, config.detectors.p_fake = 0, 0.5
  if cfg is None:
    cfg = gpt2.GPT2Config(vocab_size=V, n_positions=T, n_embd=16, n_layer=3, n_head=2)
    params = gpt2.init_params(cfg, jax.random.key(0))
  base = ckpt.save(tmp / "base", params, cfg, {"kind": "test"}, export_hf=False)
  rng = np.random.default_rng(0)
  windows = rng.integers(0, cfg.vocab_size, (64, T)).astype(np.int32)
  drawn = passages.draw_splits({"train": windows, "test": windows[::-1].copy()},
                               {"calibration": "train", "training": "train",
                                "evaluation": "test"},
                               {"calibration": 8, "training": 16, "evaluation": 8}, 0)
  splits = passages.Splits(corpus="synthetic", seq_len=T, seed=0, provenance={}, **drawn)
  spec = run.fsha_spec(config, cfg)
  pilot, _ = fsha.pretrain(fsha.init_pilot(spec, jax.random.key(1)),
                           [windows[i:i + 4] for i in range(0, 16, 4)], 1e-3)
  cspec = client.ClientSpec.make(cfg, 1, config.client_optimizer, num_steps)
  # The base's model id as the loader gives it (params, config, tokenizer): what replay's
  # regeneration finds on reloading it.
  base_id = loading.load_model({"checkpoint": str(base.path)}).model_id
  return run.Setup(config, "test-config", cfg, params, base_id,
                   {"checkpoint": str(base.path)}, splits, windows[32:], pilot, "test-pilot",
                   cspec)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("active")
  setup = _setup(tmp)
  out = {}
  for name, kinds in (("a", ("honest", "fsha")), ("b", ("fsha",))):
    out[name] = {kind: run.simulate(setup, kind, 0.5, SEED, tmp / name, (0, 8))
                 for kind in kinds}
  return setup, tmp, out


@pytest.mark.slow
def test_a_run_replays_bit_for_bit(runs):
  _, tmp, out = runs
  for kind in ("fsha",):
    a, b = dict(out["a"][kind]), dict(out["b"][kind])
    a.pop("wall_s"), b.pop("wall_s")
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True), kind
    assert all(a["windows"][name] for name in detectors.DETECTORS), a["windows"]
    for step, sha in a["captures"].items():
      directory = tmp / "a" / "captures" / a["name"] / f"step_{step}"
      assert store.verify(directory) == sha
  assert out["a"]["fsha"]["steps"] != out["a"]["honest"]["steps"]


@pytest.mark.slow
def test_hijacked_capture_records_the_active_server(runs):
  _, tmp, out = runs
  directory = tmp / "a" / "captures" / "fsha_s10" / "step_8"
  meta = store.load_capture(directory).metadata
  assert meta["protocol"]["V"] == {"position": "active_server",
                                   "rights": ["observe", "write_gradient"]}
  assert meta["active"]["step"] == 8
  # The recorded hash is that of the decoder file beside the capture, hashed here, and the
  # file holds the decoder's arrays at the shapes of the model it decodes (V = 64, d = 16).
  raw = (directory / meta["active"]["decoder_file"]).read_bytes()
  assert meta["active"]["decoder_sha256"] == hashlib.sha256(raw).hexdigest()
  decoder = load_file(str(directory / meta["active"]["decoder_file"]))
  assert sorted(decoder) == sorted(fsha_attack.DECODER_KEYS)
  assert decoder["emb"].shape == (V, 16) and decoder["bias"].shape == (V,)
  assert decoder["off"].shape == decoder["scale"].shape == (16,)
  honest = store.load_capture(tmp / "a" / "captures" / "honest_s10" / "step_8").metadata
  assert honest["protocol"]["V"]["position"] == "passive_server"
  assert "decoder_sha256" not in honest["active"]


@pytest.mark.slow
def test_fsha_decode_replays_bit_identical(runs):
  setup, tmp, _ = runs
  capture_dir = tmp / "a" / "captures" / "fsha_s10" / "step_8"
  attacker = run._attacker(setup, "none")  # pylint: disable=protected-access
  predictions = []
  for study in ("study1", "study2"):
    rundir.create_study(str(tmp / study), {"test": True})
    records = replay.replay(str(tmp / study), str(capture_dir), attacker, ["fsha_decode"],
                            {}, 0, run_prefix="x/")
    assert records[0].status == "ok", records[0].error
    predictions.append(rundir.load_predictions(
        rundir.resolve(str(tmp / study), records[0].prediction_file)))
  assert np.array_equal(*predictions)
  assert regenerate.regenerate(str(tmp / "study1")) == []
  # The predictions are the stored decoder applied to the stored activations, computed
  # here in float64 numpy from the files: argmax_v tau <(h - off) / scale, emb[v]> + bias[v].
  # Positions whose two best logits float32 could order either way are left out.
  decoder = load_file(str(capture_dir / fsha_attack.DECODER_FILE))
  h = store.load_capture(capture_dir).activations.astype(np.float64)
  d = {k: decoder[k].astype(np.float64) for k in fsha_attack.DECODER_KEYS}
  logits = d["tau"] * (((h - d["off"]) / d["scale"]) @ d["emb"].T) + d["bias"]
  top2 = np.sort(logits, axis=-1)[..., -2:]
  clear = top2[..., 1] - top2[..., 0] > 1e-4 * np.abs(top2[..., 1]).clip(1.0)
  assert clear.mean() > 0.9, clear.mean()
  assert np.array_equal(predictions[0][clear], np.argmax(logits, axis=-1)[clear])
  # An honest capture holds no decoder: the attack is recorded crashed, never as a result.
  rundir.create_study(str(tmp / "study3"), {"test": True})
  records = replay.replay(str(tmp / "study3"),
                          str(tmp / "a" / "captures" / "honest_s10" / "step_8"), attacker,
                          ["fsha_decode"], {}, 0)
  assert records[0].status == "crashed" and "no FSHA decoder" in records[0].error


def test_invert_on_a_hand_built_decoder():
  """fsha.invert on a decoder built by hand: orthogonal token directions of norm 2, h made
  from them through the statistics' offset and scale, so <n(h), emb[v]> is 4 at the token
  and 0 elsewhere; a bias of 5 on one token overrules that at tau = 1, not at tau = 2."""
  vocab, width = 4, 4
  emb = 2.0 * np.eye(vocab, width, dtype=np.float32)
  off = np.array([1.0, -1.0, 0.5, 0.0], np.float32)
  scale = np.array([2.0, 1.0, 4.0, 0.5], np.float32)
  tokens = np.array([[0, 1, 2, 3], [3, 2, 1, 0]], np.int32)
  h = emb[tokens] * scale + off  # [2, 4, d]: n(h) = emb[token]
  zero = np.zeros(vocab, np.float32)
  assert np.array_equal(fsha.invert(emb, 1.0, zero, off, scale, h), tokens)
  bias = np.array([0.0, 0.0, 5.0, 0.0], np.float32)
  assert np.array_equal(fsha.invert(emb, 1.0, bias, off, scale, h), np.full_like(tokens, 2))
  assert np.array_equal(fsha.invert(emb, 2.0, bias, off, scale, h), tokens)


def test_public_text_is_disjoint_from_the_clients_documents(data_dir):
  from lla import data  # pylint: disable=g-import-not-at-top
  from lla.active import public  # pylint: disable=g-import-not-at-top
  splits = data.load_splits(str(data_dir), n_calibration=8, n_train=128, n_eval=8)
  windows = public.public_windows(splits, 500, 0, str(data_dir))
  assert windows.shape == (500, splits.seq_len)
  client_docs = {d.tobytes() for d in np.concatenate([splits.training.tokens,
                                                      splits.evaluation.tokens])}
  assert not any(w.tobytes() in client_docs for w in windows)
  # Every training window was removed from the stream the public windows are cut from.
  stream = data.pretraining_tokens(str(data_dir), exclude=splits, exclude_splits=("training",))
  full = data.pretraining_tokens(str(data_dir))
  assert len(full) - len(stream) == splits.training.tokens.size
