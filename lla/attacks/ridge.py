"""Ridge-regression inversion decoder (PROTOCOL section 4).

On calibration documents, with the attacker's client weights: `H = client(X_cal)` as
`[N*T, d]`, targets `E = wte[X_cal]`; both centred; `W = (Hc^T Hc + lam I)^-1 Hc^T Ec` with
`lam = ridge_alpha * trace(Hc^T Hc) / d`. Decoded embedding `e_hat = (h - mu_H) W + mu_E`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg


@dataclasses.dataclass(frozen=True)
class RidgeDecoder:
  """weights [d, d_e], mu_h [d], mu_e [d_e], all float32 for decoding."""

  weights: np.ndarray
  mu_h: np.ndarray
  mu_e: np.ndarray
  lam: float

  def decode(self, h: jax.Array) -> jax.Array:
    """h [..., d] -> e_hat [..., d_e]."""
    return decode(self.weights, self.mu_h, self.mu_e, h)


def decode_fn(weights, mu_h, mu_e, h):
  """e_hat = (h - mu_h) W + mu_e; h [..., d], W [d, d_e] -> [..., d_e]."""
  return jnp.einsum("...d,de->...e", h - mu_h, weights) + mu_e


decode = jax.jit(decode_fn)


def fit_ridge(h: np.ndarray, e: np.ndarray, ridge_alpha: float) -> RidgeDecoder:
  """Fits the decoder. h [M, d], e [M, d_e] (rows are positions).

  The normal equations are formed and solved in float64: after several blocks the
  residual stream has outlier dimensions whose float32 Gram matrix is unreliable.
  """
  h = np.asarray(h, np.float64).reshape(-1, np.shape(h)[-1])
  e = np.asarray(e, np.float64).reshape(-1, np.shape(e)[-1])
  if h.shape[0] != e.shape[0]:
    raise ValueError(f"ridge: {h.shape[0]} activation rows but {e.shape[0]} target rows")
  mu_h, mu_e = h.mean(0), e.mean(0)
  hc, ec = h - mu_h, e - mu_e
  gram = hc.T @ hc
  lam = ridge_alpha * np.trace(gram) / gram.shape[0]
  weights = scipy.linalg.solve(gram + lam * np.eye(gram.shape[0]), hc.T @ ec, assume_a="pos")
  return RidgeDecoder(weights.astype(np.float32), mu_h.astype(np.float32),
                      mu_e.astype(np.float32), float(lam))


def ridge_flops(num_rows: int, d: int, d_e: int) -> float:
  """Gram + cross products + Cholesky solve."""
  return 2.0 * num_rows * d * (d + d_e) + d**3 / 3.0 + 2.0 * d * d * d_e
