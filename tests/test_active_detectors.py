"""Client-side detectors (lla.active.detectors) against the reference formulas."""

import math

import numpy as np
import pytest

from lla.active import detectors


def _official_sg_score(fakes, controls, regulars, mult=5, exp=2):
  """`sg_score` of ege-erdogan/splitguard label-changing/splitguard.ipynb, transcribed."""
  def angle(v1, v2):
    u1, u2 = v1 / np.linalg.norm(v1), v2 / np.linalg.norm(v2)
    return np.arccos(np.dot(u1, u2))
  f_mean, c_mean, r_mean = sum(fakes) / len(fakes), sum(controls) / len(controls), \
      sum(regulars) / len(regulars)
  cr_mean = (c_mean + r_mean) / 2
  f_mag = sum(np.linalg.norm(v) for v in fakes) / len(fakes)
  c_mag = sum(np.linalg.norm(v) for v in controls) / len(controls)
  r_mag = sum(np.linalg.norm(v) for v in regulars) / len(regulars)
  cr_mag = (c_mag + r_mag) / 2
  div = abs(f_mag - cr_mag) + abs(c_mag - r_mag)
  x = (angle(f_mean, cr_mean) * (abs(f_mag - cr_mag) / div)
       - angle(c_mean, r_mean) * (abs(r_mag - c_mag) / div))
  return (1 / (1 + np.exp(-x * mult))) ** exp


def test_splitguard_score_matches_the_official_formula():
  rng = np.random.default_rng(0)
  fakes = [rng.normal(size=20) * 3 + 1 for _ in range(3)]
  r1 = [rng.normal(size=20) for _ in range(4)]
  r2 = [rng.normal(size=20) for _ in range(5)]
  assert detectors.splitguard_score(fakes, r1, r2) == pytest.approx(
      _official_sg_score(fakes, r1, r2), rel=1e-12)
  # Fake gradients that look like regular ones score low, different ones high.
  same = detectors.splitguard_score(r1[:2], r1[2:], r2)
  assert same < detectors.splitguard_score(fakes, r1, r2)


def test_splitguard_plan_and_windows():
  guard = detectors.SplitGuard(warmup=3, p_fake=0.5, mult=5, exp=2)
  shifts = guard.plan(40, 100, np.random.default_rng(1))
  assert np.all(shifts[:4] == 0) and np.all((shifts == 0) | ((shifts >= 1) & (shifts < 100)))
  rng = np.random.default_rng(2)
  windows = 0
  for s in range(40):
    window = guard.observe(s, rng.normal(size=5) + (5 if shifts[s] else 0), int(shifts[s]))
    if window is not None:
      windows += 1
      # Every fake batch so far against R1 and R2 as they stand at this step.
      assert shifts[s] and window[0] == s
      assert window[1] == pytest.approx(
          1 - _official_sg_score(guard.fakes, guard.r1, guard.r2), rel=1e-12)
  assert windows >= 3
  assert len(guard.r1) + len(guard.r2) == int(np.sum(shifts[4:] == 0))


def test_reference_cosine_skips_the_last_row():
  rng = np.random.default_rng(3)
  g, ref = rng.normal(size=(2, 5, 4)), rng.normal(size=(2, 5, 4))
  ref_changed = ref.copy()
  ref_changed[:, -1] = 100.0
  a, b = g[:, :-1].ravel(), ref[:, :-1].ravel()
  expected = a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
  assert detectors.reference_cosine(g, ref) == pytest.approx(expected, rel=1e-12)
  assert detectors.reference_cosine(g, ref_changed) == pytest.approx(expected, rel=1e-12)


def _official_similarity(g, labels):
  """The per-step statistics of GradientsScrutinizer SL.py: util.get_cos_sim over every
  ordered pair k != l of rows, split by label (rows t < T-1, label = the next token)."""
  rows = [(g[b, t], labels[b, t + 1]) for b in range(g.shape[0]) for t in range(g.shape[1] - 1)]
  same, diff = [], []
  for k, (u, yu) in enumerate(rows):
    for m, (v, yv) in enumerate(rows):
      if k != m:
        (same if yu == yv else diff).append(0.5 + 0.5 * u @ v / (np.linalg.norm(u)
                                                                 * np.linalg.norm(v)))
  return np.mean(diff), np.mean(same), np.std(diff), np.std(same)


def _official_score(sim, i):
  """util.detection_score at step i (its FSHA-run IoU: the true intersection), sim [4, n]
  rows (different mean, same mean, different std, same std), transcribed."""
  x = np.arange(i)
  errs = [np.sqrt(np.mean((sim[r][:i] - np.poly1d(np.polyfit(x, sim[r][:i], 2))(x)) ** 2))
          for r in (0, 1)]
  same_min, same_max = sim[1][i] - sim[3][i], sim[1][i] + sim[3][i]
  diff_min, diff_max = sim[0][i] - sim[2][i], sim[0][i] + sim[2][i]
  iou_in = (0.0 if max(same_min, diff_min) > min(diff_max, same_max)
            else min(diff_max, same_max) - max(same_min, diff_min))
  iou = iou_in / (max(diff_max, same_max) - min(same_min, diff_min))
  gap = (sim[1][i] - sim[0][i]) / (sim[0][i] + sim[1][i])
  m_err = -np.log((errs[0] + errs[1]) / 2 * 7 + 1 / (np.e * np.e))
  m_iou = -np.log(iou * 1 + 1 / np.e)
  m_gap = gap / (np.abs(gap) ** 0.6)
  return 1 / (1 + np.exp(-5 * (m_gap * m_err * m_iou - 0.7)))


def test_scrutinizer_statistics_and_score_match_the_official_code():
  rng = np.random.default_rng(4)
  g, labels = rng.normal(size=(2, 6, 5)), rng.integers(0, 3, (2, 6))
  np.testing.assert_allclose(detectors.label_similarity(g, labels),
                             _official_similarity(g, labels), rtol=1e-12)
  series = np.stack([0.50 + 0.003 * rng.normal(size=12), 0.70 + 0.003 * rng.normal(size=12),
                     0.03 + 0.01 * rng.random(12), 0.04 + 0.01 * rng.random(12)])
  for step in (3, 7, 11):
    assert detectors.scrutinizer_score(series.T, step) == pytest.approx(
        _official_score(series, step), rel=1e-12)
  # Label-shaped gradients (same-label pairs far more alike) score as honest; gradients
  # that ignore the labels (both kinds alike, bands overlapping) as an attack.
  honest = detectors.scrutinizer_score(series.T, 11)
  hijacked = series.copy()
  hijacked[1] = hijacked[0] + 0.002 * rng.normal(size=12)
  assert honest > 0.5 > detectors.scrutinizer_score(hijacked.T, 11)


def test_scrutinizer_windows_skip_batches_without_same_label_pairs():
  rng = np.random.default_rng(5)
  scrutinizer = detectors.Scrutinizer(every=2)
  windows = []
  for step in range(9):
    labels = (np.arange(12).reshape(2, 6) if step == 4  # Every label distinct: no mu_s.
              else rng.integers(0, 3, (2, 6)))
    window = scrutinizer.observe(step, rng.normal(size=(2, 6, 4)), labels)
    windows += [] if window is None else [window[0]]
  # Step 4 has no same-label pair; steps 0 and 2 have fewer than 3 earlier steps.
  assert windows == [6, 8]
  assert np.isnan(scrutinizer.series[4][1]) and np.isfinite(scrutinizer.series[5]).all()
  with pytest.raises(ValueError, match="out of order"):
    scrutinizer.observe(3, rng.normal(size=(2, 6, 4)), labels)


def test_thresholds_quantile_hash_and_rates():
  scores = {"splitguard": [0.1, 0.5, 0.2], "reference_cosine": list(np.linspace(0, 1, 201))}
  fixed = detectors.calibrate(scores, 0.99, {"seeds": [1]})
  assert fixed["thresholds"]["splitguard"] == 0.5  # Fewer than 100 windows: their maximum.
  assert fixed["thresholds"]["reference_cosine"] == pytest.approx(0.99)
  detectors.check_thresholds(fixed)
  tampered = dict(fixed, thresholds={**fixed["thresholds"], "splitguard": 0.9})
  with pytest.raises(ValueError, match="sha256"):
    detectors.check_thresholds(tampered)
  judged = [detectors.judge([(0, 0.2), (5, 0.7), (9, 0.9)], 0.5),
            detectors.judge([(0, 0.1)], 0.5)]
  assert judged[0] == {"windows": 3, "fired": 2, "first_step": 5}
  rates = detectors.rates(judged, z=1.6449)
  p, n, z = 2 / 4, 4, 1.6449
  wilson = (p + z * z / (2 * n) + z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))) / (
      1 + z * z / n)
  assert rates["rate"] == 0.5 and rates["wilson_upper"] == pytest.approx(wilson)
  assert rates["runs_detected"] == 1 and rates["first_steps"] == [5, None]


def test_separation_against_brute_force():
  honest, attack = [0.1, 0.3, 0.3, 0.2], [0.3, 0.5, 0.05]
  pairs = [(a > h) + 0.5 * (a == h) for a in attack for h in honest]
  sep = detectors.separation(honest, attack)
  assert sep["auc"] == pytest.approx(np.mean(pairs))
  assert sep["tpr_above_honest"] == pytest.approx(1 / 3)
  assert detectors.separation([], attack) == {"auc": None, "tpr_above_honest": None}


def _brute_force_lof(honest: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
  """Local outlier factor of each query against the honest set, from Breunig et al.'s
  definition (novelty: training points' neighbourhoods exclude themselves; reachability
  distance max(k-distance(o), d(p, o)); the 1e-10 of scikit-learn's density)."""
  dist = lambda a, b: np.sqrt(((a[:, None, :] - b[None, :, :]) ** 2).sum(-1))
  train = dist(honest, honest)
  np.fill_diagonal(train, np.inf)
  train_nn = np.argsort(train, axis=1, kind="stable")[:, :k]
  k_distance = np.take_along_axis(train, train_nn, 1)[:, -1]

  def lrd(distances, neighbours):
    reach = np.maximum(distances, k_distance[neighbours])
    return 1.0 / (reach.mean(axis=1) + 1e-10)

  train_lrd = lrd(np.take_along_axis(train, train_nn, 1), train_nn)
  query = dist(queries, honest)
  query_nn = np.argsort(query, axis=1, kind="stable")[:, :k]
  query_lrd = lrd(np.take_along_axis(query, query_nn, 1), query_nn)
  return train_lrd[query_nn].mean(axis=1) / query_lrd


def test_splitout_lof_matches_the_definition_and_separates_a_shifted_cloud():
  rng = np.random.default_rng(3)
  honest = rng.normal(size=(16, 40))
  inside = rng.normal(size=(6, 40))
  shifted = rng.normal(size=(6, 40)) + 4.0
  splitout = detectors.SplitOut(honest, window=3)
  queries = np.concatenate([inside, shifted])
  np.testing.assert_allclose(splitout.factor(queries), _brute_force_lof(honest, queries, 15),
                             rtol=1e-9)
  lof = splitout.factor(queries)
  threshold = detectors.SPLITOUT_OFFICIAL_THRESHOLD
  assert (lof[:6] < threshold).all() and (lof[6:] > threshold).all()
  with pytest.raises(ValueError, match="at least 3"):
    detectors.SplitOut(honest[:2], window=3)


def test_splitout_windows_are_the_majority_vote():
  rng = np.random.default_rng(4)
  for w in (1, 2, 3, 4, 5, 10):
    for _ in range(50):
      lofs = rng.choice([0.9, 1.2, 1.6, 2.5, 4.0], size=w)
      majority = np.sum(lofs > 1.5) > w / 2
      assert (detectors.majority_score(lofs) > 1.5) == majority, (w, lofs)
  honest = rng.normal(size=(8, 5))
  splitout = detectors.SplitOut(honest, window=2)
  vectors = [rng.normal(size=5), rng.normal(size=5) + 6, rng.normal(size=5) + 6,
             rng.normal(size=5) + 6]
  steps = [0, 2, 3, 7]  # Skipped steps (SplitGuard's fake batches) are not observed.
  windows = [splitout.observe(s, v) for s, v in zip(steps, vectors)]
  assert windows[0] is None and windows[2] is None
  lof = splitout.factor(np.stack(vectors))
  assert windows[1] == (2, pytest.approx(min(lof[:2])))  # Both must be outliers.
  assert windows[3] == (7, pytest.approx(min(lof[2:])))
  with pytest.raises(ValueError, match="out of order"):
    splitout.observe(7, vectors[0])
