"""Fine-tuning with a defense in the loop (lla.defenses.training.DefendedStepLoss).

The gaussian defense is checked against a hand computation: its noise is drawn in the test
from the secret's keys as lla.defenses.base documents it (step key = fold_in(root step key,
step), one split per document, N(0, I) rows), added to the client's output by hand, and the
loss and one AdamW step are computed in the test (numpy cross-entropy; Adam's first step
and global-norm clipping written out).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import finetune as finetune_config
from lla import defenses
from lla.defenses.training import DefendedStepLoss, defended_loss, defended_messages
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


def _hand_noise(secret, step, shape):
  """sigma = 1 noise of the gaussian defense at `step`, drawn here from the secret's root
  step key: fold_in(root, step), split into one key per document, a normal [T, d] each."""
  step_key = jax.random.fold_in(secret.root_keys("gaussian").step, step)
  doc_keys = jax.random.split(step_key, shape[0])
  return np.stack([np.asarray(jax.random.normal(key, shape[1:], jnp.float32))
                   for key in doc_keys])


def _numpy_next_token_ce(logits, tokens):
  """Mean CE of logits[b, t] against tokens[b, t + 1], in float64 numpy."""
  logits = np.asarray(logits, np.float64)[:, :-1]
  shifted = logits - logits.max(-1, keepdims=True)
  log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  targets = np.asarray(tokens)[:, 1:]
  return -np.take_along_axis(log_probs, targets[..., None], -1).mean()


def _hand_loss(params, tokens, noise):
  """The server's next-token CE on client(tokens) + noise (noise added by hand)."""
  h = split.client(params, CFG, tokens, K)
  return split.server_loss(params, CFG, h + noise, tokens, K)[0]


def _hand_adamw_first_step(params, grads, opt):
  """AdamW's first step after global-norm clipping, in numpy: with bias correction the
  first moment is g and the second g^2, so the update is lr * (g / (|g| + eps) + wd * p),
  weight decay on Dense kernels only; lr(0) is the peak lr without warm-up."""
  leaves = [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)]
  norm = np.sqrt(sum(np.sum(g * g) for g in leaves))
  scale = 1.0 if norm < opt.clip_norm else opt.clip_norm / norm

  def step(path, p, g):
    p, g = np.asarray(p, np.float64), scale * np.asarray(g, np.float64)
    decay = opt.weight_decay * p if getattr(path[-1], "key", None) == "kernel" else 0.0
    return p - opt.lr * (g / (np.abs(g) + opt.eps) + decay)

  return jax.tree_util.tree_map_with_path(step, params, grads)


def _client_grad_norm(grads):
  """L2 norm of the gradient of the client blocks h_0..h_{K-1}."""
  return float(np.sqrt(sum(np.sum(np.asarray(g) ** 2)
                           for name in [f"h_{i}" for i in range(K)]
                           for g in jax.tree.leaves(grads[name]))))


def test_step_loss_is_the_defended_loss(params):
  sigma, step = 0.5, 3
  defense = defenses.make("gaussian", sigma=sigma)
  secret = defenses.Secret.explicit(7)
  tokens = _tokens()[:4]
  got = DefendedStepLoss(defense, K)(params, CFG, tokens, np.int32(step),
                                     secret.root_keys("gaussian"))
  want = defended_loss(params, CFG, tokens, K, defense, secret.keys("gaussian", step))
  assert float(got) == float(want)
  # Independently: the noise drawn by hand from the secret's keys is what crossed the cut,
  # and the loss is the numpy cross-entropy of the server's logits on h + that noise.
  noise = sigma * _hand_noise(secret, step, (*tokens.shape, CFG.n_embd))
  h = np.asarray(split.client(params, CFG, tokens, K))
  wire, _ = defended_messages(params, CFG, tokens, K, defense, secret.keys("gaussian", step))
  np.testing.assert_allclose(np.asarray(wire) - h, noise, rtol=1e-5, atol=1e-5)
  logits = split.server_loss(params, CFG, jnp.asarray(h + noise), tokens, K)[1]
  hand = _numpy_next_token_ce(logits, tokens)
  np.testing.assert_allclose(float(got), hand, rtol=1e-5)
  # The noise matters: the undefended loss (numpy CE of the whole model's logits) is
  # another number, by far more than the tolerance above.
  plain = _numpy_next_token_ce(split.logits(params, CFG, tokens), tokens)
  assert abs(hand - plain) > 1e-3 * abs(plain)
  # Another step draws other noise.
  other = DefendedStepLoss(defense, K)(params, CFG, tokens, np.int32(step + 1),
                                       secret.root_keys("gaussian"))
  assert float(other) != float(got)


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


def test_defended_step_is_a_step_on_the_hand_noised_loss(params):
  """One training step of the loop with the gaussian defense equals AdamW's first step
  (written out in numpy) on jax.grad of the server loss of client output + noise drawn by
  hand; the same formula on the noiseless gradient is far from it."""
  sigma, seed, batch_size = 1.0, 0, 4
  secret = defenses.Secret.explicit(2)
  opt = finetune_config.get_config("tiny").optimizer
  # No warm-up, so the first step moves the weights (lr(0) = the peak lr). With Adam's
  # usual eps = 1e-8 its first step is lr * sign(g), which compares signs only and turns
  # float roundoff in near-zero gradients (the attention key bias has none in exact
  # arithmetic) into lr-sized differences; with eps = 1 it is lr * g / (|g| + 1), a smooth
  # function of the gradient, so the comparison checks the gradient's values.
  opt.lr, opt.warmup_steps, opt.eps = 1.0, 0, 1.0
  defended = loop.train(params, CFG, _tokens(), optimizer=opt, num_steps=1,
                        batch_size=batch_size, seed=seed, progress=False,
                        loss_fn=DefendedStepLoss(defenses.make("gaussian", sigma=sigma), K),
                        loss_inputs=secret.root_keys("gaussian")).params
  # The loop's first batch: the first `batch_size` rows of the seeded permutation.
  batch = _tokens()[np.random.default_rng(seed).permutation(len(_tokens()))[:batch_size]]
  noise = jnp.asarray(sigma * _hand_noise(secret, 0, (*batch.shape, CFG.n_embd)))
  grad = jax.jit(jax.grad(_hand_loss))
  want = _hand_adamw_first_step(params, grad(params, batch, noise), opt)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-7),
               defended, want)
  # Without the noise the step is another one, by far more than the tolerance, in the
  # client's layers (their gradient comes back through the noised wire) and the server's.
  plain = _hand_adamw_first_step(params, grad(params, batch, jnp.zeros_like(noise)), opt)
  for layer in ("h_0", f"h_{K}"):
    gap = max(float(np.max(np.abs(np.asarray(a) - b)))
              for a, b in zip(jax.tree.leaves(defended[layer]), jax.tree.leaves(plain[layer])))
    assert gap > 1e-2, (layer, gap)


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
