"""lla.attacks.flops: each attack's declared FLOP model against what its run is charged.

Every built-in attack that runs on a replay Workspace declares a model; run on a tiny
random GPT-2 (each on a fresh Workspace, at a budget away from its defaults), its record's
analytic FLOPs (its own plus every shared stage it used, `Workspace.charge`) equal the
model's prediction, or (SipIt, whose search depends on the data) are at least the
model's lower bound. The shared-stage formulas are checked by hand on one shape.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lla.attacks import candidates as cand_lib
from lla.attacks import flops, registry
from lla.attacks import ridge as ridge_lib
from lla.attacks.workspace import Workspace
from lla.model import split
from lla.model.gpt2 import GPT2Config
from tests.test_attacks_units import random_params

CFG = GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_head=4, n_layer=3)
K, B, T, N_CAL = 2, 4, 6, 12
# Away from the defaults, small enough for a tiny model in seconds.
BUDGET = dict(candidates=5, beam_width=2, c_a=3, c_g=2, sip_epochs=2, sip_hidden=16, sip_batch=4,
              bisr_f_steps=3, eia_steps=4, eia_mapper_epochs=2, tag_steps=3, bisr_b_steps=2,
              lamp_steps=5, lamp_freq=2, lamp_candidates=3, sipit_max_iters=2,
              sipit_refine_iters=2, sipit_brute_chunk=32)
EXACT = ("ridge", "gradient_only", "gradient_only_t1", "activation", "activation_flop_matched",
         "joint", "shuffled_gradients", "random_candidates", "sip", "sip_linear", "bisr_f",
         "eia", "tag", "bisr_b", "bisr", "lamp")


@pytest.fixture(scope="module")
def arrays():
  params = random_params(CFG, seed=3, std=0.05, emb_std=0.5)
  rng = np.random.default_rng(3)
  tokens = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
  calibration = rng.integers(0, CFG.vocab_size, (N_CAL, T)).astype(np.int32)
  h = np.asarray(split.client(params, CFG, jnp.asarray(tokens), K))
  g = (1e-3 * rng.standard_normal(h.shape)).astype(np.float32)
  return params, h, g, calibration


def workspace(arrays) -> Workspace:
  params, h, g, calibration = arrays
  return Workspace(h, g, params, CFG, K, calibration)


def charged(arrays, name: str, budget: dict) -> float:
  _, charge = registry.execute(name, workspace(arrays), budget, jax.random.key(0))
  return charge.flops_analytic


def predicted(name: str, budget: dict) -> float:
  return flops.attack_flops(name, CFG, K, B, T, budget, N_CAL)


@pytest.mark.parametrize("name", EXACT)
def test_model_equals_the_charged_analytic_flops(arrays, name):
  budget = registry.relevant_budget(BUDGET, [name])
  assert predicted(name, budget) == pytest.approx(charged(arrays, name, budget), rel=1e-9)


def test_eia_model_with_and_without_the_mapper(arrays):
  for mapper in (True, False):
    budget = dict(registry.relevant_budget(BUDGET, ["eia"]), eia_mapper=mapper)
    assert predicted("eia", budget) == pytest.approx(charged(arrays, "eia", budget), rel=1e-9)


def test_sipit_model_is_a_lower_bound(arrays):
  budget = registry.relevant_budget(BUDGET, ["sipit"])
  assert flops.model("sipit").lower_bound
  bound, cost = predicted("sipit", budget), charged(arrays, "sipit", budget)
  assert 0 < bound <= cost * (1 + 1e-9)


def test_every_passive_attack_on_a_workspace_declares_a_model():
  undeclared = [s.name for s in registry.specs()
                if s.tier == "passive" and not s.adapts_to and flops.model(s.name) is None]
  assert undeclared == []


def test_shared_stage_formulas_by_hand():
  cfg = GPT2Config(vocab_size=1000, n_positions=64, n_embd=16, n_head=2, n_layer=4)
  s = flops.Shape(cfg, cut=3, num_docs=5, seq_len=7, n_calibration=11)
  rows, d, v = 11 * 7, 16, 1000
  calibration = 2.0 * rows * 3 * (12 * d * d + 7 * d)
  assert flops.calibration_activations(s) == calibration
  fit = 2 * (2.0 * rows * d * (2 * d) + d**3 / 3.0 + 2.0 * d**3)
  assert flops.ridge_fit(s) == pytest.approx(fit + calibration)
  assert flops.gradient_ranking(s) == 2.0 * 35 * v * d
  assert flops.activation_ranking(s) == pytest.approx(2.0 * 35 * v * d + 2.0 * 35 * d * d
                                                      + fit + calibration)
  assert cand_lib.candidate_flops(35, v, d) == flops.gradient_ranking(s)
  assert ridge_lib.ridge_flops(rows, d, d) == pytest.approx(fit / 2)


def test_unknown_attack_has_no_model_and_defaults_fill_the_budget():
  assert flops.attack_flops("no_such_attack", CFG, K, B, T, {}, N_CAL) is None
  # The activation attack at its default budget (C = 32, W = 2) against a budget naming them.
  assert predicted("activation", {}) == predicted("activation", {"candidates": 32,
                                                                  "beam_width": 2})
  assert predicted("activation", {"candidates": 8}) < predicted("activation", {})
