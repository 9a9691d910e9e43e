"""The training loop: learning, schedule, weight-decay and freezing masks, determinism, eval."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import finetune as finetune_config
from lla.model import split
from lla.model.gpt2 import GPT2Config, init_params
from lla.train import loop

CFG = GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=4, n_head=2)
K = 2


def _optimizer(lr=1e-2):
  config = finetune_config.get_config("tiny").optimizer
  config.lr = lr
  return config


def _tokens(n=16, seed=0):
  return np.random.default_rng(seed).integers(0, CFG.vocab_size, (n, 12)).astype(np.int32)


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(0))


def _leaves_equal(a, b):
  return all(np.array_equal(np.asarray(x).view(np.uint32), np.asarray(y).view(np.uint32))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_loss_decreases_on_repeated_batch(params):
  batch = _tokens(4)
  result = loop.train(params, CFG, batch, optimizer=_optimizer(), num_steps=30, batch_size=4,
                      seed=0, log_every=5, progress=False)
  first = float(split.lm_loss(params, CFG, batch))
  last = float(split.lm_loss(result.params, CFG, batch))
  assert last < first - 1.0, (first, last)
  assert result.history[-1]["step"] == 30 and len(result.history) == 6


def test_lr_schedule_warmup_then_decay():
  config = _optimizer(1.0)
  config.warmup_steps, config.end_lr_fraction = 4, 0.1
  for decay in ("cosine", "linear"):
    config.decay = decay
    schedule = loop.lr_schedule(config, 20)
    assert float(schedule(0)) == 0.0
    assert float(schedule(4)) == pytest.approx(1.0)
    assert float(schedule(20)) == pytest.approx(0.1)
    assert float(schedule(10)) < 1.0


def test_weight_decay_only_on_dense_kernels(params):
  mask = loop.decay_mask(params)
  assert mask["h_0"]["attn"]["c_attn"]["kernel"] and mask["h_3"]["mlp"]["c_fc"]["kernel"]
  assert not mask["h_0"]["attn"]["c_attn"]["bias"]
  assert not mask["h_0"]["ln_1"]["scale"] and not mask["ln_f"]["bias"]
  assert not mask["wte"]["embedding"] and not mask["wpe"]["embedding"]


def test_own_weights_take_their_own_learning_rate():
  """A defense's own weights (`own_weights`) step at their own rate, the rest at the
  model's, the frozen not at all. Known answer: AdamW's first step, without warm-up, moves
  a leaf with a nonzero gradient by lr * g / (|g| + eps) = lr * sign(g) (bias-corrected
  moments m = g, v = g^2), and biases get no weight decay; within 1e-4 relative, the bias
  correction's 1 - b2 = 1 - 0.999 carrying float32's rounding (1.3e-5, 6e-6 after the root)."""
  config = _optimizer(1e-3)
  config.warmup_steps, config.clip_norm = 0, 1e9
  params = {"model": {"bias": jnp.zeros(3)}, "frozen": {"bias": jnp.zeros(3)},
            "mid": {"bias": jnp.zeros(2)}}
  trainable = {"model": {"bias": True}, "frozen": {"bias": False}, "mid": {"bias": True}}
  grads = {"model": {"bias": jnp.array([2.0, -0.5, 1.0])},
           "frozen": {"bias": jnp.array([1.0, 1.0, 1.0])}, "mid": {"bias": jnp.array([-3.0, 0.7])}}
  for own, own_lr in ((None, 1e-3), (("mid", 5e-2), 5e-2)):
    tx = loop.make_optimizer(config, 10, trainable, own)
    updates, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(updates["model"]["bias"], -1e-3 * np.sign(grads["model"]["bias"]),
                               rtol=1e-4)
    np.testing.assert_array_equal(updates["frozen"]["bias"], np.zeros(3))
    np.testing.assert_allclose(updates["mid"]["bias"], -own_lr * np.sign(grads["mid"]["bias"]),
                               rtol=1e-4)
  with pytest.raises(ValueError, match="no top-level 'adversary'"):
    loop.make_optimizer(config, 10, trainable, ("adversary", 1e-2))


@pytest.mark.parametrize("train_client_layers", [False, True])
def test_client_layers_frozen_only_when_asked(params, train_client_layers):
  trainable = loop.trainable_mask(params, K, train_client_layers)
  result = loop.train(params, CFG, _tokens(), optimizer=_optimizer(), num_steps=4, batch_size=8,
                      seed=0, trainable=trainable, progress=False)
  for name in params:
    same = _leaves_equal(params[name], result.params[name])
    is_client = name in ("wte", "wpe", *(f"h_{i}" for i in range(K)))  # GPT-2's client
    assert same == (is_client and not train_client_layers), name
  # The forward message is the base model's exactly when the client layers were frozen.
  x = _tokens(2)
  h_base, h_new = split.client(params, CFG, x, K), split.client(result.params, CFG, x, K)
  assert np.array_equal(h_base, h_new) == (not train_client_layers)


@pytest.mark.parametrize("tie_embeddings", [True, False])
def test_a_llama_client_is_frozen_by_its_own_names(tie_embeddings):
  """A RoPE family's client is embed_tokens and layers_0..k-1: public knowledge freezes
  exactly those (and a tied head with them); an untied lm_head trains with the server."""
  from lla.model import decoder
  cfg = decoder.DecoderConfig(family="llama", vocab_size=128, n_positions=16, n_embd=32,
                              n_layer=4, n_head=2, n_kv_head=1, head_dim=16, d_ff=48,
                              tie_embeddings=tie_embeddings)
  params = decoder.random_params(cfg, seed=1)
  result = loop.train(params, cfg, _tokens(), optimizer=_optimizer(), num_steps=4,
                      batch_size=8, seed=0, trainable=loop.trainable_mask(params, K, False),
                      progress=False)
  client = ("embed_tokens", *(f"layers_{i}" for i in range(K)))
  assert set(params) == {*client, "layers_2", "layers_3", "norm"} | (
      set() if tie_embeddings else {"lm_head"})
  for name in params:
    assert _leaves_equal(params[name], result.params[name]) == (name in client), name
  x = _tokens(2)
  np.testing.assert_array_equal(split.client(params, cfg, x, K), split.client(result.params, cfg, x, K))


def test_frozen_negative_zero_survives(params):
  # p + 0.0 would turn -0.0 into +0.0; frozen leaves must be carried through untouched.
  params = jax.tree.map(jnp.array, params)
  params["wpe"]["embedding"] = params["wpe"]["embedding"].at[0, 0].set(-0.0)
  trainable = loop.trainable_mask(params, K, False)
  result = loop.train(params, CFG, _tokens(), optimizer=_optimizer(), num_steps=1, batch_size=8,
                      seed=0, trainable=trainable, progress=False)
  assert np.signbit(result.params["wpe"]["embedding"][0, 0])


def test_same_seed_identical_different_seed_differs(params):
  run = lambda seed: loop.train(params, CFG, _tokens(), optimizer=_optimizer(), num_steps=3,
                                batch_size=4, seed=seed, progress=False).params
  a, b, c = run(0), run(0), run(1)
  assert _leaves_equal(a, b)
  assert not _leaves_equal(a, c)


def test_batches_are_seeded_permutations():
  tokens = np.arange(10)[:, None].repeat(3, axis=1)
  it = loop.batches(tokens, 4, seed=0)
  epoch = np.concatenate([next(it)[:, 0] for _ in range(2)])
  assert len(set(epoch.tolist())) == 8  # Without replacement within an epoch; tail of 2 dropped.
  again = loop.batches(tokens, 4, seed=0)
  assert np.array_equal(next(again), loop.batches(tokens, 4, seed=0).__next__())


def test_evaluate_is_mean_ce_over_all_positions(params):
  tokens = _tokens(10)
  result = loop.evaluate(params, CFG, tokens, batch_size=4)  # Batches of 4, 4, 2.
  expected = float(split.lm_loss(params, CFG, tokens))
  assert result["ce"] == pytest.approx(expected, rel=1e-5)
  assert result["perplexity"] == pytest.approx(math.exp(expected), rel=1e-5)
  assert result["n_positions"] == 10 * 11
