"""The cloud's active probe of the decoy-row split (lla.active.decoy_probe)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lla.active import decoy_probe
from lla.decoy import attacks as decoy_attacks
from lla.decoy import system
from lla.model import gpt2


@pytest.fixture(scope="module")
def tiny_system():
  cfg = gpt2.GPT2Config(vocab_size=16, n_positions=8, n_embd=16, n_layer=2, n_head=2)
  spec = system.SplitSpec(cfg=cfg, cut=1, n_real=4, n_decoy=6, width=8, pool_size=16,
                          grad_clip=0.01)
  blocks = jax.random.randint(jax.random.key(0), (8, 5), 0, 16)
  state = system.init_state(spec, gpt2.init_params(cfg, jax.random.key(1)), blocks[:4],
                            jax.random.key(2))
  return spec, state, blocks


def test_probe_off_is_the_decoy_step_bit_for_bit(tiny_system):
  spec, state, blocks = tiny_system
  key = jax.random.key(3)
  ref_state, ref = jax.jit(system.step, static_argnums=0)(spec, state, blocks[4], key)
  new_state, out = jax.jit(decoy_probe.probe_step, static_argnums=0)(
      spec, jnp.float32(0.0), state, blocks[4], key)
  for name in ("forward", "gradient", "perm", "loss"):
    assert np.array_equal(out[name], ref[name]), name
  assert jax.tree.all(jax.tree.map(jnp.array_equal, new_state, ref_state))
  _, probed = jax.jit(decoy_probe.probe_step, static_argnums=0)(
      spec, jnp.float32(0.5), state, blocks[4], key)
  assert not np.array_equal(probed["gradient"], ref["gradient"])


def test_top_rows_agreement_and_chance_against_brute_force():
  rng = np.random.default_rng(0)
  scores = rng.normal(size=(5, 6))
  pred = decoy_attacks.top_rows(scores, 2)
  for s in range(5):
    assert set(np.flatnonzero(pred[s])) == set(np.argsort(-scores[s])[:2])
  # Chance: the mean agreement over every choice of 2 rows out of 6 with 2 real rows.
  real = np.array([True, True, False, False, False, False])
  mean = np.mean([np.mean(np.isin(np.arange(6), c) == real)
                  for c in itertools.combinations(range(6), 2)])
  assert decoy_probe.chance_agreement(2, 6) == pytest.approx(mean)


def test_score_frames_reads_the_probe_direction():
  rng = np.random.default_rng(1)
  s, m, d, r = 50, 10, 8, 4
  perm = np.stack([rng.permutation(m) for _ in range(s)])
  directions = rng.normal(size=(s, m, d))
  directions /= np.linalg.norm(directions, axis=-1, keepdims=True)
  noise = 0.01 * rng.normal(size=(s, m, d))
  real = perm < r
  gradient = noise + np.where(real[..., None], 0.05 * directions, 0.0)
  result = decoy_probe.score_frames(gradient, directions, perm, r)
  assert result["probe"]["row_agreement"] == 1.0 and result["probe"]["frames_exact"] == s
  blind = decoy_probe.score_frames(noise, directions, perm, r)
  assert abs(blind["probe"]["row_agreement"] - decoy_probe.chance_agreement(r, m)) < 0.1
