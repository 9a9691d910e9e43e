"""The workspace meter: what an attack is charged does not depend on what ran before it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lla.attacks.seed import beam
from lla.attacks import registry
from lla.attacks.workspace import Workspace
from lla.model import split
from lla.model.gpt2 import GPT2Config

from test_attacks_units import random_params

CFG = GPT2Config(vocab_size=128, n_positions=8, n_embd=16, n_head=2, n_layer=3)
BUDGET = dict(candidates=4, beam_width=2, c_a=2, c_g=2)


def workspace():
  params = random_params(CFG, seed=1, std=0.05)
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, CFG.vocab_size, (3, 6)).astype(np.int32)
  h, g = split.boundary_messages(params, CFG, tokens, 2)
  cal = rng.integers(0, CFG.vocab_size, (4, 6)).astype(np.int32)
  return Workspace(np.asarray(h), np.asarray(g), params, CFG, 2, cal)


def test_charges_do_not_depend_on_attack_order():
  charges = {}
  for order in (("ridge", "activation", "joint"), ("joint", "activation", "ridge")):
    ws = workspace()
    for name in order:
      _, charge = registry.execute(name, ws, BUDGET, jax.random.key(0))
      charges.setdefault(name, []).append(charge)
  for name, (first, second) in charges.items():
    assert first.stages.keys() == second.stages.keys(), name
    assert first.flops == second.flops and first.flops_source == "xla", name
  assert set(charges["activation"][0].stages) == {
      "calibration_activations", "ridge", "activation_candidates"}
  assert set(charges["joint"][0].stages) == {
      "calibration_activations", "ridge", "activation_candidates", "gradient_ranking"}
  # The beam search's own loop is counted.
  assert charges["activation"][0].flops > sum(
      c["flops"] for c in charges["activation"][0].stages.values())


def test_scan_is_charged_what_its_iterations_cost_one_call_each():
  """XLA counts a while loop's body once; `Workspace.scan` charges it per trip, so a beam
  search metered as one loop costs exactly its positions compiled and called one by one,
  and finds the same tokens."""
  ws = workspace()
  width, num = 2, 5
  rng = np.random.default_rng(2)
  cands = jnp.asarray(rng.integers(0, CFG.vocab_size, (3, 6, num)), jnp.int32)
  target = jnp.asarray(ws.activations)
  with ws.attack_scope("looped"):
    tokens, _ = beam.search(ws.params, CFG, 2, target, cands, width, scan=ws.scan)
    looped = ws.charge(0.0)
  with ws.attack_scope("stepped"):
    state = ws.call(beam.start, target, cfg=CFG, k=2, width=width)
    for t in range(target.shape[1]):
      state = ws.call(beam.step, ws.params, state, jnp.int32(t), cands[:, t], target[:, t],
                      cfg=CFG)
    stepped = ws.charge(0.0)
  np.testing.assert_array_equal(tokens, state[1][:, 0])
  assert looped.flops_source == stepped.flops_source == "xla" and stepped.flops > 0
  # Within the loop's own counter and bound check: 2 FLOPs a trip here.
  assert 0 <= looped.flops - stepped.flops <= 4 * target.shape[1]
  # The analytic model counts the matmuls alone (2mnk each, as XLA does): a floor under
  # XLA's count, which adds the elementwise work (layer norms, GELU, softmax, the cost).
  analytic = beam.analytic_flops(CFG, 2, 3, width, num, 6)
  assert analytic <= looped.flops <= 1.5 * analytic
