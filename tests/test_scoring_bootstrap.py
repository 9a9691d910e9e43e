"""Crossed paired bootstrap against slow loops and invariances."""

import numpy as np
import pytest

from lla.scoring import bootstrap


def _d(m=5, n=11, seed=0):
  return np.random.default_rng(seed).integers(-3, 6, (m, n)).astype(float)


def test_vectorised_equals_gather_loop_on_same_draws():
  d = _d()
  mi, ni = bootstrap.draw_indices(np.random.default_rng(3), 300, *d.shape)
  slow = [d[np.ix_(a, b)].mean() for a, b in zip(mi, ni)]
  np.testing.assert_allclose(bootstrap.replicate_means(d, mi, ni), slow,
                             rtol=0, atol=1e-12)


def test_interval_matches_independent_slow_bootstrap():
  d = _d(6, 20, 1)
  rng = np.random.default_rng(99)
  slow = [d[np.ix_(rng.integers(0, 6, 6), rng.integers(0, 20, 20))].mean()
          for _ in range(5000)]
  res = bootstrap.interval(d, n_replicates=20000)
  lo, hi = np.percentile(slow, [2.5, 97.5])
  assert res["estimate"] == pytest.approx(d.mean())
  assert res["lo"] == pytest.approx(lo, abs=0.1)
  assert res["hi"] == pytest.approx(hi, abs=0.1)


def test_deterministic_and_permutation_invariant():
  d = _d()
  a = bootstrap.interval(d, n_replicates=5000)
  assert a == bootstrap.interval(d, n_replicates=5000)
  rng = np.random.default_rng(4)
  assert a == bootstrap.interval(d[rng.permutation(5)], n_replicates=5000)
  assert a == bootstrap.interval(d[:, rng.permutation(11)], n_replicates=5000)
  assert a != bootstrap.interval(d, n_replicates=5000, seed=1)


def test_bonferroni_levels_and_primary():
  d = _d()
  res = bootstrap.bonferroni({"x": d, "y": d}, 0.95, n_replicates=4000)
  reps = bootstrap.replicates(d, 4000)
  lo, hi = np.percentile(reps, [1.25, 98.75])
  assert res["x"]["confidence"] == pytest.approx(0.975)
  assert (res["x"]["lo"], res["x"]["hi"]) == (lo, hi)
  test = bootstrap.PrimaryTest(lower_bound_above_pp=2.0)
  assert bootstrap.evaluate_primary(test, np.full((3, 4), 3.0), 1000)["passed"]
  assert not bootstrap.evaluate_primary(test, np.full((3, 4), 2.0),
                                        1000)["passed"]


def test_rejects_bad_matrix():
  with pytest.raises(ValueError, match="shape"):
    bootstrap.replicates(np.zeros(4))
  with pytest.raises(ValueError, match="non-finite"):
    bootstrap.replicates(np.array([[np.nan]]))
