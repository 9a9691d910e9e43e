"""DP-Forward: clipping of each sequence's representation and the analytic Gaussian mechanism.

Source: M. Du, X. Yue, S. S. M. Chow, T. Wang, C. Huang, H. Sun, "DP-Forward: Fine-tuning
and Inference on Language Models with Differential Privacy in Forward Pass", ACM CCS 2023.
Its mechanism perturbs the forward representation X [T, d] of one sequence at a split
point with the analytic matrix Gaussian mechanism (aMGM) after bounding its sensitivity by
normalising X. lla uses the aMGM's isotropic case (row and column covariances both the
identity), where the matrix Gaussian is i.i.d. N(0, sigma^2) noise on the T * d entries and
the aMGM's condition is that of the analytic Gaussian mechanism of B. Balle and Y.-X. Wang,
"Improving the Gaussian Mechanism for Differential Privacy: Analytical Calibration and
Optimal Denoising", ICML 2018 (Theorem 8):

  X' = clip_C(X) + sigma * N(0, I_{T x d}),   clip_C(X) = X * C / max(||X||_F, C),

  sigma = the smallest s with
    Phi(D / (2 s) - eps * s / D) - e^eps * Phi(-D / (2 s) - eps * s / D) <= delta,

Phi the standard normal CDF and D the L2 (Frobenius) sensitivity. D = 2 C: DP-Forward's
guarantee is sequence-level local DP for one forward pass (its neighbouring inputs are any
two sequences, "replace-one"), and two clipped representations lie in the ball of radius C,
so they differ by at most 2 C; D = C would be the add/remove-one sensitivity of a sum over
records, which a single sequence's message is not.

The left-hand side decreases in s, so sigma is found by bisection in log s
(`analytic_gaussian_sigma`); e^eps * Phi(.) is evaluated as exp(eps + log Phi(.)) so that a
large eps does not overflow. sigma is derived from the public (epsilon, delta, clip_norm)
and recorded with them in E's public defense parameters (`params`).

strength = 1 / epsilon; epsilon = None is the undefended message (no clipping, no noise).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from scipy import special

from lla.defenses.base import RowwiseDefense, register


def analytic_gaussian_delta(sigma: float, epsilon: float, sensitivity: float) -> float:
  """delta(sigma) of the Gaussian mechanism with noise std sigma (Balle & Wang, Theorem 8)."""
  a = sensitivity / (2.0 * sigma)
  b = epsilon * sigma / sensitivity
  return float(special.ndtr(a - b) - np.exp(epsilon + special.log_ndtr(-a - b)))


@functools.lru_cache(maxsize=None)
def analytic_gaussian_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
  """The smallest sigma whose Gaussian mechanism is (epsilon, delta)-DP at L2 sensitivity
  `sensitivity` (Balle & Wang 2018, Theorem 8); the returned value satisfies the condition.

  Bisection on log sigma between a bracket doubled until it holds; 200 halvings leave the
  bracket at float64 resolution."""
  holds = lambda s: analytic_gaussian_delta(s, epsilon, sensitivity) <= delta
  lo = hi = sensitivity
  while not holds(hi):
    hi *= 2.0
  while holds(lo):
    lo /= 2.0
  for _ in range(200):
    mid = math.sqrt(lo * hi)
    if mid in (lo, hi):
      break
    lo, hi = (lo, mid) if holds(mid) else (mid, hi)
  return hi


def clip_frobenius(x: jax.Array, clip_norm: float) -> jax.Array:
  """One sequence's x [T, d] scaled to Frobenius norm <= clip_norm (unchanged within it)."""
  return x * (clip_norm / jnp.maximum(jnp.linalg.norm(x), clip_norm))


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class DPForward(RowwiseDefense):
  """X' = clip_C(X) + sigma N(0, I) per sequence, sigma from the analytic Gaussian mechanism
  at sensitivity 2C; see the module docstring for the formula and its sources."""

  name = "dp_forward"
  acts_on = "activations"

  has_secret = True

  epsilon: float | None
  delta: float = 1e-5
  clip_norm: float = 1.0

  def __post_init__(self):
    if self.epsilon is not None and not self.epsilon > 0:
      raise ValueError(f"epsilon={self.epsilon} must be > 0 (None: no mechanism)")
    if not 0 < self.delta < 1:
      raise ValueError(f"delta={self.delta} must lie in (0, 1)")
    if not self.clip_norm > 0:
      raise ValueError(f"clip_norm={self.clip_norm} must be > 0")

  @property
  def strength(self) -> float:
    return 0.0 if self.epsilon is None else 1.0 / self.epsilon

  @property
  def sensitivity(self) -> float:
    return 2.0 * self.clip_norm

  @property
  def sigma(self) -> float:
    return analytic_gaussian_sigma(self.epsilon, self.delta, self.sensitivity)

  def params(self):
    """The declared parameters and the derived sigma (public: a function of them)."""
    return {**super().params(), "sigma": None if self.off else self.sigma}

  def transform_document(self, x, persistent, key):
    del persistent
    return clip_frobenius(x, self.clip_norm) + self.sigma * jax.random.normal(key, x.shape,
                                                                              x.dtype)
