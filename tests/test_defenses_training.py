"""The defended fine-tuning loss, boundary messages and utility on a tiny random GPT-2."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lla import defenses as D
from lla.defenses import training, utility
from lla.model import split
from lla.model.gpt2 import GPT2Config, init_params

CFG = GPT2Config(vocab_size=101, n_positions=32, n_embd=32, n_layer=4, n_head=2)
K = 2
SEED = 4242
SECRET = D.Secret.explicit(SEED)

ACTIVE = {
    "gaussian": dict(sigma=0.3, clip_norm=5.0),
    "topk": dict(sparsity=0.75),
    "quantize": dict(bits=3),
    "mixup": dict(m=3, alpha=1.0),
    "projection": dict(kind="haar"),
    "gradient_clip_noise": dict(clip_norm=1e-3, noise_multiplier=0.35),
    "nopeek": dict(alpha=0.5),
}
OFF = {
    "gaussian": dict(sigma=0.0), "topk": dict(sparsity=0.0),
    "quantize": dict(bits=0), "mixup": dict(m=1),
    "projection": dict(enabled=False),
    "gradient_clip_noise": dict(noise_multiplier=0.0),
    "nopeek": dict(alpha=0.0),
}


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(0))


@pytest.fixture(scope="module")
def tokens():
  return jax.random.randint(jax.random.key(1), (4, 8), 0, CFG.vocab_size)


def undefended_loss(params, tokens):
  return split.server_loss(params, CFG, split.client(params, CFG, tokens, K), tokens, K)[0]


def value_and_grad(defense):
  # Not jitted as a whole: the jitted client and server pieces (and their derivatives)
  # are then compiled once and shared by every defense, which keeps the tests fast.
  return jax.value_and_grad(
      lambda p, x, keys: training.defended_loss(p, CFG, x, K, defense, keys))


def keys_of(defense, step=0):
  return SECRET.keys(defense.name, step) if defense.has_secret else None


def leaves(tree):
  return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


@pytest.mark.parametrize("name", sorted(ACTIVE))
def test_defended_loss_differentiates(name, params, tokens):
  defense = D.make(name, **ACTIVE[name])
  loss, grads = value_and_grad(defense)(params, tokens, keys_of(defense, 2))
  assert np.isfinite(float(loss))
  assert all(np.isfinite(g).all() for g in leaves(grads))
  assert any(np.abs(g).max() > 0 for g in leaves(grads))


@pytest.mark.parametrize("name", sorted(OFF))
def test_zero_strength_reproduces_the_undefended_step(name, params, tokens):
  defense = D.make(name, **OFF[name])
  key = keys_of(defense, 3)
  loss, grads = value_and_grad(defense)(params, tokens, key)
  ref_loss, ref_grads = jax.value_and_grad(undefended_loss)(params, tokens)
  assert float(loss) == float(ref_loss)
  for a, b in zip(leaves(grads), leaves(ref_grads)):
    np.testing.assert_array_equal(a, b)
  h, g = training.defended_messages(params, CFG, tokens, K, defense, key)
  ref_h, ref_g = split.boundary_messages(params, CFG, tokens, K)
  np.testing.assert_array_equal(np.asarray(h), np.asarray(ref_h))
  np.testing.assert_array_equal(np.asarray(g), np.asarray(ref_g))


def test_gradient_defense_trains_the_client_on_the_defended_gradient(params, tokens):
  defense = D.make("gradient_clip_noise", **ACTIVE["gradient_clip_noise"])
  key = keys_of(defense)
  # Jitted whole, as the fine-tuning loop will run it (the defense a static closure).
  _, grads = jax.jit(value_and_grad(defense))(params, tokens, key)
  # Independently: the server's layers from the exact loss at a fixed h, plus the client's
  # layers from the VJP of the defended returned gradient.
  h, g = split.boundary_messages(params, CFG, tokens, K)
  g_wire = D.apply(defense, g, key)
  server_grads = jax.grad(lambda p: split.server_loss(p, CFG, h, tokens, K)[0])(params)
  _, client_vjp = jax.vjp(lambda p: split.client(p, CFG, tokens, K), params)
  expected = jax.tree_util.tree_map(jnp.add, server_grads, client_vjp(g_wire)[0])
  for a, b in zip(leaves(grads), leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
  _, g_messages = training.defended_messages(params, CFG, tokens, K, defense, key)
  # Same noise; only the fusion of the clipping arithmetic differs between the two programs.
  np.testing.assert_allclose(np.asarray(g_messages), np.asarray(g_wire), rtol=1e-5, atol=1e-9)
  norms = np.linalg.norm(np.asarray(g), axis=-1)
  assert (norms > defense.clip_norm).any()  # the check above exercised the clipping


def test_mixed_labels_loss(params, tokens):
  defense = D.make("mixup", **ACTIVE["mixup"])
  key = keys_of(defense, 5)
  h = split.client(params, CFG, tokens, K)
  mixed, lam, partners = defense.mix(h, key.step)
  _, logits = split.server_loss(params, CFG, mixed, tokens, K)
  log_probs = np.asarray(jax.nn.log_softmax(logits, -1), np.float64)
  x, lam, partners = np.asarray(tokens), np.asarray(lam, np.float64), np.asarray(partners)
  n_docs, length = x.shape
  expected = -sum(lam[b, j] * log_probs[b, t, x[partners[b, j], t + 1]]
                  for b in range(n_docs) for j in range(lam.shape[1])
                  for t in range(length - 1)) / (n_docs * (length - 1))
  got = float(training.defended_loss(params, CFG, tokens, K, defense, key))
  np.testing.assert_allclose(got, expected, rtol=1e-5)
  identity = training.mixed_next_token_loss(logits, tokens, jnp.ones((n_docs, 1)),
                                            jnp.arange(n_docs)[:, None])
  np.testing.assert_allclose(float(identity), float(split.next_token_loss(logits, tokens)),
                             rtol=1e-6)


def test_projection_and_nopeek_losses(params, tokens):
  h = split.client(params, CFG, tokens, K)
  projection = D.make("projection", **ACTIVE["projection"])
  key = keys_of(projection, 6)
  rotated = jnp.einsum("btd,de->bte", h, projection.matrix(key.persistent, CFG.n_embd))
  np.testing.assert_allclose(
      float(training.defended_loss(params, CFG, tokens, K, projection, key)),
      float(split.server_loss(params, CFG, rotated, tokens, K)[0]), rtol=1e-5)
  nopeek = D.make("nopeek", **ACTIVE["nopeek"])
  penalty = float(training.defended_loss(params, CFG, tokens, K, nopeek, None)
                  - undefended_loss(params, tokens))
  e = split.wte(params)[tokens].reshape(-1, CFG.n_embd)
  dcor = float(D.distance_correlation(e, h.reshape(-1, CFG.n_embd)))
  np.testing.assert_allclose(penalty, nopeek.alpha * dcor, rtol=1e-4)


def test_utility_against_the_undefended_model(params):
  held_out = jax.random.randint(jax.random.key(7), (16, 8), 0, CFG.vocab_size)
  run = functools.partial(utility.heldout_utility, params, CFG, held_out, K, secret=SECRET,
                          batch_size=8, n_boot=2000, seed=11)
  off = run(D.make("gaussian", sigma=0.0))
  assert off["cross_entropy_increase"] == {"value": 0.0, "ci": [0.0, 0.0]}
  noisy = run(D.make("gaussian", sigma=2.0))
  assert noisy == run(D.make("gaussian", sigma=2.0))  # seeded
  assert noisy["n_documents"] == 16 and str(SEED) not in str(noisy)
  assert noisy["defense"]["secret_sha256"] == SECRET.sha256
  assert noisy["defense"]["secret_source"] == "explicit_seed"
  per_doc = utility.corpus_cross_entropy(params, CFG, held_out, K, None, None, batch_size=8)
  undefended = noisy["undefended"]["cross_entropy"]
  np.testing.assert_allclose(undefended["value"], per_doc.mean(), rtol=1e-12)
  for summary in (undefended, noisy["cross_entropy_increase"], noisy["perplexity_ratio"]):
    assert summary["ci"][0] <= summary["value"] <= summary["ci"][1]
  np.testing.assert_allclose(noisy["undefended"]["perplexity"]["value"],
                             np.exp(per_doc.mean()), rtol=1e-12)
  # A gradient defense has no inference-time effect: same weights, zero cost.
  grad_defense = D.make("gradient_clip_noise", **ACTIVE["gradient_clip_noise"])
  assert run(grad_defense)["cross_entropy_increase"]["value"] == 0.0
  mixup = run(D.make("mixup", **ACTIVE["mixup"]))
  assert np.isfinite(mixup["defended"]["cross_entropy"]["value"])
