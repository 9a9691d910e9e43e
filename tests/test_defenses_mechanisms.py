"""Each defense mechanism's statistics against independent (numpy) computations."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lla import defenses as D

SEED = 20240917
SECRET = D.Secret.explicit(SEED)


def keys(name, step=0):
  return SECRET.keys(name, step)

ZERO_STRENGTH = {
    "gaussian": dict(sigma=0.0, clip_norm=1.0),
    "topk": dict(sparsity=0.0),
    "quantize": dict(bits=0),
    "mixup": dict(m=1),
    "projection": dict(enabled=False),
    "gradient_clip_noise": dict(clip_norm=1e-3, noise_multiplier=0.0),
    "nopeek": dict(alpha=0.0),
    "dx_privacy": dict(epsilon=None),
    "dp_forward": dict(epsilon=None),
    "santext": dict(epsilon=None),
    "custext": dict(epsilon=None),
    "snd": dict(epsilon=None),
    "mid": dict(lam=0.0),
    "adversarial": dict(alpha=0.0),
}


def normal(shape, seed=0, scale=1.0):
  return np.random.default_rng(seed).normal(0.0, scale, shape).astype(np.float32)


def test_registry_covers_every_mechanism():
  assert set(D.names()) == set(ZERO_STRENGTH)
  with pytest.raises(D.DefenseError):
    D.make("no_such_defense")


@pytest.mark.parametrize("name", sorted(ZERO_STRENGTH))
def test_zero_strength_is_bitwise_identity(name):
  x = normal((3, 8, 16), seed=1)
  x[0, 0, :4] = -0.0  # adding a zero noise would turn -0.0 into +0.0
  defense = D.make(name, **ZERO_STRENGTH[name])
  assert defense.off and defense.strength == 0
  out = np.asarray(D.apply(defense, jnp.asarray(x), keys(name)))
  assert out.dtype == x.dtype
  np.testing.assert_array_equal(out.view(np.uint32), x.view(np.uint32))


def test_record_carries_the_secret_hash_never_the_secret():
  defense = D.make("gaussian", sigma=0.5, clip_norm=2.0)
  secret = D.Secret.explicit(987654321987)
  record = defense.to_record(secret)
  text = json.dumps(record, sort_keys=True)
  assert "987654321987" not in text + repr(defense) + repr(secret)
  assert record == {"name": "gaussian", "acts_on": "activations", "strength": 0.5,
                    "params": {"clip_norm": 2.0, "sigma": 0.5},
                    "secret_sha256": D.seed_hash(987654321987),
                    "secret_source": "explicit_seed"}
  assert "secret_sha256" not in D.make("topk", sparsity=0.5).to_record(secret)


def test_drawn_secrets_are_128_os_random_bits_and_distinct():
  drawn = [D.Secret.draw() for _ in range(64)]
  assert len({s.sha256 for s in drawn}) == 64
  assert all(s.source == "os_random_128" for s in drawn)
  # 64 draws of 128 uniform bits: the largest is below 2^124 with probability 2^-256.
  assert 124 < max(s.reveal() for s in drawn).bit_length() <= 128


def test_step_keys_are_deterministic_and_distinct():
  a, b = D.Secret.explicit(7), D.Secret.explicit(8)
  data = lambda k: np.asarray(jax.random.key_data(k))
  np.testing.assert_array_equal(data(a.keys("gaussian", 3).step), data(a.keys("gaussian", 3).step))
  assert not np.array_equal(data(a.keys("gaussian", 3).step), data(a.keys("gaussian", 4).step))
  assert not np.array_equal(data(a.keys("gaussian", 3).step), data(b.keys("gaussian", 3).step))
  # Persistent secrets do not change with the step; mechanisms get separate keys.
  np.testing.assert_array_equal(data(a.keys("projection", 3).persistent),
                                data(a.keys("projection", 4).persistent))
  assert not np.array_equal(data(a.keys("projection", 3).persistent),
                            data(a.keys("mixup", 3).persistent))


def test_make_names_bad_input_in_one_line():
  with pytest.raises(D.DefenseError, match="unknown defense 'nope'"):
    D.make("nope")
  with pytest.raises(D.DefenseError, match="does not declare parameter.*sigma.*declares: sparsity"):
    D.make("topk", sigma=0.3)
  with pytest.raises(D.DefenseError, match="sparsity=1.5 must lie in"):
    D.make("topk", sparsity=1.5)
  with pytest.raises(D.DefenseError, match="secret_seed"):
    D.make("gaussian", sigma=1.0, secret_seed=3)


def test_one_mechanism_configuration_compiles_once_for_every_secret():
  defense = D.make("projection", kind="haar")
  x = jnp.asarray(normal((2, 4, 16), seed=13))
  D.apply._clear_cache()
  outs = [np.asarray(D.apply(defense, x, D.Secret.draw().keys("projection"))) for _ in range(3)]
  assert D.apply._cache_size() == 1
  assert not np.allclose(outs[0], outs[1])


def test_gaussian_noise_std():
  sigma = 0.37
  x = normal((8, 64, 32), seed=2)
  out = D.apply(D.make("gaussian", sigma=sigma), jnp.asarray(x), keys("gaussian", 1))
  noise = np.asarray(out, np.float64) - x
  assert abs(noise.std() / sigma - 1) < 0.03
  assert abs(noise.mean()) < 4 * sigma / np.sqrt(noise.size)


def test_gaussian_noise_after_clipping():
  sigma, clip = 0.2, 3.0
  x = normal((8, 64, 32), seed=3, scale=10.0)  # every row far above the clip norm
  out = D.apply(D.make("gaussian", sigma=sigma, clip_norm=clip), jnp.asarray(x),
                keys("gaussian", 2))
  x64 = x.astype(np.float64)
  clipped = x64 * clip / np.linalg.norm(x64, axis=-1, keepdims=True)
  noise = np.asarray(out, np.float64) - clipped
  assert abs(noise.std() / sigma - 1) < 0.03


def test_clip_rows_bounds_norms_and_keeps_small_rows():
  x = normal((4, 16, 8), seed=4)
  x[0] *= 1e-3  # within the bound
  out = np.asarray(D.clip_rows(jnp.asarray(x), 0.5))
  assert (np.linalg.norm(out, axis=-1) <= 0.5 * (1 + 1e-6)).all()
  np.testing.assert_array_equal(out[0], x[0])
  big = np.linalg.norm(x, axis=-1) > 0.5
  np.testing.assert_allclose(np.linalg.norm(out, axis=-1)[big], 0.5, rtol=1e-6)


@pytest.mark.parametrize("sparsity,kept", [(0.5, 16), (0.75, 8), (0.9, 4), (0.99, 1)])
def test_topk_keeps_exactly_k_largest_per_row(sparsity, kept):
  x = normal((3, 8, 32), seed=5)
  defense = D.make("topk", sparsity=sparsity)
  assert defense.kept(32) == kept
  out = np.asarray(D.apply(defense, jnp.asarray(x)))
  nonzero = out != 0
  assert (nonzero.sum(-1) == kept).all()
  np.testing.assert_array_equal(out[nonzero], x[nonzero])
  kept_min = np.where(nonzero, np.abs(x), np.inf).min(-1)
  dropped_max = np.where(nonzero, -np.inf, np.abs(x)).max(-1)
  assert (kept_min >= dropped_max).all()


def test_topk_count_is_exact_under_ties():
  x = np.ones((2, 4, 32), np.float32)
  out = np.asarray(D.apply(D.make("topk", sparsity=0.75), jnp.asarray(x)))
  assert ((out != 0).sum(-1) == 8).all()


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_quantize_levels_and_error(bits):
  x = normal((3, 8, 64), seed=6, scale=2.0)
  x[0, 0] = 1.5  # a constant row
  out = np.asarray(D.apply(D.make("quantize", bits=bits), jnp.asarray(x)))
  lo, hi = x.min(-1), x.max(-1)
  step = (hi.astype(np.float64) - lo) / (2**bits - 1)
  for row_out in out.reshape(-1, 64):
    assert len(np.unique(row_out)) <= 2**bits
  err = np.abs(out.astype(np.float64) - x).max(-1)
  assert (err <= step / 2 + 1e-6 * (1 + np.abs(x).max(-1))).all()
  np.testing.assert_allclose(out.min(-1), lo, atol=1e-6)
  np.testing.assert_array_equal(out[0, 0], x[0, 0])


def test_quantize_straight_through_gradient():
  x = jnp.asarray(normal((2, 4, 16), seed=7))
  w = jnp.asarray(normal((2, 4, 16), seed=8))
  grad = jax.grad(lambda x_: jnp.sum(D.apply(D.make("quantize", bits=2), x_) * w))(x)
  np.testing.assert_array_equal(np.asarray(grad), np.asarray(w))


def test_haar_projection_is_orthogonal_and_fixed():
  defense = D.make("projection", kind="haar")
  r = np.asarray(defense.matrix(keys("projection", 0).persistent, 32), np.float64)
  np.testing.assert_allclose(r.T @ r, np.eye(32), atol=2e-5)
  np.testing.assert_array_equal(r, np.asarray(defense.matrix(keys("projection", 5).persistent, 32)))
  other = D.Secret.explicit(SEED + 1).keys("projection").persistent
  assert not np.allclose(r, np.asarray(defense.matrix(other, 32)))
  x = normal((3, 8, 32), seed=9)
  out = np.asarray(D.apply(defense, jnp.asarray(x), keys("projection", 7)), np.float64)
  np.testing.assert_allclose(out, x @ r, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


def test_haar_projection_sanity_over_many_draws():
  d, n = 8, 400
  qs = np.asarray(jax.vmap(lambda k: D.random_projection(k, d, "haar"))(
      jax.random.split(jax.random.key(3), n)), np.float64)
  # Haar entries have mean 0 and variance 1/d; the diagonal too, which an un-sign-fixed QR
  # (LAPACK's Householder) biases.
  sd_of_mean = np.sqrt(1 / d / (n * d))
  assert abs(qs.mean()) < 4 * sd_of_mean / np.sqrt(d)
  assert abs(np.einsum("nii->", qs) / (n * d)) < 4 * sd_of_mean
  assert abs((qs**2).mean() * d - 1) < 1e-5
  assert set(np.round(np.linalg.det(qs)).astype(int)) == {-1, 1}


def test_gaussian_projection_scale():
  r = np.asarray(D.make("projection", kind="gaussian").matrix(
      keys("projection").persistent, 64), np.float64)
  # 4096 entries of std 1/8: their mean has std 1/8/64.
  assert abs(r.mean()) < 4 / 8 / 64
  assert abs((r**2).mean() * 64 - 1) < 0.05


def test_mixup_scheme():
  n_docs, m = 6, 3
  defense = D.make("mixup", m=m, alpha=0.5)
  x = normal((n_docs, 4, 8), seed=10)
  mixed, lam, partners = defense.mix(jnp.asarray(x), jax.random.key(4))
  lam, partners = np.asarray(lam, np.float64), np.asarray(partners)
  assert lam.shape == partners.shape == (n_docs, m)
  assert (lam >= 0).all()
  np.testing.assert_allclose(lam.sum(-1), 1.0, atol=1e-6)
  np.testing.assert_array_equal(partners[:, 0], np.arange(n_docs))
  for b in range(n_docs):
    assert len(set(partners[b])) == m
  for j in range(m):
    assert sorted(partners[:, j]) == list(range(n_docs))  # each pi_j a permutation
    if j:
      assert (partners[:, j] != np.arange(n_docs)).all()
  expected = np.einsum("bj,bjtd->btd", lam, x[partners].astype(np.float64))
  np.testing.assert_allclose(np.asarray(mixed), expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(
      np.asarray(D.apply(defense, jnp.asarray(x), D.SecretKeys(jax.random.key(0),
                                                               jax.random.key(4)))),
      np.asarray(mixed))
  _, _, other = defense.mix(jnp.asarray(x), jax.random.key(5))
  assert not np.array_equal(np.asarray(other), partners)


def test_mixup_needs_m_documents():
  with pytest.raises(ValueError):
    D.make("mixup", m=4).mix(jnp.zeros((3, 2, 4)), jax.random.key(0))


def test_gradient_clip_noise():
  clip, mult = 0.01, 0.35
  g = normal((8, 64, 32), seed=11, scale=0.1)  # rows far above the clip norm
  defense = D.make("gradient_clip_noise", clip_norm=clip, noise_multiplier=mult)
  out = np.asarray(D.apply(defense, jnp.asarray(g), keys("gradient_clip_noise", 6)), np.float64)
  g64 = g.astype(np.float64)
  clipped = g64 * np.minimum(1.0, clip / np.linalg.norm(g64, axis=-1, keepdims=True))
  assert (np.linalg.norm(clipped, axis=-1) <= clip * (1 + 1e-9)).all()
  noise = out - clipped
  assert abs(noise.std() / (mult * clip) - 1) < 0.03


@pytest.mark.parametrize("name,params", [
    ("gaussian", dict(sigma=0.1)), ("topk", dict(sparsity=0.5)),
    ("quantize", dict(bits=3)), ("projection", dict())])
def test_rowwise_defenses_are_vmapped_over_documents(name, params):
  defense = D.make(name, **params)
  x = jnp.asarray(normal((4, 8, 16), seed=12))
  step = keys(name, 7)
  whole = np.asarray(D.apply(defense, x, step if defense.has_secret else None))
  split = jax.random.split(step.step, 4)
  if name == "projection":  # one matrix for all documents
    one_by_one = np.stack([np.asarray(defense.transform(x[b:b + 1], step))[0] for b in range(4)])
  else:
    one_by_one = np.stack([np.asarray(defense.transform_document(x[b], step.persistent, split[b]))
                           for b in range(4)])
  np.testing.assert_allclose(whole, one_by_one, rtol=1e-6, atol=1e-6)
