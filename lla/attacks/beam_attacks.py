"""Registered beam-search attacks: activation-only, joint, its controls, FLOP-matched.

They differ only in the candidate set handed to the same beam search (PROTOCOL section 4).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np

from lla.attacks import beam
from lla.attacks import candidates as cand_lib
from lla.attacks import registry
from lla.attacks.workspace import Workspace, map_documents, xla_flops

CandidateFn = Callable[[Workspace, object, jax.Array], np.ndarray]


@dataclasses.dataclass(frozen=True)
class BeamAttack:
  """Candidates from `candidates_of`, then the KV-cached beam search of width W."""

  spec: registry.AttackSpec
  candidates_of: CandidateFn
  stages: tuple[str, ...]

  def __call__(self, ws: Workspace, budget, key: jax.Array) -> registry.AttackResult:
    candidates = self.candidates_of(ws, budget, key)
    width = int(budget.beam_width)
    predictions, xla, analytic = run_beam(ws, candidates, width)
    return registry.AttackResult(predictions, *ws.charge(self.stages, xla, analytic))


def beam_bytes_per_doc(ws: Workspace, width: int, num_candidates: int) -> float:
  """Working set of one document's search step: caches (old, gathered, new) and pairs."""
  d, k, t = ws.cfg.n_embd, ws.cut, ws.seq_len
  return 4.0 * (3 * width * k * 2 * t * d + width * num_candidates * (2 * k * d + 8 * d))


def run_beam(ws: Workspace, candidates: np.ndarray, width: int):
  """Beam search over all documents in memory-bounded chunks.

  Returns:
    (predictions [B, T] int32, XLA FLOPs or None, analytic FLOPs).
  """
  num_candidates = candidates.shape[-1]
  chunk = ws.chunk_for(beam_bytes_per_doc(ws, width, num_candidates))
  params, cfg, k = ws.params, ws.cfg, ws.cut
  fn = lambda h, c: beam.beam_search(params, cfg, k, h, c, width)[0]

  def cost(h, c):
    step = xla_flops(beam.step_cost_fn(params, cfg, k, h.shape[0], width, num_candidates,
                                       ws.seq_len))
    return None if step is None else step * ws.seq_len

  predictions, xla = map_documents(fn, (ws.activations, candidates.astype(np.int32)), chunk,
                                   ws.mesh, cost)
  analytic = beam.analytic_flops(cfg, k, ws.num_docs, width, num_candidates, ws.seq_len)
  return predictions.astype(np.int32), xla, analytic


def _activation(ws: Workspace, budget, key) -> np.ndarray:
  return ws.activation_ranked(int(budget.candidates))


def _joint_from(gradients_of: Callable[[Workspace, object], np.ndarray], stage: str):
  def candidates_of(ws: Workspace, budget, key) -> np.ndarray:
    c_a, c_g = int(budget.c_a), int(budget.c_g)
    activation = ws.activation_ranked(c_a + c_g)
    gradient = ws.gradient_ranked(c_a + c_g, gradients_of(ws, budget), stage)
    return np.asarray(cand_lib.joint_candidates(activation, gradient, c_a, c_g))
  return candidates_of


def _shuffled(ws: Workspace, budget) -> np.ndarray:
  return ws.gradients[cand_lib.derangement(ws.num_docs, int(budget.shuffle_seed))]


def _random(ws: Workspace, budget, key) -> np.ndarray:
  c_a, c_g = int(budget.c_a), int(budget.c_g)
  activation = ws.activation_ranked(c_a + c_g)
  vocab = ws.cfg.vocab_size
  fn = lambda a, index: cand_lib.random_fill_candidates(a, key, index, c_a, c_g, vocab)
  doc_index = np.arange(ws.num_docs, dtype=np.int32)
  out, _ = map_documents(fn, (activation, doc_index), ws.chunk_for(12.0 * ws.seq_len * vocab),
                         ws.mesh)
  return out


def flop_matched_budget(ws: Workspace, budget) -> int:
  """Candidates C for activation-only so that its analytic FLOPs match the joint attack's.

  The joint attack spends C_a + C_g candidates per position plus the gradient ranking
  (2 B T V d); activation-only keeps the beam width and gets the largest C whose total
  does not exceed that.
  """
  width, joint_c = int(budget.beam_width), int(budget.c_a) + int(budget.c_g)
  args = (ws.cfg, ws.cut, ws.num_docs, width)
  joint = (beam.analytic_flops(*args, joint_c, ws.seq_len)
           + cand_lib.candidate_flops(ws.num_docs * ws.seq_len, ws.cfg.vocab_size, ws.cfg.n_embd))
  c = joint_c
  while beam.analytic_flops(*args, c + 1, ws.seq_len) <= joint and c < ws.cfg.vocab_size:
    c += 1
  return c


_ACT_STAGES = ("ridge", "activation_candidates")
_BUDGET = ("candidates", "beam_width", "ridge_alpha")
_JOINT_BUDGET = ("c_a", "c_g", "beam_width", "ridge_alpha")

registry.register(BeamAttack(
    registry.AttackSpec(
        "activation", "beam_inversion", ("activations",), budget_fields=_BUDGET,
        description="ridge candidates + activation-matching beam search"),
    _activation, _ACT_STAGES))

registry.register(BeamAttack(
    registry.AttackSpec(
        "activation_flop_matched", "beam_inversion", ("activations",),
        budget_fields=("c_a", "c_g", "beam_width", "ridge_alpha"),
        description="activation-only with the candidates that spend the joint attack's FLOPs"),
    lambda ws, budget, key: ws.activation_ranked(flop_matched_budget(ws, budget)), _ACT_STAGES))

registry.register(BeamAttack(
    registry.AttackSpec(
        "joint", "beam_inversion", ("activations", "gradients"), budget_fields=_JOINT_BUDGET,
        description="activation candidates + gradient-ranked candidates, beam search"),
    _joint_from(lambda ws, budget: ws.gradients, "gradient_ranking"),
    _ACT_STAGES + ("gradient_ranking",)))

registry.register(BeamAttack(
    registry.AttackSpec(
        "shuffled_gradients", "beam_inversion", ("activations", "gradients"),
        budget_fields=_JOINT_BUDGET + ("shuffle_seed",), role="negative_control",
        description="joint attack with gradients deranged across documents"),
    _joint_from(_shuffled, "shuffled_gradient_ranking"),
    _ACT_STAGES + ("shuffled_gradient_ranking",)))

registry.register(BeamAttack(
    registry.AttackSpec(
        "random_candidates", "beam_inversion", ("activations",), budget_fields=_JOINT_BUDGET,
        role="negative_control",
        description="joint attack with the gradient slots filled by random tokens"),
    _random, _ACT_STAGES))

for _plain, _candidates in (("activation", _activation),
                            ("joint", _joint_from(lambda ws, budget: ws.gradients,
                                                  "gradient_ranking"))):
  _spec = registry.get_unloaded(_plain).spec
  registry.register(BeamAttack(
      dataclasses.replace(
          _spec, name=f"{_plain}_defense_aware", defense_aware=True, reference_attack=_plain,
          description=_spec.description + "; ridge fitted on defended calibration activations"),
      _candidates, registry.get_unloaded(_plain).stages))
