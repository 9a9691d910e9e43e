"""Gradient matching over soft labels (tag, bisr_b, lamp) on a tiny random GPT-2.

V = 128, d = 32, 3 layers, cut k = 1, 6 documents of T = 8 tokens in two capture batches of
3 (so g is normalised by N = 3 * 7). Checks: the linearised g(Y) against jax.grad of the
soft-label loss and, for one-hot labels of the true tokens, against the captured g; TAG
and BiSR(b) lower their loss and beat the frequency baseline (BiSR(b) also its SIP init);
the BiSR chain is BiSR(f) from BiSR(b)'s tokens, reused from `bisr_b` on one workspace; LAMP's moves against a numpy
port of SplitLLM's index arithmetic, and its discrete step never raises the scored
objective; determinism and chunking invariance; a NaN crashes the record through replay
while the other attacks' results stand.
"""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from lla.attacks.published import bisr_f, gradmatch, lamp
from lla.attacks import downstream, registry
from lla.replay import driver as replay
from lla.attacks import budget as budget_lib
from lla.attacks.registry import relevant_budget as relevant
from lla.attacks.workspace import Workspace
from lla.capture import capture
from lla.model import hf_io, split
from lla.model.gpt2 import GPT2Config

from test_attacks_units import random_params

CFG = GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_head=4, n_layer=3)
K, B, T, BATCH = 1, 6, 8, 3


@pytest.fixture(scope="module")
def case():
  params = random_params(CFG, seed=0, std=0.1, emb_std=0.3)
  rng = np.random.default_rng(0)
  truth = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
  cal = rng.integers(0, CFG.vocab_size, (16, T)).astype(np.int32)
  # Two capture batches of 3: each document's g is dL/dh of its batch's mean loss.
  messages = [split.boundary_messages(params, CFG, jnp.asarray(truth[i:i + BATCH]), K)
              for i in range(0, B, BATCH)]
  h = np.concatenate([np.asarray(m[0]) for m in messages])
  g = np.concatenate([np.asarray(m[1]) for m in messages])
  ws = Workspace(h, g, params, CFG, K, cal, batch_docs=np.full(B, BATCH, np.int32))
  return ws, truth


def frequency_baseline(ws, truth) -> float:
  return float(np.mean(truth == ws.baseline_token))


def test_linearised_gradient_equals_jax_grad(case):
  ws, truth = case
  lin = downstream.linearize(ws.params, jnp.asarray(ws.activations), CFG, K)
  norm = jnp.asarray(gradmatch.norms(ws))
  assert np.allclose(norm, BATCH * (T - 1))
  labels = jax.nn.softmax(3.0 * jax.random.normal(jax.random.key(1), (B, T, CFG.vocab_size)))

  def soft_loss(h):  # The server's loss with soft targets, differentiated directly.
    logits = split.server_loss(ws.params, CFG, h, jnp.asarray(truth), K)[1]
    ce = optax.softmax_cross_entropy(logits[:, :-1], labels[:, 1:])
    return jnp.sum(ce.sum(-1) / norm)

  want = np.asarray(jax.grad(soft_loss)(jnp.asarray(ws.activations)))
  got = np.asarray(downstream.gradient_of_labels(lin, ws.wte, labels, norm))
  np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)
  # One-hot labels of the true tokens give back the captured message.
  one_hot = jax.nn.one_hot(truth, CFG.vocab_size)
  got = np.asarray(downstream.gradient_of_labels(lin, ws.wte, one_hot, norm))
  np.testing.assert_allclose(got, ws.gradients, atol=1e-5 * np.abs(ws.gradients).max(), rtol=0)
  # Affine in Y: halfway between two label sets is halfway between their gradients.
  mid = np.asarray(downstream.gradient_of_labels(lin, ws.wte, 0.5 * (labels + one_hot), norm))
  np.testing.assert_allclose(mid, 0.5 * (want + ws.gradients), atol=1e-5 * np.abs(want).max())


# A small SIP (the init of BiSR(b)) keeps the test fast.
SIP = {"sip_epochs": 4, "sip_hidden": 32}


def test_tag_and_bisr_b_recover_labels(case):
  ws, truth = case
  baseline = frequency_baseline(ws, truth)
  tag, charge = registry.execute("tag", ws, {"tag_steps": 150}, jax.random.key(0))
  start_loss = tag.details["matching_loss_initial_mean"]
  assert tag.details["matching_loss_final_mean"] < 0.01 * start_loss, (tag.details, start_loss)
  accuracy = np.mean(tag.predictions[:, 1:] == truth[:, 1:])
  assert accuracy >= 0.95 and accuracy > baseline + 0.5, (accuracy, baseline)
  # Position 0: the candidate (of the ridge's 32) whose client message is nearest h[0].
  candidates = ws.activation_ranked(32)[:, 0]
  first = np.asarray(split.client(ws.params, CFG, jnp.asarray(candidates.reshape(-1, 1)), K))
  distance = ((first.reshape(B, 32, -1) - ws.activations[:, None, 0]) ** 2).sum(-1)
  np.testing.assert_array_equal(tag.predictions[:, 0], candidates[np.arange(B), distance.argmin(1)])
  assert charge.flops_source == "xla" and 0.5 < charge.flops / charge.flops_analytic < 2.0
  assert "activation_candidates" in charge.stages

  sip, _ = registry.execute("sip", ws, SIP, jax.random.key(0))
  init, _ = registry.execute("bisr_b", ws, {**SIP, "bisr_b_steps": 0}, jax.random.key(0))
  bisr, charge = registry.execute("bisr_b", ws, {**SIP, "bisr_b_steps": 60}, jax.random.key(0))
  assert "sip_gru" in charge.stages
  assert bisr.details["matching_loss_final_mean"] < 0.1 * init.details["matching_loss_final_mean"]
  np.testing.assert_allclose(bisr.details["matching_loss_initial_mean"],
                             init.details["matching_loss_final_mean"], rtol=1e-5)
  np.testing.assert_array_equal(init.predictions, sip.predictions)   # the init's argmax
  np.testing.assert_array_equal(bisr.predictions[:, 0], sip.predictions[:, 0])  # no gradient at 0
  accuracy = np.mean(bisr.predictions[:, 1:] == truth[:, 1:])
  assert accuracy >= 0.95 and accuracy > np.mean(sip.predictions[:, 1:] == truth[:, 1:]) + 0.2
  assert np.mean(bisr.predictions == truth) > baseline + 0.5


def test_bisr_chain_runs_b_then_f(case):
  ws, truth = case
  budget = {**SIP, "bisr_b_steps": 60, "bisr_f_steps": 40}
  backward, _ = registry.execute("bisr_b", ws, budget, jax.random.key(0))
  chain, charge = registry.execute("bisr", ws, budget, jax.random.key(0))
  view = budget_lib.View({**budget_lib.defaults(), **budget},
                         registry.get("bisr").spec.budget_fields, "bisr")
  forward, _ = bisr_f.refine(ws, view, backward.predictions)
  np.testing.assert_array_equal(chain.predictions, forward)
  assert chain.details["bisr_b"]["matching_loss_final"] == backward.details["matching_loss_final"]
  assert np.mean(chain.predictions == truth) >= np.mean(backward.predictions == truth)
  assert charge.flops_source == "xla" and 0.5 < charge.flops / charge.flops_analytic < 2.0
  # The chain reused bisr_b's stage: computed once, charged to both in full, and the same
  # tokens and charge as the chain alone on a fresh workspace.
  stages = [name for name in ws.costs if name.startswith("bisr_b[steps=60,")]
  assert len(stages) == 1 and stages[0] in charge.stages
  fresh = Workspace(ws.activations, ws.gradients, ws.params, ws.cfg, ws.cut,
                    ws.calibration_tokens, batch_docs=ws.batch_docs)
  alone, alone_charge = registry.execute("bisr", fresh, budget, jax.random.key(0))
  np.testing.assert_array_equal(alone.predictions, chain.predictions)
  assert alone_charge.flops == pytest.approx(charge.flops, rel=1e-6)
  assert alone_charge.flops_analytic == pytest.approx(charge.flops_analytic, rel=1e-9)


def _splitllm_perm(move: int, ints, t: int) -> np.ndarray:
  """SplitLLM LAMPAttacker._lamp's concatenations for drawn indices (its numpy code)."""
  perm_ids = np.arange(t)
  i, j, b, e, p = (int(x) for x in ints)
  if move == 0:
    perm_ids[i], perm_ids[j] = perm_ids[j], perm_ids[i]
  elif move == 1:
    if i < j:
      perm_ids = np.concatenate([perm_ids[:i], perm_ids[i + 1:j], perm_ids[i:i + 1], perm_ids[j:]])
    else:
      perm_ids = np.concatenate([perm_ids[:j], perm_ids[i:i + 1], perm_ids[j:i], perm_ids[i + 1:]])
  elif move == 2:
    if p < b:
      perm_ids = np.concatenate([perm_ids[:p], perm_ids[b:e], perm_ids[p:b], perm_ids[e:]])
    else:
      assert p >= e
      perm_ids = np.concatenate([perm_ids[:b], perm_ids[e:p], perm_ids[b:e], perm_ids[p:]])
  else:
    perm_ids = np.concatenate([perm_ids[:1], perm_ids[i:-1], perm_ids[1:i], perm_ids[-1:]])
  return perm_ids


@functools.partial(jax.jit, static_argnums=1)
def _moves(keys, t):
  """For each key: the draws and permutations of the 4 moves, and candidates 0..8."""
  def one(key):
    moves = jnp.arange(4)
    ints = jax.vmap(lambda m: lamp.draw(key, m, t))(moves)
    perms = jax.vmap(lambda m, i: lamp.permutation(m, i, t))(moves, ints)
    candidates = jax.vmap(lambda c: lamp.candidate_permutation(key, c, t))(jnp.arange(9))
    return ints, perms, candidates
  return jax.vmap(one)(keys)


def test_lamp_moves_match_splitllm_and_are_permutations():
  moved = 0
  for t in (3, 13):   # the shortest sequence the moves allow, and a longer one
    all_ints, all_perms, all_candidates = (np.asarray(x) for x in _moves(
        jax.random.split(jax.random.key(t), 40), t))
    for ints4, perms4, candidates in zip(all_ints, all_perms, all_candidates):
      for move, (ints, perm) in enumerate(zip(ints4, perms4)):
        i, j, b, e, p = ints
        if move in (0, 1, 3):
          assert 1 <= i <= t - 2
        if move == 0:
          assert 1 <= j <= t - 2
        if move == 1:
          assert 1 <= j <= t - 1
        if move == 2:
          assert 1 <= b <= e <= t - 1 and 1 <= p <= t - 1 and not b <= p < e
        np.testing.assert_array_equal(perm, _splitllm_perm(move, ints, t))
        np.testing.assert_array_equal(np.sort(perm), np.arange(t))  # a permutation
        assert perm[0] == 0
      np.testing.assert_array_equal(candidates[0], np.arange(t))
      for perm in candidates[1:]:
        np.testing.assert_array_equal(np.sort(perm), np.arange(t))
        moved += t == 13 and not np.array_equal(perm, np.arange(t))
  # The moves do move things (no disguised identity) on long enough sequences.
  assert moved >= 0.8 * 40 * 8, moved


def test_lamp_discrete_step_never_raises_score(case):
  ws, _ = case
  norm = jnp.asarray(gradmatch.norms(ws))
  lin = downstream.linearize(ws.params, jnp.asarray(ws.activations), CFG, K)
  gt = jax.random.normal(jax.random.key(3), (B, T, CFG.vocab_size))
  state = gradmatch.start(gt)
  chunk = gradmatch.Chunk(lin, jnp.asarray(ws.gradients), norm, ws.doc_index,
                          gradmatch.activation_position0(ws, 8))
  key, n = jax.random.key(5), 24
  phases = lamp.Phases(key, freq=1, num_candidates=n, prior_weight=0.2, beta=0.85, name="lamp")

  def scores(s):  # The same executable as the hook's (same argument types).
    out = ws.call(lamp.score_candidates, ws.params, lin, norm, chunk.target, s.gt,
                  jnp.asarray(chunk.position0), key, jnp.asarray(ws.doc_index), jnp.int32(0),
                  jnp.arange(n, dtype=jnp.int32), jnp.float32(0.85), jnp.float32(0.2), cfg=CFG)
    return [np.asarray(x) for x in out]

  before, matching, nll, perms = scores(state)
  after_state = phases(ws, chunk, state, 0)
  # The identity's score after the move is the lowest candidate score before it.
  after_identity = scores(after_state)[0][:, 0]
  np.testing.assert_allclose(after_identity, before.min(1), rtol=1e-5)
  assert (after_identity <= before[:, 0] * (1 + 1e-6)).all()
  chosen = [phases.accepted[(d, 0)] for d in range(B)]
  np.testing.assert_array_equal(chosen, before.argmin(1))
  chosen_perms = perms[np.arange(B), chosen][..., None]
  np.testing.assert_array_equal(np.asarray(after_state.gt),
                                np.take_along_axis(np.asarray(gt), chosen_perms, 1))
  np.testing.assert_allclose(before, matching + 0.2 * nll, rtol=1e-6)
  assert phases.details()["moves_accepted"] == sum(c != 0 for c in chosen) > 0


def test_determinism_and_chunking_invariance(case):
  """LAMP (which runs TAG's loop) twice, with another key, and in ragged chunks of 4
  documents whose candidates are scored in blocks of 8 (+1, padded)."""
  ws, _ = case
  budget = {"lamp_steps": 6, "lamp_freq": 3, "lamp_candidates": 9}
  first, _ = registry.execute("lamp", ws, budget, jax.random.key(7))
  again, _ = registry.execute("lamp", ws, budget, jax.random.key(7))
  np.testing.assert_array_equal(first.predictions, again.predictions)
  assert first.details == again.details and first.details["moves_considered"] == B * 2
  other, _ = registry.execute("lamp", ws, budget, jax.random.key(8))
  assert other.details["matching_loss_final"] != first.details["matching_loss_final"]
  per_doc = gradmatch.state_bytes_per_doc(ws) + 8 * lamp.candidate_bytes(ws)
  small = Workspace(ws.activations, ws.gradients, ws.params, CFG, K, ws.calibration_tokens,
                    batch_docs=ws.batch_docs, memory_budget_bytes=int(4.2 * per_doc))
  assert small.chunk_for(per_doc) == 4
  assert lamp.Phases(None, 3, 9, 0.2, 0.85, "lamp").block_size(small, 4) == 8
  chunked, _ = registry.execute("lamp", small, budget, jax.random.key(7))
  np.testing.assert_array_equal(chunked.predictions, first.predictions)
  np.testing.assert_allclose(chunked.details["matching_loss_final"],
                             first.details["matching_loss_final"], rtol=1e-4)
  assert chunked.details["moves_accepted"] == first.details["moves_accepted"]


def test_nan_crashes_the_record_and_other_results_stand(tmp_path):
  cfg = CFG
  params = random_params(cfg, seed=1, std=0.1, emb_std=0.3)
  hf_io.save_hf_dir(params, cfg, tmp_path / "hf")
  params, _ = hf_io.load_hf_dir(tmp_path / "hf")
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, cfg.vocab_size, (4, T)).astype(np.int32)
  cal = rng.integers(0, cfg.vocab_size, (16, T)).astype(np.int32)
  capture.capture_target(str(tmp_path / "cap"), params, cfg, tokens, range(4), K, model_id="tiny",
                         training=True, batch_size=4)
  attacker = replay.Attacker(params, cfg, "tiny", cal, "public", {"hf_dir": str(tmp_path / "hf")})
  attacks = ["ridge", "tag"]
  budget = ml_collections.ConfigDict({"candidates": 8, "ridge_alpha": 1e-3, "tag_steps": 5,
                                      "tag_lr": 1e30})   # blows up within a few steps
  records = replay.replay(str(tmp_path / "run"), str(tmp_path / "cap"), attacker, attacks,
                          relevant(budget, attacks), seed=0, mesh=None)
  assert [r.status for r in records] == ["ok", "crashed"]
  assert records[1].error.startswith("FloatingPointError: tag: non-finite gradient-matching loss")
  assert "at step 2 of document 0" in records[1].error
  assert records[1].prediction_file is None
  assert (tmp_path / "run" / "predictions" / "ridge.npy").exists()
