"""Pure-JAX reference for `lla_kernels.vocab_topk`: materialise the scores, then `lax.top_k`.

This is what runs on CPU, and the definition the Pallas kernel is tested against. The
scores are written exactly as the candidate rankings of lla.attacks.candidates always
wrote them (same operations, same order), so that CPU results are bit-identical to the
code that predates the kernel.

Scores of a query row x [d] against every table row E[v] [d]:
  "dot"          <x, E[v]>                  (larger first)
  "neg_dot"      -<x, E[v]>                 (smallest dot product first)
  "neg_sq_dist"  -((||x||^2 - 2 <x, E[v]>) + ||E[v]||^2)   (nearest row first)
Excluded entries score -inf. `lax.top_k` orders by value under IEEE total order
(+nan > +inf > ... > +0 > -0 > ... > -inf > -nan) and breaks ties by the lower index.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

KINDS = ("dot", "neg_dot", "neg_sq_dist")


def dot_products(x: jax.Array, table: jax.Array) -> jax.Array:
  """<x, E[v]> in float32: x [..., d], table [V, d] -> [..., V]."""
  if x.dtype == table.dtype == jnp.float32:
    return jnp.einsum("...d,vd->...v", x, table)
  return jnp.einsum("...d,vd->...v", x, table, preferred_element_type=jnp.float32)


def squared_norms(a: jax.Array) -> jax.Array:
  """||a||^2 over the last axis, in float32."""
  return jnp.sum(a.astype(jnp.float32) ** 2, -1)


def scores(x: jax.Array, table: jax.Array, kind: str) -> jax.Array:
  """[..., V] float32 scores of kind `kind` (module docstring); larger is better."""
  dots = dot_products(x, table)
  if kind == "dot":
    return dots
  if kind == "neg_dot":
    return -dots
  if kind == "neg_sq_dist":
    return -(squared_norms(x)[..., None] - 2.0 * dots + squared_norms(table))
  raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def topk(x: jax.Array, table: jax.Array, k: int, kind: str = "dot",
         mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Top-k table rows for each query row, from the materialised [..., V] scores.

  Args:
    x: [..., d] query rows (float32 or bfloat16).
    table: [V, d] table rows, same dtype as x.
    k: rows returned, 1 <= k <= V.
    kind: "dot", "neg_dot" or "neg_sq_dist".
    mask: optional [..., V] bool, True where a row is excluded (it scores -inf).

  Returns:
    (values [..., k] float32, indices [..., k] int32), best first, ties to the lower index.
  """
  s = scores(x, table, kind)
  if mask is not None:
    s = jnp.where(mask, -jnp.inf, s)
  values, indices = jax.lax.top_k(s, k)
  return values, indices.astype(jnp.int32)
