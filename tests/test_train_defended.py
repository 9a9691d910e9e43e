"""Fine-tuning with a defense in the loop (lla.defenses.training.DefendedStepLoss)."""

import jax
import numpy as np
import pytest

from configs import finetune as finetune_config
from lla import defenses
from lla.defenses.training import DefendedStepLoss, defended_loss
from lla.model import split
from lla.model.gpt2 import GPT2Config, init_params
from lla.train import loop

CFG = GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=4, n_head=2)
K = 2


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(1))


def _tokens():
  return np.random.default_rng(3).integers(0, CFG.vocab_size, (8, 12)).astype(np.int32)


def _train(params, loss_fn, seed=0, secret=None):
  optimizer = finetune_config.get_config("tiny").optimizer
  optimizer.lr = 1e-2
  inputs = None if secret is None else secret.root_keys(loss_fn.defense.name)
  return loop.train(params, CFG, _tokens(), optimizer=optimizer, num_steps=4, batch_size=4,
                    seed=seed, progress=False, loss_fn=loss_fn, loss_inputs=inputs).params


def _client_grad_norm(grads):
  """L2 norm of the gradient of the client blocks h_0..h_{K-1}."""
  return float(np.sqrt(sum(np.sum(np.asarray(g) ** 2)
                           for name in loop.client_layer_names(K) if name.startswith("h_")
                           for g in jax.tree.leaves(grads[name]))))


def test_step_loss_is_the_defended_loss(params):
  defense = defenses.make("gaussian", sigma=0.5)
  secret = defenses.Secret.explicit(7)
  tokens = _tokens()[:4]
  got = DefendedStepLoss(defense, K)(params, CFG, tokens, np.int32(3), secret.root_keys("gaussian"))
  want = defended_loss(params, CFG, tokens, K, defense, secret.keys("gaussian", 3))
  assert float(got) == float(want)
  assert float(got) != float(split.lm_loss(params, CFG, tokens))


def test_gradient_clipping_in_the_loop_limits_the_client_gradient(params):
  tokens = _tokens()[:4]
  plain = jax.grad(loop.lm_step_loss)(params, CFG, tokens, np.int32(0))
  clip = 1e-6
  # Zero noise would switch the whole defense off (its strength is the noise multiplier),
  # so the noise is made negligible instead.
  clipped = jax.grad(DefendedStepLoss(defenses.make(
      "gradient_clip_noise", clip_norm=clip, noise_multiplier=1e-9), K))(
          params, CFG, tokens, np.int32(0),
          defenses.Secret.explicit(5).root_keys("gradient_clip_noise"))
  h, g = split.boundary_messages(params, CFG, tokens, K)
  # The last position feeds no loss term, so its row of g is zero; every other row must be
  # far above the clip so that it really is clipped.
  row_norms = np.linalg.norm(np.asarray(g)[:, :-1], axis=-1)
  assert row_norms.min() > 100 * clip
  # The client's gradient is the VJP of the clipped g: at most clip / min row norm of the
  # plain one (rows shrink by at least that factor), while the server's is untouched.
  ratio = _client_grad_norm(clipped) / _client_grad_norm(plain)
  assert 0 < ratio <= clip / row_norms.min() * 1.01
  server = lambda t: np.asarray(t[f"h_{K}"]["mlp"]["c_fc"]["kernel"])
  np.testing.assert_allclose(server(clipped), server(plain), rtol=1e-4, atol=1e-8)


def test_defended_finetune_differs_from_plain(params):
  plain = _train(params, loop.lm_step_loss)
  defended = _train(params, DefendedStepLoss(defenses.make("gaussian", sigma=1.0), K),
                    secret=defenses.Secret.explicit(2))
  assert not all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(plain),
                                                     jax.tree.leaves(defended)))


def test_defended_training_is_deterministic(params):
  loss_fn = DefendedStepLoss(defenses.make("mixup", m=2), K)
  secret = defenses.Secret.explicit(11)
  a, b = _train(params, loss_fn, secret=secret), _train(params, loss_fn, secret=secret)
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  # Another secret: other mixing draws from the same cached compiled step (only public
  # parameters are static).
  before = loop._cached_optimizer_and_step.cache_info()
  c = _train(params, loss_fn, secret=defenses.Secret.explicit(12))
  after = loop._cached_optimizer_and_step.cache_info()
  assert (after.hits, after.misses) == (before.hits + 1, before.misses)
  assert not all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(c)))
