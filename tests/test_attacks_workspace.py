"""The workspace meter: what an attack is charged does not depend on what ran before it."""

import jax
import numpy as np

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
  # The beam search's own executables (start, one step per position) are counted.
  assert charges["activation"][0].flops > sum(
      c["flops"] for c in charges["activation"][0].stages.values())
