"""Crossed paired bootstrap over models and documents.

For a difference matrix D [M, N] (models x documents) between two attacks,
each replicate resamples the M models and the N documents independently with
replacement and takes the mean of D over the crossed resample:

  mean_{i,j} D[m_i, n_j] = w_m^T D w_n / (M N),

where w_m [M] and w_n [N] are the resample counts. So a chunk of R replicates
costs one [R, M] x [M, N] product and an [R, N] gather-and-sum, instead of R
gathers of an M x N submatrix. When D holds integer hit
differences the sums are exact in float64, so intervals do not depend on the
BLAS summation order.
"""

import dataclasses

import numpy as np

DEFAULT_REPLICATES = 100_000
DEFAULT_SEED = 93281
# Part of the definition of the replicate stream: draws are made chunk by
# chunk, so changing it changes the replicates (not their distribution).
CHUNK = 8192


@dataclasses.dataclass(frozen=True)
class PrimaryTest:
  """The pre-registered primary contrast (PROTOCOL section 5).

  Attributes:
    name: identifier in the scorecard.
    cut, knowledge: the configuration the test is run on.
    treatment, control: attack module names; D = treatment - control.
    metric: "token_recovery" (per-document recovered fraction).
    lower_bound_above_pp: the test passes if the lower interval end exceeds it.
    confidence: two-sided percentile interval level.
  """
  name: str = "joint_minus_activation_k6_public"
  cut: int = 6
  knowledge: str = "public"
  treatment: str = "joint"
  control: str = "activation"
  metric: str = "token_recovery"
  lower_bound_above_pp: float = 2.0
  confidence: float = 0.95

  @classmethod
  def from_policy(cls, d: dict, confidence: float) -> "PrimaryTest":
    return cls(confidence=confidence, **d)


def draw_indices(rng: np.random.Generator, reps: int, m: int,
                 n: int) -> tuple[np.ndarray, np.ndarray]:
  """Resampled model [reps, M] and document [reps, N] indices."""
  # int32 draws are ~3x faster than int64 and index any realistic M, N.
  return (rng.integers(0, m, size=(reps, m), dtype=np.int32),
          rng.integers(0, n, size=(reps, n), dtype=np.int32))


def _counts(idx: np.ndarray, k: int) -> np.ndarray:
  """[R, k] multiplicities of each index per row, via one bincount."""
  r = idx.shape[0]
  flat = (idx + k * np.arange(r, dtype=np.int64)[:, None]).ravel()
  return np.bincount(flat, minlength=r * k).reshape(r, k).astype(np.float64)


def replicate_means(d: np.ndarray, model_idx: np.ndarray,
                    doc_idx: np.ndarray) -> np.ndarray:
  """[R] crossed-resample means of D [M, N] for given index draws.

  (w_m^T D)[n_j] summed over the drawn documents equals w_m^T D w_n; the
  gather avoids materialising document counts.
  """
  m, n = d.shape
  col_sums = _counts(model_idx, m) @ d  # [R, N]
  return np.take_along_axis(col_sums, doc_idx, axis=1).sum(axis=1) / (m * n)


def canonical_order(d: np.ndarray) -> np.ndarray:
  """D with rows, then columns, in a canonical order.

  Resampling draws indices, so the replicates of a row- or column-permuted D
  would differ by Monte Carlo noise; sorting first makes the interval exactly
  invariant to how models and documents were listed. Rows are ordered by
  their sorted values (invariant to a document permutation), then columns
  lexicographically by their values. Joint permutations are exactly
  invariant unless two rows hold the same multiset of values.
  """
  rows = np.lexsort(np.sort(d, axis=1).T[::-1])
  d = d[rows]
  return d[:, np.lexsort(d[::-1])]


def replicates(d: np.ndarray, n_replicates: int = DEFAULT_REPLICATES,
               seed: int = DEFAULT_SEED) -> np.ndarray:
  """[n_replicates] bootstrap means of D [M, N] (float64, deterministic)."""
  d = np.asarray(d, np.float64)
  if d.ndim != 2 or min(d.shape) < 1:
    raise ValueError(f"difference matrix has shape {d.shape}, expected [M, N]")
  if not np.all(np.isfinite(d)):
    raise ValueError("difference matrix has non-finite entries")
  d = canonical_order(d)
  rng = np.random.default_rng(seed)
  out = np.empty(n_replicates)
  for start in range(0, n_replicates, CHUNK):
    reps = min(CHUNK, n_replicates - start)
    mi, ni = draw_indices(rng, reps, *d.shape)
    out[start:start + reps] = replicate_means(d, mi, ni)
  return out


def interval(d: np.ndarray, confidence: float = 0.95,
             n_replicates: int = DEFAULT_REPLICATES, seed: int = DEFAULT_SEED,
             scale: float = 1.0) -> dict:
  """Percentile interval of mean(D) * scale.

  Returns:
    {"estimate", "lo", "hi", "confidence", "replicates", "seed"}; estimate is
    the plain mean of D, lo/hi the (1-c)/2 and (1+c)/2 percentiles
    (numpy's default linear interpolation).
  """
  d = canonical_order(np.asarray(d, np.float64))
  reps = replicates(d, n_replicates, seed) * scale
  alpha = 1.0 - confidence
  lo, hi = np.percentile(reps, [100 * alpha / 2, 100 * (1 - alpha / 2)])
  return {"estimate": float(np.mean(d) * scale), "lo": float(lo),
          "hi": float(hi), "confidence": confidence,
          "replicates": n_replicates, "seed": seed}


def bonferroni(contrasts: dict[str, np.ndarray], family_confidence: float = 0.95,
               n_replicates: int = DEFAULT_REPLICATES,
               seed: int = DEFAULT_SEED, scale: float = 1.0) -> dict:
  """Secondary contrasts, each at level 1 - (1 - family_confidence) / k.

  Every contrast uses the same seed (common random numbers), so contrasts on
  the same models and documents see the same resamples.
  """
  k = len(contrasts)
  level = 1.0 - (1.0 - family_confidence) / max(k, 1)
  return {name: interval(d, level, n_replicates, seed, scale)
          for name, d in sorted(contrasts.items())}


def evaluate_primary(test: PrimaryTest, d: np.ndarray,
                     n_replicates: int = DEFAULT_REPLICATES,
                     seed: int = DEFAULT_SEED, scale: float = 1.0) -> dict:
  """Runs the primary test on D (scaled to percentage points by `scale`)."""
  res = interval(d, test.confidence, n_replicates, seed, scale)
  res.update(name=test.name, threshold_pp=test.lower_bound_above_pp,
             passed=res["lo"] > test.lower_bound_above_pp)
  return res
