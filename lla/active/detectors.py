"""Client-side detection of a malicious server: four detectors, fixed thresholds, TPR / FPR.

  SplitGuard-LM (Erdogan, Kupcu, Cicek, WPES'22; `ege-erdogan/splitguard`
      `label-changing/splitguard.ipynb`): after `warmup` batches the client sends, with
      probability p_fake, a fake batch whose targets are all wrong ((y + r) mod V, one
      r ~ U{1..V-1} per batch, through its loss oracle), records the gradient of its first
      block's attention kernel and does not apply the update; regular-batch vectors go at
      random to R1 or R2. Each fake batch scores (official `sg_score`, angles in radians)
        x = angle(F~, CR~) ||F| - |CR|| / m - angle(R1~, R2~) ||R1| - |R2|| / m,
        m = ||F| - |CR|| + ||R1| - |R2||,  SG = sigmoid(mult x)^exp,
      with F~, R1~, R2~ the mean vectors, |F|, |R1|, |R2| the mean norms, CR~ and |CR| the
      averages of R1's and R2's. High SG = honest: an honest server's fake-batch gradients
      differ from regular ones; a hijacking server ignores the labels.
  Reference cosine (SplitOut's "simulate the honest server", made cheap by the public
      pre-trained tail, notes/active-server.md 4.5): every `every` batches the client
      recomputes g_ref = dL/dh with its copy of the public tail and scores cos(g, g_ref) over
      the rows t < T-1 (the last row is zero in both).
  Gradients Scrutinizer (Fu et al., NDSS'23; `CGCL-codes/GradientsScrutinizer` util.py
      `detection_score`, notes/active-server.md 3.2), passive: every step the client splits
      the pairs of returned-gradient rows (t < T-1) of its batch into pairs whose labels (the
      next tokens it sent) are the same and pairs whose labels differ, and keeps the mean
      and standard deviation of s = 0.5 + 0.5 cos over each. Every `every` steps i it scores
        gap = (mu_s - mu_d) / (mu_s + mu_d) at step i,
        err = mean RMS residual of degree-2 fits of mu_d and mu_s over steps 0..i-1,
        IoU = |band_s & band_d| / |band_s | band_d| at step i, bands mu +- sd,
        score = sigmoid(5 (m_gap m_err m_iou - 0.7)), m_gap = gap / |gap|^0.6,
        m_err = -ln(7 err + e^-2), m_iou = -ln(IoU + e^-1),
      high = honest (labels shape an honest server's gradients; a hijacker's ignore them).
      The official honest-run IoU takes min(upper) - min(lower) as the intersection; its
      FSHA run, and this code for both, the true min(upper) - max(lower).
  SplitOut (Erdogan et al., CANS'24, arXiv 2302.08618; `ege-erdogan/splitout` `sg_ad.ipynb`,
      notes/active-server.md 3.3): before training the client simulates honest split
      training on its own data with its copy of the public tail, and fits scikit-learn's
      `LocalOutlierFactor(n_neighbors = n - 1, novelty=True)` on the n probe vectors (SplitGuard's:
      the first block's attention-kernel gradient) it saw. In training each step's probe
      vector is an outlier when its LOF exceeds 1.5 (scikit-learn's `contamination="auto"`
      offset), and the client flags an attack when the outliers are the majority of a window
      of w steps. A window's alarm score is the (floor(w/2) + 1)-th largest LOF of its steps:
      it exceeds 1.5 exactly when the majority does (the official rule), and the calibrated
      threshold below applies to it like to the others'. Windows do not overlap.

Every detector emits an alarm score per window (higher = more suspicious: 1 - SG and
1 - cos). A threshold is the `quantile` (0.99) of the alarm scores of calibration honest
runs, fixed and hashed before the runs it judges; a window fires when its score exceeds it.
"""

from __future__ import annotations

import math

import numpy as np

from lla.evidence import files
from lla.scoring import metrics

DETECTORS = ("splitguard", "reference_cosine", "scrutinizer", "splitout")
# scikit-learn's LocalOutlierFactor with contamination="auto": outlier iff LOF > 1.5.
SPLITOUT_OFFICIAL_THRESHOLD = 1.5


# --- SplitGuard -------------------------------------------------------------------------------


def angle(u: np.ndarray, v: np.ndarray) -> float:
  """The angle between two vectors in radians (the cosine clipped to [-1, 1])."""
  cos = float(np.dot(u, v) / (np.linalg.norm(u) * np.linalg.norm(v)))
  return math.acos(min(1.0, max(-1.0, cos)))


def splitguard_raw(fakes, r1, r2) -> float:
  """SplitGuard's x (before the squashing) from lists of float vectors."""
  mean = lambda vs: np.mean(np.stack(vs).astype(np.float64), axis=0)
  mag = lambda vs: float(np.mean([np.linalg.norm(np.asarray(v, np.float64)) for v in vs]))
  f_mean, c_mean, r_mean = mean(fakes), mean(r1), mean(r2)
  cr_mean = (c_mean + r_mean) / 2
  f_mag, c_mag, r_mag = mag(fakes), mag(r1), mag(r2)
  cr_mag = (c_mag + r_mag) / 2
  div = abs(f_mag - cr_mag) + abs(c_mag - r_mag)
  return (angle(f_mean, cr_mean) * abs(f_mag - cr_mag) / div
          - angle(c_mean, r_mean) * abs(r_mag - c_mag) / div)


def splitguard_score(fakes, r1, r2, mult: float = 5.0, exp: float = 2.0) -> float:
  """SG = sigmoid(mult x)^exp in [0, 1]; high = honest."""
  return float((1.0 / (1.0 + math.exp(-mult * splitguard_raw(fakes, r1, r2)))) ** exp)


class SplitGuard:
  """The client's SplitGuard state over one run (host side, numpy).

  `plan(num_steps, vocab, rng)` draws which steps are fake and their shifts; `observe` takes
  the probe vector of each step and returns a window (step, alarm score) per fake batch
  once both R1 and R2 hold a vector.
  """

  def __init__(self, warmup: int, p_fake: float, mult: float, exp: float):
    self.warmup, self.p_fake, self.mult, self.exp = warmup, p_fake, mult, exp
    self.fakes, self.r1, self.r2 = [], [], []
    self.split = None  # Set by `plan`: which regular vectors go to R1.

  def plan(self, num_steps: int, vocab: int, rng: np.random.Generator) -> np.ndarray:
    """[S] int32 target shift per step: 0 for a regular batch, r in 1..V-1 for a fake one.
    The official code starts after batch N (`index > N`)."""
    fake = (np.arange(num_steps) > self.warmup) & (rng.random(num_steps) <= self.p_fake)
    shifts = rng.integers(1, vocab, size=num_steps)
    self.split = rng.random(num_steps) <= 0.5   # regular vectors: True -> R1
    return np.where(fake, shifts, 0).astype(np.int32)

  def observe(self, step: int, vector: np.ndarray, shift: int) -> tuple[int, float] | None:
    if shift:
      self.fakes.append(vector)
      if self.r1 and self.r2:
        return step, 1.0 - splitguard_score(self.fakes, self.r1, self.r2, self.mult, self.exp)
      return None
    if step > self.warmup:
      (self.r1 if self.split[step] else self.r2).append(vector)
    return None


# --- reference cosine -----------------------------------------------------------------------


def reference_cosine(g: np.ndarray, g_ref: np.ndarray) -> float:
  """cos(g, g_ref) over rows t < T-1 of [B, T, d] gradients, flattened (float64)."""
  a = np.asarray(g, np.float64)[:, :-1].reshape(-1)
  b = np.asarray(g_ref, np.float64)[:, :-1].reshape(-1)
  denom = np.linalg.norm(a) * np.linalg.norm(b)
  return float(a @ b / denom) if denom > 0 else 0.0


# --- Gradients Scrutinizer --------------------------------------------------------------------


def label_similarity(g: np.ndarray, labels: np.ndarray) -> tuple[float, float, float, float]:
  """(mu_d, mu_s, sd_d, sd_s) of s = 0.5 + 0.5 cos over pairs of returned-gradient rows.

  Args:
    g: [B, T, d] returned gradients; rows t < T-1 carry the losses of positions t..T-2.
    labels: [B, T] the tokens the client sent; row (b, t)'s label is labels[b, t + 1].

  Returns:
    Mean and standard deviation over the pairs of different labels (d) and of the same
    label (s); NaN for a kind the batch has no pair of. A zero row has s = 0 (official).
  """
  rows = np.asarray(g, np.float64)[:, :-1].reshape(-1, g.shape[-1])
  label = np.asarray(labels)[:, 1:].reshape(-1)
  norms = np.linalg.norm(rows, axis=1)
  safe = np.where(norms > 0, norms, 1.0)
  cos = (rows / safe[:, None]) @ (rows / safe[:, None]).T
  sim = np.where((norms[:, None] > 0) & (norms[None, :] > 0), 0.5 + 0.5 * cos, 0.0)
  i, j = np.triu_indices(len(rows), 1)  # Unordered pairs: the ordered ones twice, same moments.
  same = label[i] == label[j]
  pick = lambda mask: sim[i[mask], j[mask]]
  stat = lambda v, f: float(f(v)) if v.size else math.nan
  d, s_ = pick(~same), pick(same)
  return stat(d, np.mean), stat(s_, np.mean), stat(d, np.std), stat(s_, np.std)


def _fit_error(x: np.ndarray, y: np.ndarray) -> float:
  """RMS residual of a degree-2 least-squares fit of y [n] against x [n]."""
  fitted = np.poly1d(np.polyfit(x, y, 2))(x)
  return float(np.sqrt(np.mean((y - fitted) ** 2)))


def scrutinizer_score(similarity: np.ndarray, step: int) -> float | None:
  """The detection score (high = honest) at `step` from similarity [n > step, 4], rows
  (mu_d, mu_s, sd_d, sd_s) of steps 0..n-1 (module doc; official constants). The fits take
  the steps before `step` whose batch had pairs of both kinds (official: every step; a
  batch without a same-label pair has no mu_s); None where `step` has none or fewer than
  3 earlier steps do."""
  earlier = np.flatnonzero(np.isfinite(similarity[:step]).all(axis=1))
  if not np.isfinite(similarity[step]).all() or len(earlier) < 3:
    return None
  mu_d, mu_s, sd_d, sd_s = similarity[step]
  x = earlier.astype(np.float64)
  err = (_fit_error(x, similarity[earlier, 0]) + _fit_error(x, similarity[earlier, 1])) / 2
  low, high = max(mu_s - sd_s, mu_d - sd_d), min(mu_s + sd_s, mu_d + sd_d)
  union = max(mu_s + sd_s, mu_d + sd_d) - min(mu_s - sd_s, mu_d - sd_d)
  iou = max(high - low, 0.0) / union if union > 0 else 1.0
  gap = (mu_s - mu_d) / (mu_s + mu_d)
  m_gap = gap / abs(gap) ** 0.6 if gap else 0.0
  m_err = -math.log(7.0 * err + math.exp(-2.0))
  m_iou = -math.log(iou + math.exp(-1.0))
  return 1.0 / (1.0 + math.exp(-5.0 * (m_gap * m_err * m_iou - 0.7)))


class Scrutinizer:
  """The client's Gradients Scrutinizer over one run: `observe` takes each step's returned
  gradient and the labels it sent, in step order, and returns a window (step, alarm score
  = 1 - score) at every `every`-th step that `scrutinizer_score` can score."""

  def __init__(self, every: int):
    if every < 1:
      raise ValueError(f"scrutinizer_every must be >= 1, got {every}")
    self.every, self.series = every, []

  def observe(self, step: int, g: np.ndarray, labels: np.ndarray) -> tuple[int, float] | None:
    if step != len(self.series):
      raise ValueError(f"scrutinizer: step {step} observed out of order")
    self.series.append(label_similarity(g, labels))
    if step % self.every:
      return None
    score = scrutinizer_score(np.asarray(self.series, np.float64), step)
    return None if score is None else (step, 1.0 - score)


# --- SplitOut -----------------------------------------------------------------------------------


def majority_score(lofs) -> float:
  """A window's alarm score: the (floor(w/2) + 1)-th largest of its w LOF values, which is
  above a threshold exactly when more than half of them are (SplitOut's majority vote)."""
  values = np.sort(np.asarray(lofs, np.float64))[::-1]
  return float(values[len(values) // 2])


class SplitOut:
  """The client's SplitOut over one run: fitted on the probe vectors of its honest
  simulation, `observe` takes the probe vectors of the steps it judges in step order and
  returns a window (its last step, alarm score) every `window` of them."""

  def __init__(self, honest_vectors, window: int):
    from sklearn.neighbors import LocalOutlierFactor  # pylint: disable=g-import-not-at-top
    honest = np.asarray(honest_vectors, np.float64)
    if honest.ndim != 2 or len(honest) < 3:
      raise ValueError(f"splitout: needs at least 3 honest probe vectors, got {honest.shape}")
    if window < 1:
      raise ValueError(f"splitout_window must be >= 1, got {window}")
    self.lof = LocalOutlierFactor(n_neighbors=len(honest) - 1, novelty=True).fit(honest)
    self.window, self.pending, self.last_step = window, [], -1

  def factor(self, vectors) -> np.ndarray:
    """LOF [n] of probe vectors [n, p] against the honest set (1 = as dense as it)."""
    return -self.lof.score_samples(np.asarray(vectors, np.float64))

  def observe(self, step: int, vector: np.ndarray) -> tuple[int, float] | None:
    if step <= self.last_step:
      raise ValueError(f"splitout: step {step} observed out of order")
    self.last_step = step
    self.pending.append(float(self.factor(np.asarray(vector)[None])[0]))
    if len(self.pending) < self.window:
      return None
    score, self.pending = majority_score(self.pending), []
    return step, score


# --- thresholds and judgement -----------------------------------------------------------------


def calibrate(windows: dict[str, list[float]], quantile: float, source: dict) -> dict:
  """Thresholds per detector: the `quantile` of honest calibration alarm scores.

  Args:
    windows: detector -> every alarm score of the calibration runs.
    quantile: e.g. 0.99 for a nominal 1% false-alarm rate; with fewer than 1 / (1 - q)
      windows this is their maximum ("higher" interpolation).
    source: what the thresholds were computed from (seeds, config hash), recorded.

  Returns:
    {"thresholds": {detector: float}, "windows": {detector: n}, "quantile", "source",
     "sha256": hash of the canonical JSON of everything else}.
  """
  body = {"thresholds": {}, "windows": {}, "quantile": quantile, "source": source}
  for name, scores in sorted(windows.items()):
    if not scores:
      raise ValueError(f"detector {name!r}: no calibration windows to set a threshold from")
    body["thresholds"][name] = float(np.quantile(np.asarray(scores, np.float64), quantile,
                                                 method="higher"))
    body["windows"][name] = len(scores)
  return {**body, "sha256": files.sha256_bytes(files.canonical_json(body))}


def check_thresholds(thresholds: dict) -> None:
  """Raises ValueError if a thresholds record does not match its own hash."""
  body = {k: v for k, v in thresholds.items() if k != "sha256"}
  if files.sha256_bytes(files.canonical_json(body)) != thresholds.get("sha256"):
    raise ValueError("detector thresholds do not match their sha256: changed after fixing")


def judge(windows: list[tuple[int, float]], threshold: float) -> dict:
  """Decisions of one run's windows [(step, alarm score)]: fired count, first firing step."""
  fired = [step for step, score in windows if score > threshold]
  return {"windows": len(windows), "fired": len(fired),
          "first_step": fired[0] if fired else None}


def rates(judged: list[dict], z: float) -> dict:
  """Pooled rate of fired windows with its one-sided Wilson upper bound at `z`."""
  n = sum(j["windows"] for j in judged)
  k = sum(j["fired"] for j in judged)
  return {"windows": n, "fired": k, "rate": k / n if n else None,
          "wilson_upper": metrics.wilson_upper_rate(k / n, n, z) if n else None,
          "runs_detected": sum(j["first_step"] is not None for j in judged),
          "runs": len(judged), "first_steps": [j["first_step"] for j in judged]}


def separation(honest: list[float], attack: list[float]) -> dict:
  """Threshold-free view of one detector against one server, from judged windows' scores.

  auc: P(attack score > honest score) + P(tie) / 2 (the Mann-Whitney statistic);
  tpr_above_honest: the share of attack windows above every judged honest window, i.e. the
  detection rate at an empirical false-alarm rate of 0 (chosen after the fact on the very
  honest runs it is measured on: optimistic, unlike the fixed thresholds).
  """
  h, a = np.asarray(honest, np.float64), np.asarray(attack, np.float64)
  if not len(h) or not len(a):
    return {"auc": None, "tpr_above_honest": None}
  greater = (a[:, None] > h[None, :]).mean()
  ties = (a[:, None] == h[None, :]).mean()
  return {"auc": float(greater + ties / 2), "tpr_above_honest": float(np.mean(a > h.max()))}
