"""Registered one-shot attacks: ridge inversion alone and the gradient-only heuristic."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np

from lla.attacks import flops, memory, registry
from lla.attacks.workspace import Workspace


@dataclasses.dataclass(frozen=True)
class OneShotAttack:
  """Predictions read off shared stages; charged those stages' FLOPs."""

  spec: registry.AttackSpec
  predict: Callable[[Workspace, object], np.ndarray]

  def __call__(self, ws: Workspace, budget, key: jax.Array) -> registry.AttackResult:
    return registry.AttackResult(self.predict(ws, budget).astype(np.int32), 0.0)


def _ridge(ws: Workspace, budget) -> np.ndarray:
  # The first column of any candidate list is the nearest token (stable ties).
  return ws.activation_ranked(int(budget.candidates))[..., 0]


def _gradient_only(ws: Workspace, budget) -> np.ndarray:
  """t >= 1: argmax_v <-g[t-1], wte[v]>; t = 0: the calibration's most common token."""
  ranked = ws.gradient_ranked(int(budget.c_a) + int(budget.c_g), ws.gradients,
                              "gradient_ranking")
  predictions = ranked[..., 0].copy()
  predictions[:, 0] = ws.baseline_token
  return predictions


registry.register(OneShotAttack(
    registry.AttackSpec("ridge", "ridge", ("activations",), budget_fields=("candidates", "ridge_alpha"),
                        description="linear (ridge) inversion alone: nearest token"),
    _ridge))

for _name, _positions in (("gradient_only", "all"), ("gradient_only_t1", "t>=1")):
  registry.register(OneShotAttack(
      registry.AttackSpec(
          _name, "gradient_heuristic", ("gradients",), knowledge=("public", "trained", "none"),
          needs_weights=False, budget_fields=("c_a", "c_g"), scored_positions=_positions,
          description=f"argmax of the previous position's negative gradient, scored on {_positions}"),
      _gradient_only))


def _ridge_stages(cfg, cut, num_docs, seq_len, budget, materialised):
  del cut, num_docs  # The ranking's working set is per document.
  return [("activation_candidates", memory.ranking_bytes_per_doc(
      seq_len, cfg.vocab_size, cfg.n_embd, int(budget["candidates"]), materialised))]


def _gradient_only_stages(cfg, cut, num_docs, seq_len, budget, materialised):
  del cut, num_docs
  num = int(budget["c_a"]) + int(budget["c_g"])
  return [("gradient_ranking", memory.ranking_bytes_per_doc(
      seq_len, cfg.vocab_size, cfg.n_embd, num, materialised))]


memory.declare_stages("ridge", _ridge_stages)
memory.declare_stages("gradient_only", _gradient_only_stages)
memory.declare_stages("gradient_only_t1", _gradient_only_stages)

# Analytic FLOPs (lla.attacks.flops): the shared rankings they read off.
flops.declare_flops("ridge", lambda s, budget: flops.activation_ranking(s))
flops.declare_flops("gradient_only", lambda s, budget: flops.gradient_ranking(s))
flops.declare_flops("gradient_only_t1", lambda s, budget: flops.gradient_ranking(s))
