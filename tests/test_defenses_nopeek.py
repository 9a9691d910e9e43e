"""Sample distance correlation against a direct float64 double-centring implementation."""

import jax
import jax.numpy as jnp
import numpy as np

from lla.defenses import distance_correlation


def numpy_dcor(x, z):
  def centred(v):
    v = np.asarray(v, np.float64)
    a = np.linalg.norm(v[:, None, :] - v[None, :, :], axis=-1)
    return a - a.mean(0, keepdims=True) - a.mean(1, keepdims=True) + a.mean()
  a, b = centred(x), centred(z)
  return np.sqrt((a * b).mean() / np.sqrt((a * a).mean() * (b * b).mean()))


def test_dcor_matches_numpy():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(60, 5))
  z = np.tanh(x[:, :3] @ rng.normal(size=(3, 3))) + 0.5 * rng.normal(size=(60, 3))
  got = float(distance_correlation(jnp.asarray(x, jnp.float32), jnp.asarray(z, jnp.float32)))
  np.testing.assert_allclose(got, numpy_dcor(x, z), atol=1e-4)


def test_dcor_of_a_sample_with_itself_is_one():
  x = np.random.default_rng(1).normal(size=(50, 4)).astype(np.float32)
  np.testing.assert_allclose(float(distance_correlation(x, x)), 1.0, atol=1e-5)
  np.testing.assert_allclose(float(distance_correlation(x, 3 * x + 1)), 1.0, atol=1e-5)


def test_dcor_of_independent_samples_is_small():
  rng = np.random.default_rng(2)
  x, z = rng.normal(size=(400, 3)), rng.normal(size=(400, 3))
  got = float(distance_correlation(jnp.asarray(x, jnp.float32), jnp.asarray(z, jnp.float32)))
  assert got < 0.2
  np.testing.assert_allclose(got, numpy_dcor(x, z), atol=1e-4)


def test_dcor_gradient_is_finite_with_repeated_rows():
  rng = np.random.default_rng(3)
  x = rng.normal(size=(20, 4)).astype(np.float32)
  x[10:] = x[:10]  # repeated tokens have identical embeddings
  z = rng.normal(size=(20, 6)).astype(np.float32)
  z[5] = z[4]
  grad = jax.grad(lambda z_: distance_correlation(x, z_))(jnp.asarray(z))
  assert np.isfinite(np.asarray(grad)).all()
