"""Forward-matching attacks (SIP, BiSR(f), EIA) on a tiny random GPT-2.

A random GPT-2 (V = 64, d = 32, 3 layers, cut k = 2) sends h for 6 documents of 6
uniformly random tokens; the attacker holds the exact weights and 48 calibration
documents. Checked against independent computations: the GRU against torch.nn.GRU, the
embedding-input client against the token client, the EIA loss at one-hot relaxed tokens,
the cosine loss against torch. Then each attack lowers its loss and beats the frequency
baseline; FLOPs grow by exactly one compiled step per step; a NaN crashes that record
only; same key -> same bytes, any chunking -> same bytes; the replay binary takes the new
names and budget fields.
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from lla.attacks.published import bisr_f, eia, sip
from lla.attacks import optimise, registry
from lla.replay import driver as replay
from lla.attacks import budget as budget_lib
from lla.attacks.registry import relevant_budget as relevant
from lla.attacks.workspace import Workspace, compiled
from lla.capture import capture
from lla.model import hf_io, split
from lla.model.gpt2 import GPT2Config

from test_attacks_units import random_params

REPO = pathlib.Path(__file__).resolve().parent.parent
CFG = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_head=4, n_layer=3)
K, B, T, N_CAL = 2, 6, 6, 48
ATTACKS = ["sip", "sip_linear", "bisr_f", "eia"]
# Small budgets for a tiny model: more SIP epochs at a larger learning rate than published
# (48 short documents), a few hundred optimisation steps.
BUDGET = dict(sip_epochs=30, sip_lr=1e-2, sip_hidden=32, sip_batch=6, bisr_f_steps=60,
              eia_steps=150, eia_mapper=False)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("forward")
  params = random_params(CFG, seed=5, std=0.05, emb_std=0.5)
  hf_io.save_hf_dir(params, CFG, root / "hf")
  params, _ = hf_io.load_hf_dir(root / "hf")
  rng = np.random.default_rng(5)
  tokens = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
  cal = rng.integers(0, CFG.vocab_size, (N_CAL, T)).astype(np.int32)
  np.save(root / "cal.npy", cal)
  capture.capture_target(str(root / "cap"), params, CFG, tokens, range(B), K, model_id="tiny",
                         training=False, batch_size=B)
  attacker = replay.Attacker(params, CFG, "tiny", cal, "public", {"hf_dir": str(root / "hf")})
  return root, attacker, tokens


def workspace(attacker, tokens, **kw) -> Workspace:
  h = np.asarray(split.client(attacker.params, CFG, jnp.asarray(tokens), K))
  return Workspace(h, None, attacker.params, CFG, K, attacker.calibration_tokens, **kw)


def baseline_rate(attacker, tokens) -> float:
  return float(np.mean(tokens == np.bincount(attacker.calibration_tokens.ravel()).argmax()))


@pytest.fixture(scope="module")
def results(setup):
  """Each attack once, executed on one workspace (the SIP stage is shared)."""
  _, attacker, tokens = setup
  ws = workspace(attacker, tokens)
  out = {name: registry.execute(name, ws, BUDGET, jax.random.key(0)) for name in ATTACKS}
  return ws, out


# --- independent checks of the pieces ------------------------------------------------


def test_gru_equals_torch_gru():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((3, 5, 7)).astype(np.float32)
  model = sip.GRU(hidden=4)
  params = model.init(jax.random.key(1), jnp.asarray(x))["params"]
  ours = np.asarray(model.apply({"params": params}, jnp.asarray(x)))
  gru = torch.nn.GRU(7, 4, batch_first=True)
  with torch.no_grad():
    gru.weight_ih_l0.copy_(torch.tensor(np.asarray(params["w_ih"]).T))
    gru.weight_hh_l0.copy_(torch.tensor(np.asarray(params["w_hh"]).T))
    gru.bias_ih_l0.copy_(torch.tensor(np.asarray(params["b_ih"])))
    gru.bias_hh_l0.copy_(torch.tensor(np.asarray(params["b_hh"])))
    theirs = gru(torch.tensor(x))[0].numpy()
  np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
  # PyTorch's init range: U(-1/sqrt(H), 1/sqrt(H)).
  assert 0.3 < np.abs(np.asarray(params["w_hh"])).max() <= 0.5


def test_embedded_client_is_the_client_and_losses_match_references(setup):
  _, attacker, tokens = setup
  params = attacker.params
  h = np.asarray(split.client(params, CFG, jnp.asarray(tokens), K))
  e = split.wte(params)[tokens]
  np.testing.assert_allclose(np.asarray(optimise.embedded_client(params, CFG, e, 0, K)), h,
                             rtol=1e-5, atol=1e-5)
  # EIA's relaxed tokens at a near one-hot Z are the tokens themselves: zero loss.
  z = 50.0 * jax.nn.one_hot(tokens, CFG.vocab_size)
  losses = eia._losses(params, CFG, K, z, jnp.asarray(h), 0.3, ())
  assert np.all(np.asarray(losses) < 1e-6 * np.sum(h**2, axis=(1, 2)))
  # BiSR(f)'s cosine loss against torch.cosine_similarity, summed over documents.
  rng = np.random.default_rng(1)
  a, b = rng.standard_normal((2, 3, T, 32)).astype(np.float32)
  ours = np.asarray(bisr_f.match_loss(jnp.asarray(a), jnp.asarray(b), "cosine"))
  theirs = 1 - torch.cosine_similarity(torch.tensor(a), torch.tensor(b), dim=-1).mean(-1)
  np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-5, atol=1e-6)
  mse = np.asarray(bisr_f.match_loss(jnp.asarray(a), jnp.asarray(b), "mse"))
  np.testing.assert_allclose(mse, ((a - b) ** 2).mean(axis=(1, 2)), rtol=1e-5)


# --- the attacks ----------------------------------------------------------------------


def test_sip_trains_and_beats_the_baseline(setup, results):
  _, attacker, tokens = setup
  _, out = results
  p0 = baseline_rate(attacker, tokens)
  for name in ("sip", "sip_linear"):
    result, charge = out[name]
    d = result.details
    assert d["train_loss_per_epoch"][-1] < 0.5 * d["train_loss_per_epoch"][0], name
    assert d["train_documents"] == 36 and d["heldout_documents"] == 12
    held = d["heldout_accuracy_per_epoch"]
    assert d["selected_epoch"] == int(np.argmax(held)) + 1
    accuracy = np.mean(result.predictions == tokens)
    assert accuracy > p0 + 0.4, (name, accuracy, p0)
    assert set(charge.stages) == {f"sip_{result.details['variant']}", "calibration_activations"}
    assert charge.flops_source == "xla"
    assert 0.5 < charge.flops / charge.flops_analytic < 2.0, (name, charge)


def test_bisr_f_lowers_its_loss_and_beats_the_baseline(setup, results):
  _, attacker, tokens = setup
  _, out = results
  result, charge = out["bisr_f"]
  d = result.details
  assert d["steps_run"] == BUDGET["bisr_f_steps"]
  assert d["loss_final"] < 0.2 * d["loss_first"]
  accuracy = np.mean(result.predictions == tokens)
  sip_accuracy = np.mean(out["sip"][0].predictions == tokens)
  assert accuracy > max(sip_accuracy, baseline_rate(attacker, tokens)) + 0.05, (accuracy,
                                                                                 sip_accuracy)
  assert set(charge.stages) == {"sip_gru", "calibration_activations"}
  assert 0.5 < charge.flops / charge.flops_analytic < 2.0, charge


def test_eia_lowers_its_loss_and_beats_the_baseline(setup, results):
  _, attacker, tokens = setup
  _, out = results
  result, charge = out["eia"]
  d = result.details
  assert d["steps_run"] == BUDGET["eia_steps"] and not d["mapper"]
  assert d["loss_final"] < 0.01 * d["loss_first"]
  assert np.mean(result.predictions == tokens) > baseline_rate(attacker, tokens) + 0.5
  assert charge.stages == {}
  assert 0.5 < charge.flops / charge.flops_analytic < 2.0, charge


def test_eia_mapper_trains_and_matches_after_block_one(setup):
  _, attacker, tokens = setup
  ws = workspace(attacker, tokens)
  budget = {**BUDGET, "eia_mapper": True, "eia_mapper_epochs": 3, "eia_steps": 20}
  result, charge = registry.execute("eia", ws, budget, jax.random.key(0))
  assert result.details["mapper"] and result.details["matched_blocks"] == 1
  assert set(charge.stages) == {"eia_mapper", "calibration_activations"}
  assert result.details["loss_final"] < result.details["loss_first"]
  # The mapper beats the best constant map on held-out (captured) messages.
  mapped = np.asarray(eia._apply_mapper(ws._cache["eia_mapper"][0], jnp.asarray(ws.activations)))
  h1 = np.asarray(split.client(attacker.params, CFG, jnp.asarray(tokens), 1))
  assert np.sum((mapped - h1) ** 2) < np.sum((h1 - h1.mean(axis=(0, 1))) ** 2)


def test_flops_count_every_step(setup, results):
  """Running s more steps adds s times the compiled step's own cost analysis."""
  _, attacker, tokens = setup
  ws, _ = results
  charges = [registry.execute("bisr_f", ws, {**BUDGET, "bisr_f_steps": s}, jax.random.key(0))[1]
             for s in (5, 15)]
  target = jnp.asarray(ws.activations)
  carry = bisr_f._start(ws.params, jnp.asarray(tokens), lr=0.01, weight_decay=0.01)
  _, _, step_flops, _ = compiled(bisr_f._step, ws.params, target, carry, cfg=CFG, k=K,
                                 loss="cosine", prefix=(), lr=0.01, weight_decay=0.01)
  assert charges[1].flops - charges[0].flops == pytest.approx(10 * step_flops, rel=1e-9)
  analytic = bisr_f.step_flops(CFG, K, T) * B
  assert 0.5 < step_flops / analytic < 2.0


def test_refine_accepts_tokens_or_soft_labels(setup, results):
  _, attacker, tokens = setup
  ws, _ = results
  budget = {**BUDGET, "bisr_f_steps": 3}
  view = budget_lib.View({**budget_lib.defaults(), **budget}, bisr_f.FIELDS, "test")
  start = np.roll(tokens, 1, axis=1)
  by_tokens, details = bisr_f.refine(ws, view, start)
  soft = jax.nn.one_hot(start, CFG.vocab_size) * 0.9 + 0.1 / CFG.vocab_size
  by_soft, _ = bisr_f.refine(ws, view, np.asarray(soft))
  np.testing.assert_array_equal(by_tokens, by_soft)
  assert details["steps_run"] == 3
  assert details["changed_from_init"] == np.mean(by_tokens != start)
  # Unmoved embeddings (0 steps from the true tokens) decode as brute force over wte says:
  # to the tokens themselves by nearest row, not always by the published dot product.
  wte = np.asarray(split.wte(ws.params), np.float64)
  e = wte[tokens]
  brute = {"nearest": np.argmin(((e[..., None, :] - wte) ** 2).sum(-1), -1),
           "dot": np.argmax(e @ wte.T, -1)}
  np.testing.assert_array_equal(brute["nearest"], tokens)
  for decode in ("nearest", "dot"):
    view = budget_lib.View({**budget_lib.defaults(), **budget, "bisr_f_steps": 0,
                            "bisr_f_decode": decode}, bisr_f.FIELDS, "test")
    np.testing.assert_array_equal(bisr_f.refine(ws, view, tokens)[0], brute[decode])
  with pytest.raises(ValueError, match="BiSR\\(f\\) init must be"):
    bisr_f.refine(ws, view, start[:, :-1])


# --- through replay -------------------------------------------------------------------


def run(setup, name, attacks, budget=BUDGET, **kw):
  root, attacker, _ = setup
  return replay.replay(str(root / name), str(root / "cap"), attacker, attacks,
                       relevant(budget, attacks), seed=0, mesh=None, **kw)


def prediction_bytes(run_dir) -> dict[str, bytes]:
  files = sorted((pathlib.Path(run_dir) / "predictions").glob("*.npy"))
  return {p.stem: p.read_bytes() for p in files}


def test_replay_is_deterministic_and_chunking_invariant(setup):
  root, _, _ = setup
  records = run(setup, "run_a", ATTACKS)
  assert [r.status for r in records] == ["ok"] * len(ATTACKS)
  assert records[2].stages.keys() == {"sip_gru", "calibration_activations"}
  assert records[2].details["steps_run"] == 60
  run(setup, "run_b", ATTACKS)
  run(setup, "run_chunk", ["bisr_f", "eia"], memory_budget_bytes=1)  # one document a chunk
  a = prediction_bytes(root / "run_a")
  assert sorted(a) == sorted(ATTACKS) and a == prediction_bytes(root / "run_b")
  assert {k: a[k] for k in ("bisr_f", "eia")} == prediction_bytes(root / "run_chunk")


def test_nan_marks_the_record_crashed_and_the_others_stand(setup):
  root, _, tokens = setup
  # tau at the smallest float32 makes Z / tau infinite: the softmax is NaN at step 0.
  budget = {**BUDGET, "eia_tau": 1e-45}
  records = run(setup, "run_nan", ["sip_linear", "eia"], budget)
  assert [r.status for r in records] == ["ok", "crashed"]
  assert records[1].error.startswith("FloatingPointError: eia: loss became nan at step 0 of "
                                     "document 0")
  assert not (root / "run_nan" / "predictions" / "eia.npy").exists()
  sip_linear = np.load(root / "run_nan" / "predictions" / "sip_linear.npy")
  assert np.mean(sip_linear == tokens) > 0.4


@pytest.mark.slow
def test_replay_binary_takes_the_new_attacks_and_fields(setup, tmp_path):
  root, _, _ = setup
  cmd = [sys.executable, "-m", "experiments.replay", "--config=configs/replay.py",
         f"--config.capture_dir={root / 'cap'}", f"--config.attacker.hf_dir={root / 'hf'}",
         f"--config.calibration.tokens_npy={root / 'cal.npy'}", "--config.attacks=sip,eia",
         "--config.budget.eia_steps=20", "--config.budget.sip_epochs=2",
         "--config.budget.sip_hidden=32", f"--workdir={tmp_path / 'run'}"]
  proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  records = {p.stem: json.loads(p.read_text())
             for p in (tmp_path / "run" / "records").glob("*.json")}
  assert sorted(records) == ["eia", "sip"]
  assert all(r["status"] == "ok" for r in records.values())
  assert records["eia"]["budget"]["eia_steps"] == 20
  assert records["eia"]["details"]["steps_run"] == 20
  assert records["sip"]["budget"]["sip_epochs"] == 2 and len(
      records["sip"]["details"]["train_loss_per_epoch"]) == 2
  bad = cmd[:-1] + ["--config.budget.bisr_f_steps=3", f"--workdir={tmp_path / 'bad'}"]
  proc = subprocess.run(bad, capture_output=True, text=True, cwd=REPO, timeout=600,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode != 0 and "bisr_f_steps=3 is read by none" in proc.stderr
  assert not (tmp_path / "bad").exists()
