"""Token sanitisation (santext, custext): the replacement kernels against closed forms computed
here in numpy, the hook into the client, and a defended capture scored on the original text."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from configs import capture as capture_config
from lla import defenses as D
from lla.capture import runner, store
from lla.defenses import sanitise, training
from lla.model import hf_io, split
from lla.model.gpt2 import GPT2Config, init_params

SECRET = D.Secret.explicit(20261206)
N = 20_000
# A hand-made table: V = 6 tokens in d = 3, distances between 0.5 and 3.3.
TABLE = np.array([[0.0, 0.0, 0.0], [0.5, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.5],
                  [-1.5, 0.5, 1.0], [0.3, -0.4, 2.0]], np.float64)


def np_distances(table):
  """[V, V] Euclidean distances from explicit differences (float64)."""
  return np.sqrt(((table[:, None, :] - table[None, :, :]) ** 2).sum(-1))


def np_santext(table, epsilon):
  """P[x, y] = exp(-eps d(x, y) / 2) / sum_v exp(-eps d(x, v) / 2)."""
  w = np.exp(-0.5 * epsilon * np_distances(table))
  return w / w.sum(1, keepdims=True)


def np_custext(table, epsilon, top_k):
  """P[x, y] over x's top_k nearest (stable order), u = 1 - (d - min) / (max - min)."""
  dist = np_distances(table)
  p = np.zeros_like(dist)
  for x in range(len(table)):
    near = np.argsort(dist[x], kind="stable")[:top_k]
    d = dist[x, near]
    u = 1 - (d - d.min()) / (d.max() - d.min())
    w = np.exp(0.5 * epsilon * u)
    p[x, near] = w / w.sum()
  return p


def replacements(name, x, **public):
  """N sanitised copies of token x on TABLE (one [N/100, 100] batch, step 0)."""
  defense = D.make(name, **public)
  tokens = jnp.full((N // 100, 100), x, jnp.int32)
  y = defense.sanitise(jnp.asarray(TABLE, jnp.float32), tokens, SECRET.keys(name))
  return np.bincount(np.asarray(y).ravel(), minlength=len(TABLE))


def chisquare(counts, probs):
  """Pearson's chi-square p-value of counts against probs, over the outcomes probs allows."""
  keep = probs > 0
  assert counts[~keep].sum() == 0  # never outside the output set
  return stats.chisquare(counts[keep], N * probs[keep]).pvalue


@pytest.mark.parametrize("x,epsilon", [(0, 2.0), (3, 4.0), (4, 1.0)])
def test_santext_replacement_probabilities_are_the_closed_form(x, epsilon):
  counts = replacements("santext", x, epsilon=epsilon)
  p = chisquare(counts, np_santext(TABLE, epsilon)[x])
  wrong = chisquare(counts, np_santext(TABLE, 1.5 * epsilon)[x])
  print(f"santext x={x} eps={epsilon}: p={p:.3f}, at 1.5 eps p={wrong:.1e}")
  assert p > 1e-3
  assert wrong < 1e-6  # the test has power: a 50% error in epsilon is rejected


@pytest.mark.parametrize("x,epsilon,top_k", [(0, 2.0, 3), (3, 4.0, 4), (5, 1.0, 6)])
def test_custext_replacement_probabilities_are_the_closed_form(x, epsilon, top_k):
  counts = replacements("custext", x, epsilon=epsilon, top_k=top_k)
  p = chisquare(counts, np_custext(TABLE, epsilon, top_k)[x])
  wrong = chisquare(counts, np_custext(TABLE, 1.5 * epsilon, top_k)[x])
  print(f"custext x={x} eps={epsilon} K={top_k}: p={p:.3f}, at 1.5 eps p={wrong:.1e}")
  assert p > 1e-3
  assert wrong < 1e-6


def test_kernels_the_attacker_uses_are_the_closed_form():
  table = jnp.asarray(TABLE, jnp.float32)
  sq = jnp.sum(table * table, -1)
  log_z = np.asarray(sanitise.santext_log_partition(table, 2.5))
  for x in range(len(TABLE)):
    log_p = np.asarray(sanitise.santext_logits(table, sq, x, 2.5)) - log_z[x]
    np.testing.assert_allclose(np.exp(log_p), np_santext(TABLE, 2.5)[x], rtol=1e-5, atol=1e-6)
  support, log_p = map(np.asarray, sanitise.custext_kernel(table, 3.0, 4))
  expected = np_custext(TABLE, 3.0, 4)
  for x in range(len(TABLE)):
    np.testing.assert_array_equal(np.sort(support[x]), np.flatnonzero(expected[x]))
    np.testing.assert_allclose(np.exp(log_p[x]), expected[x, support[x]], rtol=1e-5)


def test_parameters_and_refusals():
  assert D.make("santext", epsilon=4.0).strength == 0.25
  assert D.make("custext", epsilon=None).off
  for name in ("santext", "custext"):
    with pytest.raises(D.DefenseError, match="epsilon"):
      D.make(name, epsilon=0.0)
  with pytest.raises(D.DefenseError, match="top_k"):
    D.make("custext", epsilon=1.0, top_k=0)
  with pytest.raises(D.DefenseError, match="exceeds the vocabulary"):
    D.make("custext", epsilon=1.0, top_k=7).sanitise(
        jnp.asarray(TABLE, jnp.float32), jnp.zeros((1, 2), jnp.int32), SECRET.keys("custext"))


GPT2 = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=3, n_head=2)


@pytest.mark.parametrize("name,public", [("santext", dict(epsilon=10.0)),
                                         ("custext", dict(epsilon=2.0, top_k=5))])
def test_the_client_runs_on_the_sanitised_tokens(name, public):
  params = split.init_params(GPT2, jax.random.key(0))
  table = split.input_table(params)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (3, 7)), jnp.int32)
  defense, keys = D.make(name, **public), SECRET.keys(name, 2)
  y = defense.sanitise(table, tokens, keys)
  assert 0.2 < float(jnp.mean(y != tokens)) < 1  # the mechanism replaces some tokens
  h = training.defended_client(params, GPT2, tokens, 2, defense, keys)
  np.testing.assert_array_equal(np.asarray(h), np.asarray(split.client(params, GPT2, y, 2)))
  # Fresh randomness per step and per position.
  assert not np.array_equal(np.asarray(y), np.asarray(defense.sanitise(table, tokens,
                                                                      SECRET.keys(name, 3))))
  # epsilon=None is the undefended client, bit for bit.
  off = D.make(name, **{**public, "epsilon": None})
  np.testing.assert_array_equal(
      np.asarray(training.defended_client(params, GPT2, tokens, 2, off, keys)),
      np.asarray(split.client(params, GPT2, tokens, 2)))


@pytest.mark.parametrize("name,public", [("santext", dict(epsilon=10.0)),
                                         ("custext", dict(epsilon=2.0, top_k=5))])
def test_defended_capture_keeps_the_original_text_as_truth(tmp_path, name, public):
  params = init_params(GPT2, jax.random.key(0))
  hf_io.save_hf_dir(params, GPT2, tmp_path / "model")
  tokens = np.random.default_rng(1).integers(0, GPT2.vocab_size, (6, 8)).astype(np.int32)
  np.save(tmp_path / "tokens.npy", tokens)
  config = capture_config.get_config("tiny")
  config.model.hf_dir, config.data.tokens_npy = str(tmp_path / "model"), str(tmp_path / "tokens.npy")
  config.cut, config.training, config.batch_size = 2, False, 4
  config.defense.name, config.defense.secret_seed = name, 77
  for key, value in public.items():
    config.defense[key] = value
  runner.capture_from_config(config, tmp_path / "capture")
  np.testing.assert_array_equal(store.load_truth(tmp_path / "capture"), tokens)
  captured = store.load_capture(tmp_path / "capture")
  # The messages are the client's on the sanitised text, batch by batch with its step's keys.
  defense, secret = D.make(name, **public), D.Secret.explicit(77)
  table = split.input_table(params)
  expected = [split.client(params, GPT2, defense.sanitise(
      table, jnp.asarray(tokens[s:s + 4]), secret.keys(name, i)), 2)
              for i, s in enumerate(range(0, 6, 4))]
  np.testing.assert_allclose(captured.activations, np.concatenate(expected), rtol=1e-5,
                             atol=1e-6)


def test_fine_tuning_learns_from_the_sanitised_inputs_and_the_original_targets():
  """defended_loss (and its gradient) is the server's CE on the ORIGINAL next tokens of the
  client run on y: the same computation written out with y from the same keys."""
  params = split.init_params(GPT2, jax.random.key(1))
  tokens = jnp.asarray(np.random.default_rng(3).integers(0, 64, (4, 8)), jnp.int32)
  defense, keys = D.make("santext", epsilon=10.0), SECRET.keys("santext", 4)
  y = defense.sanitise(split.input_table(params), tokens, keys)
  by_hand = lambda p: split.server_loss(p, GPT2, split.client(p, GPT2, y, 2), tokens, 2)[0]
  loss, grad = jax.value_and_grad(
      lambda p: training.defended_loss(p, GPT2, tokens, 2, defense, keys))(params)
  expected_loss, expected_grad = jax.value_and_grad(by_hand)(params)
  np.testing.assert_allclose(float(loss), float(expected_loss), rtol=1e-6)
  for a, b in zip(jax.tree_util.tree_leaves(grad), jax.tree_util.tree_leaves(expected_grad)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)
