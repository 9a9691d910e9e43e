"""d_chi-privacy on the client's input token embeddings (metric local DP on word embeddings).

Source: O. Feyisetan, B. Balle, T. Drake, T. Diethe, "Privacy- and Utility-Preserving Textual
Analysis via Calibrated Multivariate Perturbations", WSDM 2020 (section 4, "Sampling from
the mechanism"); used on split LLMs by SplitLLM / BiSR (Chen et al., CCS 2024: embedding
d_chi-privacy, with projection back to the nearest token) and Split-and-Denoise (Mai et al.,
ICML 2024: the noisy embeddings go through the client's layers).

Mechanism, independently for every position t of every document:

  e_t = input_table[x_t]                    (the unscaled row, HF's inputs_embeds)
  e'_t = e_t + z_t,   p(z) proportional to exp(-epsilon * ||z||_2),  z in R^d

sampled as Feyisetan et al. do: z = r * u with u uniform on the unit sphere S^{d-1} (a
standard normal vector divided by its norm) and r ~ Gamma(shape=d, scale=1/epsilon) (the
radial density of exp(-epsilon r) in d dimensions is proportional to r^{d-1} exp(-epsilon r)).
The mechanism is epsilon * ||e - e'||-private (d_chi-privacy with the Euclidean metric).

`project=True` is the nearest-neighbour variant (Feyisetan et al.'s full mechanism; SplitLLM's
"projection back to the nearest token"): e'_t is replaced by the table row nearest to it in
L2, i.e. the client runs on substituted tokens.

The client's k blocks then run on e' (`lla.model.split.client_from_embeddings`), so the server
observes h = blocks[0..k-1](e' + positions): the noise enters before block 0, which is why
this defense acts on "embeddings" and leaves h alone in `apply`.

strength = 1 / epsilon; epsilon = None is the undefended client (no noise, no projection).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lla.defenses.base import Defense, SecretKeys, register


def dx_noise(key: jax.Array, shape: tuple[int, ...], epsilon: float) -> jax.Array:
  """z [..., d] with density proportional to exp(-epsilon ||z||) on R^d, i.i.d. over rows:
  a uniform direction times a Gamma(d, 1/epsilon) norm (Feyisetan et al. 2020)."""
  key_dir, key_norm = jax.random.split(key)
  direction = jax.random.normal(key_dir, shape, jnp.float32)
  direction = direction / jnp.linalg.norm(direction, axis=-1, keepdims=True)
  radius = jax.random.gamma(key_norm, float(shape[-1]), shape[:-1] + (1,), jnp.float32)
  return direction * radius / epsilon


def nearest_rows(e: jax.Array, table: jax.Array) -> jax.Array:
  """Index [..., ] of the row of table [V, d] nearest to each e[..., :] in L2.

  argmin_v ||e - t_v||^2 = argmin_v (||t_v||^2 - 2 e.t_v); one row of e at a time against
  the whole table (lax.map), so memory is O(V) per row rather than O(rows * V)."""
  sq = jnp.sum(table * table, axis=-1)
  flat = e.reshape(-1, e.shape[-1])
  ids = jax.lax.map(lambda row: jnp.argmin(sq - 2.0 * (table @ row)), flat)
  return ids.reshape(e.shape[:-1])


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class DxPrivacy(Defense):
  """e' = e + z, p(z) ~ exp(-epsilon ||z||), per input position; optionally projected to the
  nearest token's embedding. See the module docstring for the formula and its source."""

  name = "dx_privacy"
  acts_on = "embeddings"

  has_secret = True

  epsilon: float | None
  project: bool = False

  def __post_init__(self):
    if self.epsilon is not None and not self.epsilon > 0:
      raise ValueError(f"epsilon={self.epsilon} must be > 0 (None: no noise)")

  @property
  def strength(self) -> float:
    return 0.0 if self.epsilon is None else 1.0 / self.epsilon

  def transform(self, x: jax.Array, keys: SecretKeys | None) -> jax.Array:
    """The noisy embeddings e' = e + z, e [B, T, d] (no projection: see `noisy_inputs`)."""
    return x + dx_noise(keys.step, x.shape, self.epsilon).astype(x.dtype)

  def noisy_inputs(self, table: jax.Array, tokens: jax.Array, keys: SecretKeys) -> jax.Array:
    """What the client's block 0 receives before positions: tokens [B, T] -> e' [B, T, d],
    with the projection to the nearest row of table [V, d] where `project`."""
    noisy = self.transform(table[tokens], keys)
    return table[nearest_rows(noisy, table)] if self.project else noisy
