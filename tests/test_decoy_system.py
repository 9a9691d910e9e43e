"""The decoy-row split (lla.decoy): gauge, UCN symmetry, zero decoy gradients, attacks."""

import jax
import numpy as np
import pytest

from configs import decoy_leak
from lla.decoy import attacks, capture, data, system
from lla.model.gpt2 import GPT2Config, init_params

STEPS = 64


@pytest.fixture(scope="module")
def captures():
  """Tiny system trained STEPS steps without and with the mitigation (same seeds)."""
  train, _, vocab = data.load_blocks("synthetic", 32, vocab=64, n_tokens=6000, seed=0)
  cfg = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=2, n_head=2)
  params = init_params(cfg, jax.random.PRNGKey(0))
  out = {}
  for name, grad_clip in (("none", 0.0), ("mitigated", 0.01)):
    spec = system.SplitSpec(cfg=cfg, cut=1, width=16, pool_size=128, grad_clip=grad_clip)
    state = system.init_state(spec, params, train[:4], jax.random.PRNGKey(1))
    _, out[name] = system.train(spec, state, train[4:4 + STEPS], jax.random.PRNGKey(2), chunk=32)
    out[name]["truth"] = capture.truth_from_perm(out[name]["perm"], train[4:4 + STEPS], 32)
  return out


def test_decoy_gradient_rows_exactly_zero_without_mitigation(captures):
  c = captures["none"]
  decoy = c["truth"]["real_mask"] == 0
  assert c["gradient"].shape == (STEPS, 80, 16)
  assert np.all(c["gradient"][decoy] == 0.0)
  assert np.all(np.any(c["gradient"][~decoy] != 0.0, axis=-1))


def test_no_gradient_row_zero_with_mitigation(captures):
  g = captures["mitigated"]["gradient"]
  assert np.all(np.any(g != 0.0, axis=-1))


def test_structural_attack(captures):
  exact = attacks.structural(captures["none"]["gradient"], captures["none"]["truth"]["real_mask"])
  assert exact["frames_exact"] == STEPS and exact["row_agreement"] == 1.0
  mit = attacks.structural(captures["mitigated"]["gradient"],
                           captures["mitigated"]["truth"]["real_mask"])
  assert mit["frames_exact"] == 0 and mit["row_agreement"] == pytest.approx(32 / 80)


def _chance(n_real: int, n_rows: int) -> float:
  return 1.0 - 2.0 * n_real * (n_rows - n_real) / n_rows**2


def _top_norm_rows(gradient: np.ndarray, n_real: int) -> np.ndarray:
  """Each frame's rows whose norm reaches its n_real-th largest (no ties in float64)."""
  norms = np.sqrt((gradient.astype(np.float64) ** 2).sum(-1))
  return np.stack([row >= np.sort(row)[-n_real] for row in norms]).astype(np.int32)


def test_norm_attack_reads_the_mitigated_norms(captures):
  none, mit = captures["none"], captures["mitigated"]
  # Unmitigated: decoy gradients are zero, so the 32 longest rows are the real ones.
  exact = attacks.norm_prediction(none["gradient"], 32)
  np.testing.assert_array_equal(exact, none["truth"]["real_mask"])
  # Mitigated: the same rows as an independent ranking, and far above chance although the
  # structural attack is at its base rate there (test_structural_attack).
  pred = attacks.norm_prediction(mit["gradient"], 32)
  np.testing.assert_array_equal(pred, _top_norm_rows(mit["gradient"], 32))
  assert np.all(pred.sum(1) == 32)
  scores = attacks.row_mask_scores(pred, mit["truth"]["real_mask"])
  chance = _chance(32, 80)
  assert scores["row_agreement"] > chance + 5 * np.sqrt(chance * (1 - chance) / pred.size)
  # The same mechanism with no signal in the real rows (noise alone everywhere): chance.
  noise = np.random.default_rng(0).normal(0, 0.35, (512, 80, 16))
  truth = np.zeros((512, 80), np.int32)
  truth[:, :32] = 1
  blind = attacks.row_mask_scores(attacks.norm_prediction(noise, 32), truth)
  assert abs(blind["row_agreement"] - chance) < 5 * np.sqrt(chance * (1 - chance) / truth.size)


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "qwen2", "gemma3"])
def test_every_family_trains_and_leaks_through_zero_decoy_gradients(family, tmp_path):
  """The TLN's model is any family's (the tiny random checkpoints of
  tests/test_attacks_families.py, through an HF directory as `configs/decoy_leak.py` names
  one): the split trains (the loss falls from its start) and, unmitigated, the decoy rows'
  returned gradients are exactly zero, so the structural attack is exact on every frame."""
  from lla.decoy import run
  from lla.model import decoder, hf_io
  from test_attacks_families import CONFIGS
  hf_io.save_hf_dir(decoder.random_params(CONFIGS[family], seed=2, std=0.05), CONFIGS[family],
                    tmp_path / family)
  train, _, vocab = data.load_blocks("synthetic", 32, vocab=64, n_tokens=6000, seed=0)
  config = decoy_leak.get_config("tiny")
  config.model.hf_dir = str(tmp_path / family)
  params, cfg, _ = run.load_model(config, vocab, seed=0)
  assert cfg == CONFIGS[family]
  spec = system.SplitSpec(cfg=cfg, cut=1, width=16, pool_size=128)
  state = system.init_state(spec, params, train[:4], jax.random.PRNGKey(1))
  steps = 32
  _, out = system.train(spec, state, train[4:4 + steps], jax.random.PRNGKey(2), chunk=32)
  truth = capture.truth_from_perm(out["perm"], train[4:4 + steps], 32)
  decoy = truth["real_mask"] == 0
  assert np.all(out["gradient"][decoy] == 0.0)
  assert np.all(np.any(out["gradient"][~decoy] != 0.0, axis=-1))
  assert attacks.structural(out["gradient"], truth["real_mask"])["frames_exact"] == steps
  assert out["loss"][-8:].mean() < out["loss"][:8].mean(), out["loss"]


def test_gauge_round_trip():
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  rows = jax.random.normal(k1, (80, 64))
  perm, rot = jax.random.permutation(k2, 80), system.haar(k3, 64)
  np.testing.assert_allclose(rot @ rot.T, np.eye(64), atol=1e-5)
  np.testing.assert_allclose(system.from_wire(system.to_wire(rows, perm, rot), perm, rot), rows,
                             atol=1e-5)


def test_ucn_commutes_with_rotation_and_permutation():
  k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(3), 4)
  ucn = system.init_ucn(k1, 32)
  ucn["w2"] = jax.random.normal(k4, ucn["w2"].shape)  # Not the identity map.
  x = jax.random.normal(k2, (80, 64))
  perm, rot = jax.random.permutation(k3, 80), system.haar(k3, 64)
  np.testing.assert_allclose(system.ucn_apply(ucn, system.to_wire(x, perm, rot)),
                             system.to_wire(system.ucn_apply(ucn, x), perm, rot), atol=1e-4)
  assert not np.allclose(system.ucn_apply(ucn, x), x)


def test_probe_detects_injected_leak_not_shuffled_labels():
  rng = np.random.default_rng(0)
  frames, rows, width = 200, 32, 16
  labels = rng.zipf(1.5, size=(frames, rows)).clip(max=40).astype(np.int32)
  grad = rng.standard_normal((frames, rows, width)).astype(np.float32)
  fwd = rng.standard_normal((frames, rows, width)).astype(np.float32)
  grad = attacks.inject(grad, labels, rho=1.0, amp=1.0, seed=0)
  np.testing.assert_allclose(np.linalg.norm(grad, axis=-1),
                             np.linalg.norm(attacks.inject(grad, labels, 0.0, 1.0, 0), axis=-1))
  train, test = attacks.split_frames(frames, 0)
  cfg = decoy_leak.get_config("tiny").probe
  policy = {"alpha": 0.05, "threshold_pp": 1.0,
            "bootstrap": {"replicates": 200, "seed": 0, "confidence": 0.95}}
  feats = attacks.arm_features(fwd, grad, train)
  res = attacks.content({"gradient": feats["gradient"]}, labels, train, test, cfg, 2, policy, 0)
  for kind in ("linear", "mlp"):
    arm = res["arms"][f"gradient/{kind}"]
    assert arm["ci_pp"][0] > 10.0
    assert arm["shuffled"]["advantage_pp"] < 1.0
  assert res["gate"] == "FAIL"


def test_capture_round_trip_and_tamper(captures, tmp_path):
  c = captures["none"]
  directory = str(tmp_path / "cap")
  capture.write(directory, c["forward"], c["gradient"], c["truth"], {"session_id": "t"})
  messages, truth, metadata, _ = capture.read(directory)
  np.testing.assert_array_equal(messages["gradient"], c["gradient"])
  np.testing.assert_array_equal(truth["real_mask"], c["truth"]["real_mask"])
  assert metadata["session_id"] == "t" and capture.is_complete(directory)
  with open(tmp_path / "cap" / capture.TRUTH, "ab") as f:
    f.write(b"x")
  with pytest.raises(ValueError, match="manifest"):
    capture.read(directory)
