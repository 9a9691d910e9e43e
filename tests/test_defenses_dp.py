"""Known answers of the DP defenses (dx_privacy, dp_forward) against independent computations."""

import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import integrate, stats

from configs import capture as capture_config
from lla import defenses as D
from lla.capture import runner, store
from lla.defenses import dp_forward, dx_privacy, training
from lla.model import hf_io, split
from lla.model.decoder import DecoderConfig
from lla.model.gpt2 import GPT2Config, init_params

SECRET = D.Secret.explicit(20250601)
GPT2 = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=3, n_head=2)
# Gemma's sqrt(d) input scale is the one place where the embedding hook differs by family.
GEMMA = DecoderConfig(family="gemma3", vocab_size=64, n_positions=16, n_embd=32, n_layer=3,
                      n_head=2, n_kv_head=1, head_dim=32, d_ff=48, norm="rmsnorm_1p",
                      norm_eps=1e-6, mlp="geglu", embed_scale=32 ** 0.5, qk_norm=True,
                      sandwich_norms=True, query_pre_attn_scalar=24.0, rope_theta=1e6,
                      local_rope_theta=1e4, sliding_window=4,
                      window_layers=(True, False, True), tie_embeddings=True)


def dx_draws(epsilon, d, rows=4000, step=0):
  """`rows` noise vectors z [rows, d] of the registered mechanism (e = 0, so e' = z)."""
  defense = D.make("dx_privacy", epsilon=epsilon)
  z = defense.transform(jnp.zeros((8, rows // 8, d)), SECRET.keys("dx_privacy", step))
  return np.asarray(z, np.float64).reshape(rows, d)


@pytest.mark.parametrize("epsilon,d", [(2.0, 16), (0.5, 64)])
def test_dx_noise_norm_is_gamma_d_over_epsilon(epsilon, d):
  norms = np.linalg.norm(dx_draws(epsilon, d), axis=1)
  fit = stats.kstest(norms, stats.gamma(a=d, scale=1 / epsilon).cdf)
  print(f"dx_privacy eps={epsilon} d={d}: KS D={fit.statistic:.4f} p={fit.pvalue:.3f}")
  assert fit.pvalue > 0.01
  # The test has power: a 5% error in the scale (or a Gamma(d - 1) norm, what
  # exp(-eps ||z||) would give if the r^{d-1} Jacobian were missed) is rejected.
  assert stats.kstest(norms, stats.gamma(a=d, scale=1.05 / epsilon).cdf).pvalue < 1e-6
  assert stats.kstest(norms, stats.gamma(a=d - 1, scale=1 / epsilon).cdf).pvalue < 1e-6


def test_dx_noise_direction_is_uniform():
  d, rows = 16, 4000
  z = dx_draws(1.0, d, rows, step=3)
  u = z / np.linalg.norm(z, axis=1, keepdims=True)
  # Uniform on the sphere: E u = 0 with coordinate std 1/sqrt(d), and E u u^T = I / d.
  stderr = 1 / math.sqrt(d * rows)
  print(f"dx_privacy direction: max |mean u_i| / stderr = {np.abs(u.mean(0)).max() / stderr:.2f}")
  assert np.abs(u.mean(0)).max() < 4.5 * stderr
  second = u.T @ u / rows
  # Var(u_i^2) = 2 (d - 1) / (d^2 (d + 2)) for the uniform direction; off-diagonals
  # E(u_i u_j)^2 = 1 / (d (d + 2)).
  assert np.abs(np.diag(second) - 1 / d).max() < 4.5 * math.sqrt(2 * (d - 1) / (d**2 * (d + 2)) / rows)
  off = second[~np.eye(d, dtype=bool)]
  assert np.abs(off).max() < 5 * math.sqrt(1 / (d * (d + 2)) / rows)


def test_dx_noise_is_fresh_per_step_and_position():
  a, b = dx_draws(1.0, 16, 64, step=0), dx_draws(1.0, 16, 64, step=1)
  assert not np.allclose(a, b)
  assert len({tuple(np.round(r, 6)) for r in a}) == 64


@pytest.mark.parametrize("cfg", [GPT2, GEMMA], ids=["gpt2", "gemma3"])
def test_client_from_embeddings_is_client_at_the_true_embeddings(cfg):
  params = split.init_params(cfg, jax.random.key(0))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (3, 7)), jnp.int32)
  e = split.input_table(params)[tokens]
  np.testing.assert_array_equal(np.asarray(split.client_from_embeddings(params, cfg, e, 2)),
                                np.asarray(split.client(params, cfg, tokens, 2)))


def test_defended_client_runs_the_blocks_on_the_noisy_embeddings():
  params = split.init_params(GPT2, jax.random.key(0))
  table = split.input_table(params)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (3, 7)), jnp.int32)
  keys = SECRET.keys("dx_privacy", 5)
  defense = D.make("dx_privacy", epsilon=4.0)
  h = training.defended_client(params, GPT2, tokens, 2, defense, keys)
  # Independently: the same noise draw added to the rows, then wpe and blocks 0..1 by the
  # model's own module (not the hook).
  z = dx_privacy.dx_noise(keys.step, (3, 7, 16), 4.0)
  x = table[tokens] + z + params["wpe"]["embedding"][:7]
  expected = split.module(GPT2).apply({"params": params}, x, 0, 2, method="blocks")
  np.testing.assert_allclose(np.asarray(h), np.asarray(expected), rtol=1e-5, atol=1e-5)
  assert not np.allclose(np.asarray(h), np.asarray(split.client(params, GPT2, tokens, 2)),
                         atol=1e-2)
  # epsilon=None is the undefended client, bit for bit; `apply` leaves h to the hook.
  off = D.make("dx_privacy", epsilon=None)
  np.testing.assert_array_equal(np.asarray(training.defended_client(params, GPT2, tokens, 2, off, keys)),
                                np.asarray(split.client(params, GPT2, tokens, 2)))
  np.testing.assert_array_equal(np.asarray(D.apply(defense, h, keys)), np.asarray(h))


def test_nearest_rows_and_projection_to_tokens():
  rng = np.random.default_rng(2)
  table, e = rng.normal(size=(50, 8)), rng.normal(size=(3, 5, 8))
  brute = np.argmin(((e[:, :, None, :] - table[None, None]) ** 2).sum(-1), axis=-1)
  np.testing.assert_array_equal(
      np.asarray(dx_privacy.nearest_rows(jnp.asarray(e, jnp.float32), jnp.asarray(table, jnp.float32))),
      brute)
  tokens = jnp.asarray(rng.integers(0, 50, (3, 5)), jnp.int32)
  table = jnp.asarray(table, jnp.float32)
  keys = SECRET.keys("dx_privacy", 0)
  # Noise of norm ~ d / eps = 8e-4, far below the table's nearest-row gaps: every token
  # projects back to itself; at eps = 1 (norm ~ 8, the rows' own scale) most do not.
  quiet = D.make("dx_privacy", epsilon=1e4, project=True).noisy_inputs(table, tokens, keys)
  np.testing.assert_array_equal(np.asarray(quiet), np.asarray(table[tokens]))
  loud = D.make("dx_privacy", epsilon=1.0, project=True).noisy_inputs(table, tokens, keys)
  ids = dx_privacy.nearest_rows(loud, table)
  np.testing.assert_array_equal(np.asarray(loud), np.asarray(table[ids]))
  assert (np.asarray(ids) != np.asarray(tokens)).mean() > 0.5


def hockey_stick_delta(sigma, epsilon, sensitivity):
  """delta(eps) = int max(0, p(x) - e^eps q(x)) dx for p = N(D, s^2), q = N(0, s^2) on the
  line through the two means (the worst case of the Gaussian mechanism), by quadrature:
  an independent computation of the Balle-Wang closed form. The integrand is positive
  exactly where x > D / 2 + eps s^2 / D."""
  start = sensitivity / 2 + epsilon * sigma**2 / sensitivity
  f = lambda x: stats.norm.pdf(x, sensitivity, sigma) - math.exp(epsilon) * stats.norm.pdf(x, 0, sigma)
  return integrate.quad(f, start, np.inf, epsabs=1e-14, epsrel=1e-12)[0]


@pytest.mark.parametrize("epsilon,delta,clip", [(1.0, 1e-5, 0.5), (0.5, 1e-6, 2.0),
                                                (4.0, 1e-5, 1.0), (0.1, 1e-3, 1.0)])
def test_dp_forward_sigma_is_the_analytic_gaussian_mechanism(epsilon, delta, clip):
  defense = D.make("dp_forward", epsilon=epsilon, delta=delta, clip_norm=clip)
  sigma, sens = defense.sigma, 2 * clip
  at_sigma = hockey_stick_delta(sigma, epsilon, sens)
  smaller = hockey_stick_delta(sigma * (1 - 1e-6), epsilon, sens)
  print(f"dp_forward eps={epsilon} delta={delta} C={clip}: sigma={sigma:.6f} "
        f"delta(sigma)-delta={at_sigma - delta:.2e} delta(0.999999 sigma)-delta={smaller - delta:.2e}")
  assert abs(at_sigma - delta) < 1e-9
  assert smaller > delta  # the smallest sigma: any less noise breaks (epsilon, delta)
  # The classical bound sqrt(2 ln(1.25 / delta)) D / eps (Dwork & Roth, Thm A.1, valid for
  # eps < 1) is sufficient, so the exact sigma is below it.
  if epsilon < 1:
    assert sigma < math.sqrt(2 * math.log(1.25 / delta)) * sens / epsilon


@pytest.mark.parametrize("epsilon,delta,sigma", [
    (1.0, 1e-5, 3.7306316348159414), (0.5, 1e-6, 8.057618480725047),
    (4.0, 1e-5, 1.0811618495202397), (0.1, 1e-3, 17.40439620303115)])
def test_dp_forward_sigma_matches_an_independent_implementation(epsilon, delta, sigma):
  # Reference values of Google's dp_accounting 0.6.0 (gaussian_mechanism.get_sigma_gaussian,
  # tol=1e-15, unit sensitivity; Balle & Wang's calibration by another code base), computed
  # once outside the project. The classical bound at (1, 1e-5) is 4.845: the analytic
  # mechanism needs 23% less noise there.
  assert dp_forward.analytic_gaussian_sigma(epsilon, delta, 1.0) == pytest.approx(sigma, rel=1e-9)
  assert D.make("dp_forward", epsilon=epsilon, delta=delta, clip_norm=1.5).sigma == pytest.approx(
      3.0 * sigma, rel=1e-9)  # sensitivity 2C = 3: sigma scales linearly with it


def test_dp_forward_clips_each_sequence_then_adds_sigma_noise():
  rng = np.random.default_rng(4)
  # Documents of Frobenius norm ~ 0.4 .. 40 around C = 2: some clipped, some not.
  x = rng.normal(size=(6, 10, 16)) * np.array([0.1, 0.5, 1, 2, 5, 10])[:, None, None] / 4
  x = jnp.asarray(x, jnp.float32)
  clipped = np.asarray(jax.vmap(lambda doc: dp_forward.clip_frobenius(doc, 2.0))(x))
  norms, before = np.linalg.norm(clipped, axis=(1, 2)), np.linalg.norm(np.asarray(x), axis=(1, 2))
  assert (norms <= 2.0 * (1 + 1e-6)).all()
  inside = before <= 2.0
  assert inside.any() and (~inside).any()
  np.testing.assert_array_equal(clipped[inside], np.asarray(x)[inside])
  np.testing.assert_allclose(norms[~inside], 2.0, rtol=1e-6)
  # The noise: out - clip(x) is N(0, sigma^2) over the 960 entries (chi-square on its
  # sample variance, two-sided 1e-4).
  defense = D.make("dp_forward", epsilon=2.0, delta=1e-5, clip_norm=2.0)
  noise = np.asarray(D.apply(defense, x, SECRET.keys("dp_forward", 0)), np.float64) - clipped
  n = noise.size
  chi2 = (noise**2).sum() / defense.sigma**2
  assert stats.chi2.ppf(5e-5, n) < chi2 < stats.chi2.ppf(1 - 5e-5, n)


def test_dp_forward_records_its_privacy_parameters():
  record = D.make("dp_forward", epsilon=1.0, delta=1e-5, clip_norm=0.5).to_record(SECRET)
  assert record["params"] == {"epsilon": 1.0, "delta": 1e-5, "clip_norm": 0.5,
                              "sigma": dp_forward.analytic_gaussian_sigma(1.0, 1e-5, 1.0)}
  assert record["strength"] == 1.0 and record["acts_on"] == "activations"
  with pytest.raises(D.DefenseError):
    D.make("dp_forward", epsilon=1.0, delta=0.0)
  with pytest.raises(D.DefenseError):
    D.make("dx_privacy", epsilon=-1.0)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
  root = tmp_path_factory.mktemp("inputs")
  params = init_params(GPT2, jax.random.key(0))
  hf_io.save_hf_dir(params, GPT2, root / "model")
  tokens = np.random.default_rng(1).integers(0, GPT2.vocab_size, (6, 8)).astype(np.int32)
  np.save(root / "tokens.npy", tokens)
  return root, params, tokens


@pytest.mark.parametrize("training_capture", [False, True])
@pytest.mark.parametrize("name,public", [
    ("dx_privacy", dict(epsilon=20.0)), ("dx_privacy", dict(epsilon=20.0, project=True)),
    ("dp_forward", dict(epsilon=2.0, delta=1e-5, clip_norm=4.0))])
def test_defended_capture_on_the_tiny_model(inputs, tmp_path, name, public, training_capture):
  root, params, tokens = inputs
  config = capture_config.get_config("tiny")
  config.model.hf_dir, config.data.tokens_npy = str(root / "model"), str(root / "tokens.npy")
  config.cut, config.training, config.batch_size = 2, training_capture, 4
  config.defense.name, config.defense.secret_seed = name, 77
  for key, value in public.items():
    config.defense[key] = value
  runner.capture_from_config(config, tmp_path)
  captured = store.load_capture(tmp_path)
  target = json.loads((pathlib.Path(tmp_path) / "metadata.json").read_text())["protocol"]["T"]
  assert target["defense"] == name
  defense = D.make(name, **public)
  assert dict(target["defense_params"]) == {**defense.params(), "strength": defense.strength,
                                            "secret_source": "explicit_seed"}
  # Independently: each batch of 4 with its step's keys, through the defended client.
  secret = D.Secret.explicit(77)
  expected = []
  for step, start in enumerate(range(0, 6, 4)):
    batch, keys = jnp.asarray(tokens[start:start + 4]), secret.keys(name, step)
    h = training.defended_client(params, GPT2, batch, 2, defense, keys)
    expected.append(np.asarray(D.apply(defense, h, keys)))
  np.testing.assert_allclose(captured.activations, np.concatenate(expected), rtol=1e-5, atol=1e-5)
  assert not np.allclose(captured.activations, np.asarray(split.client(params, GPT2, tokens, 2)),
                         atol=1e-3)
  assert (captured.gradients is not None) == training_capture
