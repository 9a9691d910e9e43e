"""An attack written outside lla: k-nearest-neighbour inversion against calibration rows.

For every observed row h[b, t] it takes the `knn_neighbours` calibration rows (the
attacker's client on its calibration documents, same position t) with the highest cosine
similarity and predicts the most frequent of their tokens (ties: the nearest). It needs
the activations and the attacker's copy of the client, and nothing else.

Replay it like a built-in attack:

  python -m experiments.replay --config=configs/replay.py --config.capture_dir=CAP \\
      --config.plugins=examples.knn_attack --config.attacks=knn,activation \\
      --config.plugin_budget=knn_neighbours=3 --workdir=RUN

docs/writing_an_attack.md walks through this file.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from lla.attacks import budget, registry

budget.declare("knn_neighbours", 1, int, low=1, high=64,
               doc="calibration rows voting for each observed row", source="examples/knn_attack.py")


@functools.partial(jax.jit, static_argnames=("neighbours",))
def knn_tokens(cal_h, cal_tokens, h, neighbours: int):
  """Majority token of the nearest calibration rows at the same position.

  Args:
    cal_h: [N, T, d] calibration activations; cal_tokens: [N, T] their tokens.
    h: [B, T, d] observed activations.

  Returns:
    [B, T] int32 predictions.
  """
  unit = lambda x: x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
  cosine = jnp.einsum("btd,ntd->btn", unit(h), unit(cal_h))
  _, nearest = jax.lax.top_k(cosine, neighbours)                   # [B, T, k]
  votes = jnp.take_along_axis(cal_tokens.T[None], nearest, axis=-1)  # [B, T, k]
  counts = jnp.sum(votes[..., :, None] == votes[..., None, :], axis=-1)
  # The most frequent vote; argmax keeps the first (nearest) among equals.
  return jnp.take_along_axis(votes, jnp.argmax(counts, -1)[..., None], -1)[..., 0]


@dataclasses.dataclass(frozen=True)
class KnnAttack:
  spec: registry.AttackSpec

  def __call__(self, ws, view, key):
    del key  # deterministic
    k = int(view.knn_neighbours)
    if k > ws.calibration_tokens.shape[0]:
      raise ValueError(f"knn_neighbours={k} exceeds the {ws.calibration_tokens.shape[0]} "
                       "calibration documents")
    cal_h = ws.calibration_activations()
    n, t, d = cal_h.shape
    predictions = ws.map_call(knn_tokens, (ws.activations,), 4.0 * t * (n + d),
                              consts=(cal_h, ws.calibration_tokens), neighbours=k)
    # Cosine similarities to every calibration row at the same position.
    analytic = 2.0 * ws.num_docs * t * n * d
    return registry.AttackResult(predictions.astype(np.int32), analytic,
                                 {"neighbours": k, "calibration_rows_per_position": n})


registry.register(KnnAttack(registry.AttackSpec(
    "knn", "nearest_neighbour", ("activations",), budget_fields=("knn_neighbours",),
    description="majority token of the k nearest calibration rows (cosine, same position)",
    reference="examples/knn_attack.py",
    threat_model="holds the client weights of its knowledge setting and public calibration "
    "text; reads the forward messages only",
    checks=(("synthetic", "tests/test_plugins.py::test_plugin_replays_scores_and_verifies",
             "recovers tokens of a capture made of calibration-like documents"),))))
