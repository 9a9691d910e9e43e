"""Known answers of the MID defense (lla.defenses.mid) against independent computations."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from configs import finetune as finetune_config
from lla import defenses as D
from lla.data import passages
from lla.defenses import mid, training, utility
from lla.model import checkpoint as ckpt
from lla.model import loading, split
from lla.model.gpt2 import GPT2Config, init_params
from lla.train import finetune, loop

SECRET = D.Secret.explicit(20251206)
CFG = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=3, n_head=2)
K, T = 1, 12


def markov_tokens(n, seed):
  """[n, T] documents of a learnable chain: the next token is 5 x + 3 mod V with
  probability 0.9, else uniform (so the fine-tune has something to learn that noise hides)."""
  rng = np.random.default_rng(seed)
  x = np.empty((n, T), np.int32)
  x[:, 0] = rng.integers(0, CFG.vocab_size, n)
  for t in range(1, T):
    jump = rng.random(n) < 0.1
    x[:, t] = np.where(jump, rng.integers(0, CFG.vocab_size, n),
                       (5 * x[:, t - 1] + 3) % CFG.vocab_size)
  return x


def _optimizer(lr):
  opt = finetune_config.get_config("tiny").optimizer
  opt.lr = lr
  return opt


@pytest.fixture(scope="module")
def base():
  return init_params(CFG, jax.random.key(0))


def test_kl_term_against_vflair_formula_in_numpy():
  rng = np.random.default_rng(0)
  mu = rng.normal(size=(3, 5, 4)).astype(np.float32)
  logvar = rng.normal(size=(3, 5, 4)).astype(np.float32)
  d = 7
  # VFLAIR-LLM's MIDModel_Linear with std = exp(logvar / 2): torch.mean(torch.sum(-0.5 * (1 +
  # 2 log std - mu^2 - std^2), dim=1)) / (T * d), dim 1 being the positions of [B, T, b].
  std = np.exp(np.float64(logvar) / 2)
  elementwise = -0.5 * (1 + 2 * np.log(std) - np.float64(mu) ** 2 - std ** 2)
  expected = elementwise.sum(axis=1).mean() / (mu.shape[1] * d)
  got = float(mid.kl_term(jnp.asarray(mu), jnp.asarray(logvar), d))
  assert got == pytest.approx(expected, rel=1e-5)
  # And the Gaussian KL itself, by quadrature of p log(p / q) for one coordinate.
  m, s = 0.7, 1.3
  x = np.linspace(-15, 15, 200001)
  p = np.exp(-0.5 * ((x - m) / s) ** 2) / (s * math.sqrt(2 * math.pi))
  q = np.exp(-0.5 * x ** 2) / math.sqrt(2 * math.pi)
  quadrature = np.trapezoid(p * np.log(p / q), x)
  closed = float(mid.kl_term(jnp.full((1, 1, 1), m), jnp.full((1, 1, 1), 2 * math.log(s)), 1))
  assert closed == pytest.approx(quadrature, rel=1e-6)


def test_init_is_a_secret_orthonormal_projection():
  w = mid.init_weights(SECRET.keys("mid").persistent, 16, 6, 0.5)
  q = np.asarray(w["mu"]["kernel"], np.float64)
  np.testing.assert_allclose(q.T @ q, np.eye(6), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(w["decoder"]["kernel"]), q.T.astype(np.float32))
  np.testing.assert_allclose(np.exp(np.asarray(w["logvar"]["bias"]) / 2), 0.5, rtol=1e-6)
  other = mid.init_weights(D.Secret.explicit(1).keys("mid").persistent, 16, 6, 0.5)
  assert not np.allclose(q, np.asarray(other["mu"]["kernel"]))


def test_defense_aware_mimic_is_the_mechanism_at_the_attackers_own_initialisation():
  """The defense-aware baselines' calibration mimic: a projection onto the b-dimensional
  subspace the ATTACKER's seed draws (the defender's trained weights are secret), plus noise
  of std init_std per bottleneck coordinate; never an error, never the defender's weights."""
  from lla.defenses import aware  # pylint: disable=g-import-not-at-top
  params = {"lam": 1.0, "width": 6, "init_std": 1e-4, "label": "mid_lam1.0"}
  h = np.random.default_rng(0).standard_normal((5, T, 16)).astype(np.float32)
  sent = aware.calibration_transform("mid", params, attacker_seed=3)(h)
  # Q from the attacker's own key: an orthonormal 16 x 6 basis, h' ~= h Q Q^T.
  q = np.asarray(mid.init_weights(D.Secret.explicit(3).keys("mid").persistent, 16, 6, 1e-4)
                 ["mu"]["kernel"], np.float64)
  np.testing.assert_allclose(sent, h @ q @ q.T, atol=1e-3)
  assert np.linalg.matrix_rank(sent.reshape(-1, 16).astype(np.float64), tol=1e-2) == 6
  other = aware.calibration_transform("mid", params, attacker_seed=4)(h)
  assert np.abs(other - sent).max() > 0.1  # another seed, another subspace
  # The noise: for h = 0, h' = z Q^T with z ~ N(0, init_std^2 I_b), so E||h'||^2 = b std^2
  # per position; a chi-square with 5 * T * 6 degrees of freedom around it.
  loud = dict(params, init_std=0.5)
  zero = aware.calibration_transform("mid", loud, attacker_seed=3)(np.zeros_like(h))
  dof = 5 * T * 6
  statistic = float(np.sum(zero.astype(np.float64) ** 2) / 0.25)
  assert stats.chi2.cdf(statistic, dof) > 1e-3 and stats.chi2.sf(statistic, dof) > 1e-3


def test_zero_strength_is_the_undefended_path_bit_for_bit(base):
  tokens = markov_tokens(4, 1)
  off = D.make("mid", lam=0.0, width=8)
  assert off.off
  h, g = training.batched_messages(base, CFG, tokens, K, off, SECRET, 4, training=True)
  h0 = np.asarray(split.client(base, CFG, jnp.asarray(tokens), K))
  g0 = np.asarray(jax.grad(lambda x: split.server_loss(base, CFG, x, jnp.asarray(tokens), K)[0])(
      jnp.asarray(h0)))
  np.testing.assert_array_equal(h, h0)
  np.testing.assert_array_equal(g, g0)


def test_wire_and_loss_by_hand(base):
  """The defended step's message and loss: the bottleneck written out in numpy, its noise drawn
  here from the secret's step key (fold_in(root step key, step), one normal [B, T, b])."""
  defense = D.make("mid", lam=3.0, width=8)
  params = {**base, "mid": defense.init_weights(CFG, SECRET)}
  w = jax.tree.map(lambda a: np.asarray(a, np.float64), params["mid"])
  tokens = jnp.asarray(markov_tokens(4, 2))
  keys = SECRET.keys("mid", 5)
  h = np.asarray(split.client(base, CFG, tokens, K), np.float64)
  mu = h @ w["mu"]["kernel"] + w["mu"]["bias"]
  logvar = h @ w["logvar"]["kernel"] + w["logvar"]["bias"]
  n = np.asarray(jax.random.normal(jax.random.fold_in(SECRET.root_keys("mid").step, 5),
                                   mu.shape), np.float64)
  wire = (mu + np.exp(logvar / 2) * n) @ w["decoder"]["kernel"] + w["decoder"]["bias"]
  got, _ = training.defended_messages(params, CFG, tokens, K, defense, keys)
  np.testing.assert_allclose(np.asarray(got), wire, atol=1e-5)
  kl = 0.5 * np.mean(mu ** 2 + np.exp(logvar) - 1 - logvar) / CFG.n_embd
  ce = float(split.server_loss(base, CFG, jnp.asarray(wire, jnp.float32), tokens, K)[0])
  loss = float(training.defended_loss(params, CFG, tokens, K, defense, keys))
  assert loss == pytest.approx(ce + 3.0 * kl, rel=1e-5)
  # `objective` (the mechanism at any lambda) is the same loss.
  assert float(mid.objective(params, CFG, tokens, K, 3.0, keys.step)) == pytest.approx(loss,
                                                                                   rel=1e-6)
  # The attacker's view has no bottleneck, and the capture refuses params without one.
  assert "mid" not in mid.without_weights(params)
  with pytest.raises(D.DefenseError, match="no bottleneck weights"):
    training.batched_messages(base, CFG, np.asarray(tokens), K, defense, SECRET, 4, False)


class _Objective:
  """`mid.objective` at (lam) as a training loop's loss (hashable, module-level)."""

  def __init__(self, lam):
    self.lam = lam

  def __hash__(self):
    return hash(("mid_objective", self.lam))

  def __eq__(self, other):
    return isinstance(other, _Objective) and other.lam == self.lam

  def __call__(self, params, cfg, tokens, step, root_keys):
    return mid.objective(params, cfg, tokens, K, self.lam, jax.random.fold_in(root_keys.step,
                                                                               step))


def _fine_tune(params, loss_fn=loop.lm_step_loss, inputs=None, steps=40, lr=1e-2, seed=0):
  return loop.train(params, CFG, markov_tokens(64, 3), optimizer=_optimizer(lr),
                    num_steps=steps, batch_size=16, seed=seed, progress=False,
                    loss_fn=loss_fn, loss_inputs=inputs).params


def test_lambda_zero_full_width_costs_no_utility(base):
  """(b) lambda = 0, b = d: the mechanism on (a trained Q, Q^T pair and variance, noise drawn
  at every step and at evaluation) with a small initial noise. The noise a utility is
  compared within is that of the fine-tune itself: three batch-order seeds per arm, and
  Welch's t-test of the held-out CE (scipy) finds no difference."""
  defense = D.make("mid", lam=1.0, width=CFG.n_embd, init_std=1e-3)  # lam unused: `objective`
  start = {**base, "mid": defense.init_weights(CFG, SECRET)}
  held_out = markov_tokens(96, 4)
  ce = lambda p, d, s: float(np.mean(utility.corpus_cross_entropy(p, CFG, held_out, K, d, s)))
  defended = [ce(_fine_tune(start, _Objective(0.0), SECRET.root_keys("mid"), seed=s), defense,
                 SECRET) for s in range(3)]
  plain = [ce(_fine_tune(base, seed=s), None, None) for s in range(3)]
  before = ce(base, None, None)
  test = stats.ttest_ind(defended, plain, equal_var=False)
  print(f"\nMID lam=0 b=d: held-out CE {np.round(defended, 4)} vs undefended "
        f"{np.round(plain, 4)} (before {before:.4f}); Welch t={test.statistic:.2f} "
        f"p={test.pvalue:.3f}")
  assert before - max(plain) > 0.5  # the fine-tune learned the chain
  assert test.pvalue > 0.01
  # The test has power: the default initial noise (VFLAIR's 0.474, 20 times h's rms here)
  # is not trained away in these steps and costs clearly more than the seeds' spread.
  loud = D.make("mid", lam=1.0, width=CFG.n_embd)
  noisy = ce(_fine_tune({**base, "mid": loud.init_weights(CFG, SECRET)}, _Objective(0.0),
                        SECRET.root_keys("mid")), loud, SECRET)
  assert noisy - max(plain) > 10 * np.std(plain)


def test_large_lambda_messages_carry_no_information(base):
  """(c) At large lambda the KL drives mu to 0 and the variance to 1 for every input: the
  server's h' = decode(z), z ~ N(0, I), whatever the tokens. Checked numerically on held-out
  documents: |mu| and |logvar| small, and h' of two token sets drawn with the same noise
  nearly equal relative to the noise's own spread."""
  defense = D.make("mid", lam=1e5, width=8)
  start = {**base, "mid": defense.init_weights(CFG, SECRET)}
  tuned = _fine_tune(start, training.DefendedStepLoss(defense, K), SECRET.root_keys("mid"),
                     steps=150, lr=3e-2)
  a, b = markov_tokens(32, 5), markov_tokens(32, 6)
  mu, logvar = mid.encode(tuned["mid"], split.client(tuned, CFG, jnp.asarray(a), K))
  print(f"\nMID lam=1e5: max |mu| {float(jnp.abs(mu).max()):.2e}, max |logvar| "
        f"{float(jnp.abs(logvar).max()):.2e}")
  assert float(jnp.abs(mu).max()) < 0.05 and float(jnp.abs(logvar).max()) < 0.05
  ha, _ = training.batched_messages(tuned, CFG, a, K, defense, SECRET, 32, training=False)
  hb, _ = training.batched_messages(tuned, CFG, b, K, defense, SECRET, 32, training=False)
  other_noise, _ = training.batched_messages(tuned, CFG, a, K, defense, SECRET, 32, False,
                                             first_step=1)
  signal = np.abs(ha - hb).max()
  spread = np.abs(ha - other_noise).std()
  print(f"MID lam=1e5: max |h'(a) - h'(b)| same noise {signal:.2e}, noise spread {spread:.2e}")
  assert signal < 0.05 * spread


def _splits():
  make = lambda ids: passages.make_passages(markov_tokens(48, 7), np.asarray(ids), "train")
  return passages.Splits(corpus="synthetic", seq_len=T, seed=0, calibration=make(range(8)),
                         training=make(range(8, 24)), evaluation=make(range(24, 48)),
                         provenance={})


def _finetune_setup(base):
  """(one-seed, one-epoch fine-tune config of the tiny model, the base as a loaded model)."""
  config = finetune_config.get_config("tiny")
  config.model.update(vocab_size=CFG.vocab_size, n_positions=CFG.n_positions,
                      n_embd=CFG.n_embd, n_layer=CFG.n_layer, n_head=CFG.n_head)
  config.update({"num_models": 1, "batch_size": 8, "num_epochs": 1, "k": K,
                 "export_hf": False})
  model_id, info = loading.identify(ckpt.params_sha256(base), CFG, None)
  return config, loading.LoadedModel(base, CFG, None, model_id, "test", info)


def test_finetune_keeps_the_weights_beside_the_checkpoint(base, tmp_path):
  """lla.train.finetune trains the bottleneck, stores it in the defender's file (not in the
  checkpoint), and a reuse restores the same weights, verified by their hash."""
  config, loaded = _finetune_setup(base)
  defense = D.make("mid", lam=1.0, width=8)
  made, = finetune.finetune(config, tmp_path, _splits(), loaded, defense=defense,
                            secret=SECRET)
  initial = defense.init_weights(CFG, SECRET)
  assert not np.allclose(made.params["mid"]["mu"]["kernel"], initial["mu"]["kernel"])
  restored = ckpt.restore(made.path)
  assert "mid" not in restored.params and restored.sha256 == made.sha256
  again, = finetune.finetune(config, tmp_path, _splits(), loaded, defense=defense,
                             secret=SECRET)
  for x, y in zip(jax.tree.leaves(made.params["mid"]), jax.tree.leaves(again.params["mid"])):
    np.testing.assert_array_equal(x, y)
  path = finetune.defense_weights_file(tmp_path, 0, defense)
  assert oct(path.stat().st_mode & 0o777) == "0o600"
  assert made.metadata["defense_weights_sha256"] == mid.weights_sha256(made.params["mid"])


def test_the_bottleneck_trains_at_its_own_learning_rate(base, tmp_path):
  """`weights_lr` (VFLAIR-LLM's MID `lr`) gives the bottleneck an AdamW of its own in the
  defended fine-tune: recorded in E's defense parameters, and the bottleneck moves about
  weights_lr / lr times as far as at the model's rate (Adam's steps scale with the rate:
  10x here, asserted above 5x), while the model's own weights move as before."""
  config, loaded = _finetune_setup(base)
  initial = D.make("mid", lam=1.0, width=8).init_weights(CFG, SECRET)
  moved = {}
  for weights_lr in (None, 10 * config.optimizer.lr):
    defense = D.make("mid", lam=1.0, width=8, weights_lr=weights_lr)
    made, = finetune.finetune(config, tmp_path / str(weights_lr), _splits(), loaded,
                              defense=defense, secret=SECRET)
    assert made.metadata["run_config"]["defense"]["params"]["weights_lr"] == weights_lr
    moved[weights_lr] = (
        max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
            for a, b in zip(jax.tree.leaves(made.params["mid"]), jax.tree.leaves(initial))),
        made.params)
  (slow, slow_params), (fast, fast_params) = moved[None], moved[10 * config.optimizer.lr]
  print(f"\nbottleneck moved {slow:.2e} at the model's rate, {fast:.2e} at 10x")
  assert fast > 5 * slow > 0
  server = split.server_layer_names(base, CFG, K)[-1]
  for a, b in zip(jax.tree.leaves(slow_params[server]), jax.tree.leaves(fast_params[server])):
    np.testing.assert_allclose(a, b, rtol=0.05, atol=1e-4)


def _mid_capture(cfg, k, seed, width, sizes):
  """A MID inference capture of a tiny random GPT-2 (weights std 0.05) with the bottleneck at
  its secret initialisation (init_std 0.02): (defense, victim params, calibration tokens,
  true tokens, messages); sizes = (calibration documents, captured documents, tokens)."""
  from test_attacks_units import random_params
  num_cal, num_docs, seq_len = sizes
  params = random_params(cfg, seed=seed, std=0.05)
  rng = np.random.default_rng(seed)
  cal = rng.integers(0, cfg.vocab_size, (num_cal, seq_len)).astype(np.int32)
  truth = rng.integers(0, cfg.vocab_size, (num_docs, seq_len)).astype(np.int32)
  defense = D.make("mid", lam=1.0, width=width, init_std=0.02)
  victim = {**params, "mid": defense.init_weights(cfg, SECRET)}
  messages, _ = training.batched_messages(victim, cfg, truth, k, defense, SECRET, num_docs,
                                          False)
  return defense, victim, cal, truth, messages


@pytest.mark.slow
def test_mid_adaptive():
  """On a MID capture (b = 24 < d = 32, victim weights at their secret initialisation, a tiny
  random GPT-2 without a language prior), the subspace the attack reads from the messages is
  the secret decoder's row space (its projector against Q Q^T in float64), and the adaptive
  attack recovers far more than the best non-adaptive attack on the same capture."""
  import ml_collections
  from lla.attacks import registry
  from lla.attacks.adaptive import mid_adaptive
  from lla.attacks.workspace import Workspace
  registry.load_builtin()
  cfg = GPT2Config(vocab_size=512, n_positions=16, n_embd=32, n_head=4, n_layer=3)
  k = 2
  defense, victim, cal, truth, messages = _mid_capture(cfg, k, 5, 24, (48, 16, 10))
  u = mid_adaptive.decoder_subspace(messages, 24)
  q = np.asarray(victim["mid"]["decoder"]["kernel"], np.float64).T
  assert np.linalg.norm(u @ u.T - q @ q.T) < 1e-4
  ws = Workspace(messages, None, mid.without_weights(victim), cfg, k, cal,
                 defense={"name": "mid", "params": defense.params()})
  budget = ml_collections.ConfigDict(dict(candidates=16, beam_width=2, ridge_alpha=1e-3,
                                          mid_shadow_steps=4, mid_shadow_lr=3e-4,
                                          mid_shadow_draws=4))
  run = lambda name, ws=ws: registry.execute(name, ws, budget, jax.random.key(0))[0]
  adaptive = run("mid_adaptive")
  adapted = float(np.mean(adaptive.predictions == truth))
  plain = float(np.mean(run("activation").predictions == truth))
  print(f"\nmid_adaptive {adapted:.3f} vs activation {plain:.3f} (b=24, init_std=0.02)")
  assert adapted > plain + 0.2
  # The shadow trains at the budget's rate, or at the bottleneck's public one where the
  # defense declares it (E's defense parameters).
  assert adaptive.details["shadow_lr"] == 3e-4
  declared = Workspace(messages, None, mid.without_weights(victim), cfg, k, cal,
                       defense={"name": "mid", "params": {**defense.params(),
                                                          "weights_lr": 5e-2}})
  assert run("mid_adaptive", declared).details["shadow_lr"] == 5e-2


@pytest.mark.slow
def test_defense_aware_baseline_replays_a_mid_capture():
  """`activation_defense_aware` on a MID capture fits on its calibration passed through a
  bottleneck of its own (the mechanism at the attacker's initialisation; it crashed before
  Defense.mimic): its calibration is that bottleneck's output, not the victim's secret
  one's, and its predictions are those of a decoder fitted on it, not `activation`'s."""
  import ml_collections
  from lla.attacks import registry
  from lla.attacks.workspace import Workspace
  from lla.defenses import aware
  registry.load_builtin()
  cfg = GPT2Config(vocab_size=128, n_positions=16, n_embd=16, n_head=2, n_layer=2)
  k = 1
  defense, victim, cal, truth, messages = _mid_capture(cfg, k, 3, 8, (24, 6, 8))
  params = mid.without_weights(victim)
  transform = aware.calibration_transform("mid", defense.params(), attacker_seed=0)
  h_cal = np.asarray(split.client(params, cfg, jnp.asarray(cal), k))
  mimicked = transform(h_cal)
  # The attacker's bottleneck is rank 8 < d = 16 with a decoder Q^T of its own: its noise-free
  # part lies in Q's column space, which is not the victim's (the secret's) Q.
  mine = np.asarray(mid.init_weights(D.Secret.explicit(0).keys("mid", 0).persistent, 16, 8,
                                     0.02)["decoder"]["kernel"], np.float64).T
  secret_q = np.asarray(victim["mid"]["decoder"]["kernel"], np.float64).T
  outside = lambda q, x: np.linalg.norm(x - x @ q @ q.T) / np.linalg.norm(x)
  flat = mimicked.reshape(-1, 16).astype(np.float64)
  assert mimicked.shape == h_cal.shape and outside(mine, flat) < 1e-5
  assert outside(secret_q, flat) > 0.1
  budget = ml_collections.ConfigDict(dict(candidates=8, beam_width=2, ridge_alpha=1e-3))
  run = lambda name, **extra: registry.execute(
      name, Workspace(messages, None, mid.without_weights(victim), cfg, k, cal,
                      defense={"name": "mid", "params": defense.params()}, **extra),
      budget, jax.random.key(0))[0].predictions
  aware_predictions = run("activation_defense_aware", calibration_transform=transform)
  assert aware_predictions.shape == truth.shape
  assert not np.array_equal(aware_predictions, run("activation"))
