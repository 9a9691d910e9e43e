"""Metrics and records against independent computations."""

import json

import numpy as np
import pytest
import scipy.optimize
import scipy.stats

from lla.scoring import metrics
from lla.evidence.records import AttackRecord

Z = 2.5392


def _brentq_upper(s, n, z=Z):
  """Upper root of (p_hat - p)^2 = z^2 p (1 - p) / n (score-test inversion)."""
  ph = s / n
  if s == n:
    return 1.0
  f = lambda p: (ph - p) ** 2 - z * z * p * (1 - p) / n
  return scipy.optimize.brentq(f, ph if s else 1e-300, 1.0, xtol=1e-15)


@pytest.mark.parametrize("s,n", [(0, 1), (0, 100), (3, 7), (50, 100),
                                 (1000, 8192), (8191, 8192), (24576, 24576)])
def test_wilson_matches_score_test_root(s, n):
  assert metrics.wilson_upper(s, n) == pytest.approx(_brentq_upper(s, n),
                                                     abs=1e-12)


def test_wilson_hand_values():
  # p = 0: U = z^2 / (n + z^2); z^2 = 6.44753664.
  assert metrics.wilson_upper(0, 100) == pytest.approx(6.44753664 / 106.44753664,
                                                       rel=1e-12)
  # p = 1/4, n = 4: (0.25 + 0.80594208 + z sqrt(0.14761776)) / 2.61188416.
  assert metrics.wilson_upper(1, 4) == pytest.approx(
      (1.05594208 + Z * 0.14761776 ** 0.5) / 2.61188416, rel=1e-12)


def test_z_is_bonferroni_quantile_over_nine():
  assert scipy.stats.norm.ppf(1 - 0.05 / 9) == pytest.approx(Z, abs=1e-4)


def test_wilson_vectorises_and_rejects_bad_input():
  s = np.array([0, 5, 10])
  np.testing.assert_allclose(metrics.wilson_upper(s, 10),
                             [metrics.wilson_upper(int(x), 10) for x in s])
  with pytest.raises(ValueError, match="n > 0"):
    metrics.wilson_upper(0, 0)
  with pytest.raises(ValueError, match="successes <= n"):
    metrics.wilson_upper(11, 10)


def test_recovery_against_loops():
  rng = np.random.default_rng(1)
  t = rng.integers(0, 3, (30, 12))
  p = np.where(rng.random(t.shape) < 0.9, t, rng.integers(0, 3, t.shape))
  for pos, start in (("all", 0), ("t>=1", 1)):
    hits = sum(p[i, j] == t[i, j] for i in range(30) for j in range(start, 12))
    docs = sum(all(p[i, start:] == t[i, start:]) for i in range(30))
    base = sum(t[i, j] == 2 for i in range(30) for j in range(start, 12))
    c = metrics.count(p, t, 2, pos)
    assert (c.hits, c.n, c.docs_exact, c.docs, c.baseline_hits) == (
        hits, 30 * (12 - start), docs, 30, base)


def test_floor_excess_envelope():
  p0 = 216 / 8192
  assert metrics.floor_pp(p0, 8192) == pytest.approx(
      100 * (_brentq_upper(216, 8192) - p0), abs=1e-9)
  assert metrics.excess_pp(0, 100, 0.0) == pytest.approx(
      100 * 6.44753664 / 106.44753664)
  rows = {"b": {"excess_pp": 2.0, "floor_pp": 0.3},
          "a": {"excess_pp": 2.0, "floor_pp": 0.1},
          "c": {"excess_pp": -1.0, "floor_pp": 0.5}}
  assert metrics.envelope(rows) == {"envelope_pp": 2.0, "argmax": "a",
                                    "floor_pp": 0.5, "floor_argmax": "c"}


def test_mismatched_shapes_are_rejected():
  with pytest.raises(ValueError, match="shape"):
    metrics.token_recovery(np.zeros((2, 3)), np.zeros((2, 4)))
  with pytest.raises(ValueError, match="scored_positions"):
    metrics.position_mask(4, "t>=2")


def _record(**kw):
  base = dict(run_id="r", attack="joint", family="beam_inversion", status="ok",
              error=None, e_hash="e" * 64, capture_dir="cap",
              capture_sha256="c" * 64, truth_file="cap/truth.safetensors",
              prediction_file="predictions/r.npy", prediction_sha256="f" * 64,
              scored_positions="all", baseline_token=13, model_id="m",
              model_seed=0, cut=6, knowledge="public", corpus="wikitext2",
              defense="none", defense_params={}, reference=None, seed=0,
              budget={"C": 32}, flops=1e12, flops_source="analytic",
              flops_analytic=1e12, wall_s=2.0, compile_s=0.5, stages={},
              details={}, provenance={"jax": "0.10"})
  base.update(kw)
  return base


def test_record_round_trip_and_save(tmp_path):
  r = AttackRecord(**_record())
  assert AttackRecord.from_json(r.to_json()) == r
  assert json.loads(r.to_json())["schema"] == "lla.attack_record.v2"
  path = str(tmp_path / "r.json")
  r.save(path)
  assert AttackRecord.load(path) == r
  with pytest.raises(FileExistsError, match="r.json"):
    r.save(path)


@pytest.mark.parametrize("change,match", [
    ({"status": "failed"}, "status"),
    ({"cut": "6"}, "'cut'"),
    ({"status": "crashed"}, "error message"),
    ({"scored_positions": "t>0"}, "scored_positions"),
])
def test_record_errors_name_the_source(change, match):
  with pytest.raises(ValueError, match=match) as e:
    AttackRecord.from_json(json.dumps(_record(**change)), source="x/rec.json")
  assert "x/rec.json" in str(e.value)


def test_record_missing_and_unknown_fields():
  d = _record(extra=1)
  del d["corpus"]
  with pytest.raises(ValueError, match=r"missing fields \['corpus'\].*"
                     r"unknown fields \['extra'\]"):
    AttackRecord.from_json(d, source="f.json")
