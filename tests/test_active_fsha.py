"""FSHA on GPT-2 (lla.active.fsha, lla.active.servers): losses, penalty, returned gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import finetune
from lla.active import client, fsha, parts, servers
from lla.active.protocol import Forward
from lla.model import gpt2, split


def _spec(**kw):
  return fsha.FSHASpec(vocab_size=48, seq_len=6, width=16, critic_hidden=16, **kw)


def test_pilot_and_decoder_train_and_invert():
  spec = _spec()
  rng = np.random.default_rng(0)
  batches = [jnp.asarray(rng.integers(0, spec.vocab_size, (8, spec.seq_len)), jnp.int32)
             for _ in range(150)]
  pilot = fsha.init_pilot(spec, jax.random.key(0))
  pilot, losses = fsha.pretrain(pilot, batches, lr=1e-2)
  assert np.mean(losses[-10:]) < 0.25 * np.mean(losses[:10]), (losses[:3], losses[-3:])
  tokens = jnp.asarray(rng.integers(0, spec.vocab_size, (64, spec.seq_len)), jnp.int32)
  features = fsha.pilot_features(pilot, tokens)
  # The pilot's features are already normalised: identity statistics.
  pred = fsha.invert(pilot["emb"], pilot["tau"], pilot["bias"], jnp.zeros(spec.width),
                     jnp.ones(spec.width), features)
  assert float(jnp.mean(pred == tokens)) >= 0.99


def test_gradient_penalty_matches_finite_differences():
  spec = _spec()
  with jax.enable_x64(True):
    critic = jax.tree.map(lambda x: x.astype(jnp.float64),
                          fsha.init_critic(spec, jax.random.key(1)))
    real = jax.random.normal(jax.random.key(2), (3, 4, spec.width), jnp.float64)
    fake = jax.random.normal(jax.random.key(3), (3, 4, spec.width), jnp.float64)
    key = jax.random.key(4)
    gp = float(fsha.gradient_penalty(critic, real, fake, key))
    e = np.asarray(jax.random.uniform(key, (3, 1, 1), jnp.float64))
    mixed = e * np.asarray(real) + (1 - e) * np.asarray(fake)
    eps, norms = 1e-6, []
    for b in range(3):
      grad = np.zeros(mixed[b].shape)
      for idx in np.ndindex(mixed[b].shape):
        up, down = mixed[b].copy(), mixed[b].copy()
        up[idx] += eps
        down[idx] -= eps
        grad[idx] = (float(fsha.critic_one(critic, jnp.asarray(up)))
                     - float(fsha.critic_one(critic, jnp.asarray(down)))) / (2 * eps)
      norms.append(np.linalg.norm(grad))
    np.testing.assert_allclose(gp, np.mean((np.asarray(norms) - 1.0) ** 2), rtol=1e-6)


def test_fsha_server_returns_the_critic_gradient_with_a_zero_last_row():
  spec = _spec()
  server = servers.FSHAServer(spec)
  state = server.init(fsha.init_pilot(spec, jax.random.key(0)), jax.random.key(1))
  h = 3.0 + 2.0 * jax.random.normal(jax.random.key(2), (4, spec.seq_len, spec.width))
  public = jax.random.randint(jax.random.key(3), (4, spec.seq_len), 0, spec.vocab_size)
  forward = Forward(h=h, step=jnp.int32(0), run_id=jnp.int32(0))
  step = jax.jit(lambda s, f, p, k: server.step(s, f, None, p, k))
  new, backward, log = step(state, forward, public, jax.random.key(4))
  # Independently: the statistics of this first batch, the pre-update critic.
  off, scale = np.asarray(h).mean((0, 1)), np.sqrt(np.asarray(h).var((0, 1)) + 1e-6)
  np.testing.assert_allclose(new["stats"]["off"], off, rtol=1e-5, atol=1e-5)
  objective = lambda x: jnp.mean(fsha.critic_scores(state["critic"], (x - off) / scale))
  expected = np.array(jax.grad(objective)(h))
  expected[:, -1] = 0.0
  np.testing.assert_allclose(backward.g, expected, rtol=1e-4, atol=1e-7)
  assert np.all(np.asarray(backward.g)[:, -1] == 0)
  np.testing.assert_allclose(log["critic_client"], objective(h), rtol=1e-5)
  assert not jax.tree.all(jax.tree.map(jnp.array_equal, new["critic"], state["critic"]))


def test_mix_matches_row_norms():
  rng = np.random.default_rng(0)
  task, adv = rng.normal(size=(2, 3, 5)), rng.normal(size=(2, 3, 5))
  task[:, -1] = 0.0
  beta = 0.3
  out = np.asarray(servers.mix(jnp.asarray(task), jnp.asarray(adv), beta))
  for b in range(2):
    for t in range(3):
      ratio = np.linalg.norm(task[b, t]) / np.linalg.norm(adv[b, t])
      np.testing.assert_allclose(out[b, t], (1 - beta) * task[b, t] + beta * ratio * adv[b, t],
                                 rtol=1e-5, atol=1e-7)
  assert np.all(out[:, -1] == 0)


@pytest.fixture(scope="module")
def tiny_split():
  cfg = gpt2.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=4, n_head=2)
  params = gpt2.init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (4, 8), 0, cfg.vocab_size)
  return cfg, params, tokens


def test_honest_server_returns_exactly_the_split_gradient(tiny_split):
  cfg, params, tokens = tiny_split
  k = 2
  h, g = split.boundary_messages(params, cfg, tokens, k)
  optimizer = finetune.get_config("tiny").optimizer
  server = servers.HonestServer(cfg, k, optimizer.to_json(sort_keys=True), 10)
  state = server.init(parts.tail_params(params, cfg, k))
  oracle = client.oracle_for(tokens, jnp.int32(0), cfg.vocab_size)
  forward = Forward(h=h, step=jnp.int32(0), run_id=jnp.int32(0))
  # Servers run inside jit, like split.boundary_messages (op-by-op execution rounds
  # differently in the last bit).
  respond = jax.jit(lambda s, f, o: server.respond(s, f, o))
  assert np.array_equal(respond(state, forward, oracle).g, g)
  # Inside the whole jitted split step (client forward, server step, client update).
  from lla.active import run  # pylint: disable=g-import-not-at-top
  cspec = client.ClientSpec.make(cfg, k, optimizer, 10)
  cstate = client.init(cspec, params)
  _, _, out = run.train_step(cspec, server, cstate, state, tokens, tokens, jnp.int32(0),
                             jnp.int32(0), jnp.int32(0), jax.random.key(0))
  assert np.array_equal(out["h"], h) and np.array_equal(out["g"], g)


def test_fake_batch_changes_targets_and_skips_the_update(tiny_split):
  cfg, params, tokens = tiny_split
  k = 2
  optimizer = finetune.get_config("tiny").optimizer
  server = servers.HonestServer(cfg, k, optimizer.to_json(sort_keys=True), 10)
  sstate = server.init(parts.tail_params(params, cfg, k))
  cspec = client.ClientSpec.make(cfg, k, optimizer, 10)
  cstate = client.init(cspec, params)
  from lla.active import run  # pylint: disable=g-import-not-at-top
  shift = 5
  new, _, out = run.train_step(cspec, server, cstate, sstate, tokens, tokens, jnp.int32(shift),
                               jnp.int32(0), jnp.int32(0), jax.random.key(0))
  assert jax.tree.all(jax.tree.map(jnp.array_equal, new, cstate))
  fake_targets = (tokens + shift) % cfg.vocab_size
  h = split.client(params, cfg, tokens, k)
  loss = lambda h_: split.next_token_loss(split.server_logits(parts.tail_params(params, cfg, k),
                                                            cfg, h_, k), fake_targets)
  np.testing.assert_allclose(out["g"], jax.jit(jax.grad(loss))(h), rtol=1e-5, atol=1e-7)
