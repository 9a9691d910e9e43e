"""Split fine-tuning runs (lla.active.run): determinism, captures, fsha_decode replay."""

import json
import pathlib

import jax
import numpy as np
import pytest

from configs import active
from lla.active import attack as fsha_attack
from lla.active import client, detectors, fsha, run
from lla.replay import regenerate, driver as replay
from lla.capture import store
from lla.data import passages
from lla.evidence import rundir
from lla.model import checkpoint as ckpt
from lla.model import gpt2

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
  return run.Setup(config, "test-config", cfg, params, base.sha256,
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


def test_hijacked_capture_records_the_active_server(runs):
  _, tmp, out = runs
  meta = store.load_capture(tmp / "a" / "captures" / "fsha_s10" / "step_8").metadata
  assert meta["protocol"]["V"] == {"position": "active_server",
                                   "rights": ["observe", "write_gradient"]}
  assert meta["active"]["step"] == 8 and meta["active"]["decoder_sha256"]
  honest = store.load_capture(tmp / "a" / "captures" / "honest_s10" / "step_8").metadata
  assert honest["protocol"]["V"]["position"] == "passive_server"
  assert "decoder_sha256" not in honest["active"]


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
  # The predictions are the stored decoder applied to the stored activations.
  capture = store.load_capture(capture_dir)
  decoder, _ = fsha_attack.load_decoder(str(capture_dir))
  expected = fsha.invert(*(decoder[k] for k in fsha_attack.DECODER_KEYS), capture.activations)
  assert np.array_equal(predictions[0], np.asarray(expected))
  # An honest capture holds no decoder: the attack is recorded crashed, never as a result.
  rundir.create_study(str(tmp / "study3"), {"test": True})
  records = replay.replay(str(tmp / "study3"),
                          str(tmp / "a" / "captures" / "honest_s10" / "step_8"), attacker,
                          ["fsha_decode"], {}, 0)
  assert records[0].status == "crashed" and "no FSHA decoder" in records[0].error


def _wilson_upper_ref(fired: int, n: int, z: float) -> float:
  """One-sided Wilson upper bound as the upper root of p - k/n = z sqrt(p (1 - p) / n)
  (scipy root finding, not the closed form lla.scoring.metrics uses)."""
  from scipy import optimize  # pylint: disable=g-import-not-at-top
  if fired == n:
    return 1.0
  f = lambda p: p - fired / n - z * np.sqrt(p * (1 - p) / n)
  return optimize.brentq(f, fired / n + 1e-12, 1.0, xtol=1e-15)


def _np_lm_loss(params, cfg, tokens: np.ndarray) -> float:
  """Mean next-token CE over all B (T - 1) positions of the whole model, float64 numpy
  (HF GPT-2: blocks, ln_f, head tied to wte)."""
  from test_attacks_units import np_client  # pylint: disable=g-import-not-at-top
  p = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), params)
  x = np_client(params, cfg, tokens, cfg.n_layer)
  mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
  y = (x - mu) / np.sqrt(var + cfg.layer_norm_epsilon) * p["ln_f"]["scale"] + p["ln_f"]["bias"]
  logits = y @ p["wte"]["embedding"].T
  top = logits.max(-1, keepdims=True)
  lse = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
  picked = np.take_along_axis(logits[:, :-1], tokens[:, 1:, None], -1)[..., 0]
  return float(np.mean(lse[:, :-1] - picked))


@pytest.mark.slow
def test_tiny_experiment_end_to_end(tmp_path):
  """configs/active.py:tiny through run.run and the report (WikiText-2, tiny model), its
  numbers checked against quantities the test derives itself: recovery and the frequency
  baseline recounted with numpy from the stored predictions and the client's documents;
  the step-0 captures against a float64 numpy client of the base model (no server has
  changed the client yet); the mixed server's reply against its formula applied to the
  honest and FSHA replies; the task loss at step 0 against a numpy forward; thresholds and
  detection rates recounted from the stored windows.

  Not asserted, because it does not hold here: fsha_decode beating the frequency baseline.
  With 16 hijacked steps on a randomly initialised model the decoder recovers nothing
  (0 of 256 tokens vs a baseline of 8); FSHA needed thousands of steps on MNIST
  (notes/active-server.md 1.5).
  """
  from lla.active import report  # pylint: disable=g-import-not-at-top
  config = active.get_config("tiny")
  summary = run.run(config, str(tmp_path))
  servers = {r["server"] for r in summary["recovery"]}
  assert servers == {"honest", "fsha", "mixed0.2"}
  assert set(summary["detection"]) == {"splitguard", "reference_cosine", "scrutinizer",
                                       "splitout"}
  from lla import data  # pylint: disable=g-import-not-at-top
  splits = data.load_splits(**config.data.to_dict())
  documents = np.asarray(splits.evaluation.tokens)
  # The frequency baseline: the calibration corpus's most common token (unique here).
  counts = np.bincount(np.asarray(splits.calibration.tokens).reshape(-1))
  assert np.sum(counts == counts.max()) == 1
  top = int(counts.argmax())

  # --- recovery, recounted: every row of the summary from its stored predictions ----------
  study = tmp_path / "study"
  rows = {(r["server"], r["step"], r["attack"]): r for r in summary["recovery"]}
  expected_rows = {(server, step, attack) for step in (0, 16)
                   for server, attacks in (("honest", config.replay.honest),
                                           ("fsha", config.replay.hijacked),
                                           ("mixed0.2", config.replay.hijacked))
                   for attack in attacks}
  assert set(rows) == expected_rows
  predictions = {}
  for (server, step, attack), row in rows.items():
    record = json.loads((study / rundir.RECORDS /
                         f"active__{server}_s0__step{step}__{attack}.json").read_text())
    assert record["status"] == "ok" and record["baseline_token"] == top, record
    pred = rundir.load_predictions(rundir.resolve(str(study), record["prediction_file"]))
    predictions[server, step, attack] = pred
    assert pred.shape == documents.shape
    assert row["token_recovery"] == np.mean(pred == documents), (server, step, attack)
    assert row["baseline"] == np.mean(documents == top)
  # Step 0: no server has touched the client yet, so every server's capture holds the same
  # h and a passive attack predicts the same tokens on each.
  assert np.array_equal(predictions["honest", 0, "ridge"], predictions["fsha", 0, "ridge"])
  assert np.array_equal(predictions["honest", 0, "ridge"], predictions["mixed0.2", 0, "ridge"])
  # With the client's exact weights at step 0 (trained knowledge = the base), the beam search
  # verifies ridge's candidates through the true client: it keeps what ridge gets right.
  assert rows["honest", 0, "activation"]["token_recovery"] >= \
      rows["honest", 0, "ridge"]["token_recovery"] > 0.5

  # --- the step-0 captures against numpy -----------------------------------------------
  from test_attacks_units import np_client  # pylint: disable=g-import-not-at-top
  base = ckpt.restore(tmp_path / "base")
  h_ref = np_client(base.params, base.cfg, documents, config.cut)
  caps = {s: store.load_capture(tmp_path / "captures" / f"{s}_s0" / "step_0")
          for s in ("honest", "fsha", "mixed0.2")}
  for server, c in caps.items():
    np.testing.assert_allclose(c.activations, h_ref, rtol=0, atol=1e-5 * np.abs(h_ref).max())
    assert np.array_equal(c.activations, caps["honest"].activations), server
    # h[:, T-1] reaches no loss term: an honest reply's last row is zero, and the hijacker
    # (zero_last_row) copies that.
    assert not c.gradients[:, -1].any() and c.gradients[:, :-1].any(), server
  # The mixed server's reply is (1 - beta) g_task + beta |g_task| / |g_adv| g_adv per row; at
  # step 0 its two halves are the honest server and the FSHA server of the same seed.
  g_task, g_adv = (caps[s].gradients.astype(np.float64) for s in ("honest", "fsha"))
  norm = lambda g: np.linalg.norm(g, axis=-1, keepdims=True)
  ratio = np.divide(norm(g_task), norm(g_adv), out=np.zeros_like(norm(g_adv)),
                    where=norm(g_adv) > 0)
  mixed = 0.8 * g_task + 0.2 * ratio * g_adv
  np.testing.assert_allclose(caps["mixed0.2"].gradients, mixed, rtol=0,
                             atol=1e-5 * np.abs(mixed).max())

  # --- task loss: step 0 is the base model on the documents, for every server -----------
  ce0 = _np_lm_loss(base.params, base.cfg, documents)
  losses = {(r["server"], r["step"]): r for r in summary["task_loss"]}
  for server in ("honest", "fsha", "mixed0.2"):
    assert losses[server, 0]["task_loss"] == pytest.approx(ce0, rel=1e-5), server
    assert losses[server, 0]["public_tail_loss"] == pytest.approx(ce0, rel=1e-5), server
  # FSHA trains no task tail: its deployed model is the public tail at every step.
  assert losses["fsha", 16]["task_loss"] == losses["fsha", 16]["public_tail_loss"]

  # --- detection: thresholds and rates recounted from the stored windows -----------------
  calibration = json.loads((tmp_path / "runs" / "honest_s100.json").read_text())["windows"]
  z = float(config.detectors.wilson_z)
  for name, det in summary["detection"].items():
    scores = sorted(score for _, score in calibration[name])
    # numpy's "higher" quantile: the order statistic at ceil(q (n - 1)) (the maximum here).
    index = int(np.ceil(float(config.detectors.quantile) * (len(scores) - 1)))
    assert det["threshold"] == scores[index], name
    for server in servers:
      windows = summary["curves"][f"{server}_s0"]["windows"][name]
      fired = [step for step, score in windows if score > det["threshold"]]
      got = det[server]
      assert (got["windows"], got["fired"]) == (len(windows), len(fired)), (name, server)
      assert got["first_steps"] == [fired[0] if fired else None], (name, server)
      assert got["wilson_upper"] == pytest.approx(
          _wilson_upper_ref(len(fired), len(windows), z), abs=1e-9), (name, server)
  # Reference cosine at step 0: the honest server's tail is the client's public reference,
  # so its score 1 - cos is 0; the mixed reply's cosine with the task gradient is
  # (1 - beta) / sqrt((1 - beta)^2 + beta^2) where the critic's gradient is orthogonal to it
  # (nearly so here); FSHA's critic gradient is unrelated to the task: 1 - cos near 1, so
  # it fires at the first check.
  first = {server: dict(summary["curves"][f"{server}_s0"]["windows"]["reference_cosine"])[0]
           for server in servers}
  assert abs(first["honest"]) < 1e-6, first
  assert first["mixed0.2"] == pytest.approx(1 - 0.8 / np.sqrt(0.8 ** 2 + 0.2 ** 2), abs=0.01)
  assert first["fsha"] > 0.5 > summary["detection"]["reference_cosine"]["threshold"]
  assert summary["detection"]["reference_cosine"]["fsha"]["first_steps"] == [0]

  card = json.loads((tmp_path / "study" / "scorecard.json").read_text())
  assert card["coverage"]["tiers"]["active"]["partial"] + \
      card["coverage"]["tiers"]["active"]["covered"] >= 1
  assert summary["decoy_probe"]["table"]
  path = report.write(tmp_path, tmp_path / "report")
  text = path.read_text()
  assert "fsha_decode (none)" in text and "Decoy-row split" in text
  for figure in ("active_recovery.png", "active_detection.png", "active_decoy_probe.png"):
    assert (tmp_path / "report" / figure).stat().st_size > 0


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
