"""Registered beam-search attacks: activation-only, joint, its controls, FLOP-matched.

They differ only in the candidate set handed to the same beam search (PROTOCOL section 4).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Callable

import jax
import numpy as np

from lla.attacks.seed import beam
from lla.attacks import budget as budget_lib
from lla.attacks import candidates as cand_lib
from lla.attacks import flops
from lla.attacks import memory
from lla.attacks import registry
from lla.attacks.workspace import Workspace
from lla.model import cost

CandidateFn = Callable[[Workspace, object, jax.Array], np.ndarray]


@dataclasses.dataclass(frozen=True)
class BeamAttack:
  """Candidates from `candidates_of`, then the KV-cached beam search of width W."""

  spec: registry.AttackSpec
  candidates_of: CandidateFn

  def __call__(self, ws: Workspace, budget, key: jax.Array) -> registry.AttackResult:
    candidates = self.candidates_of(ws, budget, key)
    width = int(budget.beam_width)
    predictions = run_beam(ws, candidates, width)
    analytic = beam.analytic_flops(ws.cfg, ws.cut, ws.num_docs, width, candidates.shape[-1],
                                   ws.seq_len, len(ws.known_prefix))
    return registry.AttackResult(predictions, analytic,
                                 {"candidates_per_position": int(candidates.shape[-1])})


def beam_bytes_per_doc(ws: Workspace, width: int, num_candidates: int) -> float:
  """Working set of one document's search step (lla.attacks.memory)."""
  return memory.beam_bytes_per_doc(ws.cfg.n_embd, ws.cut, ws.seq_len, width, num_candidates,
                                   cost.kv_width(ws.cfg))


def run_beam(ws: Workspace, candidates: np.ndarray, width: int) -> np.ndarray:
  """Beam search over all documents in memory-bounded chunks: predictions [B, T] int32."""
  search = lambda h, c: beam.search(ws.model_params, ws.cfg, ws.cut, h, c, width, scan=ws.scan,
                                    prefix=ws.known_prefix)[0]
  predictions = ws.map_documents(search, (ws.activations, candidates.astype(np.int32)),
                                 beam_bytes_per_doc(ws, width, candidates.shape[-1]))
  return predictions.astype(np.int32)


def _activation(ws: Workspace, budget, key) -> np.ndarray:
  return ws.activation_ranked(int(budget.candidates))


def _joint_from(gradients_of: Callable[[Workspace, object], np.ndarray], stage: str):
  def candidates_of(ws: Workspace, budget, key) -> np.ndarray:
    c_a, c_g = int(budget.c_a), int(budget.c_g)
    activation = ws.activation_ranked(c_a + c_g)
    gradient = ws.gradient_ranked(c_a + c_g, gradients_of(ws, budget), stage)
    return np.asarray(ws.call(cand_lib.joint_candidates, activation, gradient, c_a=c_a, c_g=c_g))
  return candidates_of


def _shuffled(ws: Workspace, budget) -> np.ndarray:
  return ws.gradients[cand_lib.derangement(ws.num_docs, int(budget.shuffle_seed))]


def _random(ws: Workspace, budget, key) -> np.ndarray:
  c_a, c_g = int(budget.c_a), int(budget.c_g)
  activation = ws.activation_ranked(c_a + c_g)
  vocab = ws.cfg.vocab_size
  return ws.map_call(cand_lib.random_fill_candidates, (activation, ws.doc_index),
                     memory.random_fill_bytes_per_doc(ws.seq_len, vocab), consts=(key,),
                     c_a=c_a, c_g=c_g, vocab_size=vocab)


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


def _flop_matched(ws: Workspace, budget, key) -> np.ndarray:
  return ws.activation_ranked(flop_matched_budget(ws, budget))


def _joint_budget_check(values: dict, vocab_size: int) -> None:
  if values["c_a"] + values["c_g"] > vocab_size:
    raise budget_lib.BudgetError(
        f"budget fields c_a + c_g = {values['c_a'] + values['c_g']} exceed the vocabulary "
        f"({vocab_size})")


_BUDGET = ("candidates", "beam_width", "ridge_alpha")
_JOINT_BUDGET = ("c_a", "c_g", "beam_width", "ridge_alpha")
_PROTOCOL_CAPABILITIES = ("exact tie-breaks (PROTOCOL section 4)", "chunking invariance",
                          "sharding over devices")
_BEAM_CHECKS = (
    ("reference_consistency", "tests/test_attacks_units.py::test_beam_search_equals_exhaustive_enumeration",
     "exhaustive enumeration of every token sequence (T = 3, C = 4, W = 16)"),
    ("reference_consistency",
     "tests/test_attacks_units.py::test_beam_search_width2_matches_python_with_ties",
     "a plain Python beam search of the pinned algorithm on a float64 numpy GPT-2, with ties"),
    ("synthetic", "tests/test_attacks_recovery.py::test_activation_only_recovery_on_one_block_client",
     "known tokens through a random 1-block client: >= 90% recovery"),
)

registry.register(BeamAttack(
    registry.AttackSpec(
        "activation", "beam_inversion", ("activations",), budget_fields=_BUDGET,
        description="ridge candidates + activation-matching beam search",
        capabilities=_PROTOCOL_CAPABILITIES, checks=_BEAM_CHECKS),
    _activation))

registry.register(BeamAttack(
    registry.AttackSpec(
        "activation_flop_matched", "beam_inversion", ("activations",),
        budget_fields=_JOINT_BUDGET, validate_budget=_joint_budget_check,
        description="activation-only with the candidates that spend the joint attack's FLOPs"),
    _flop_matched))

registry.register(BeamAttack(
    registry.AttackSpec(
        "joint", "beam_inversion", ("activations", "gradients"), budget_fields=_JOINT_BUDGET,
        validate_budget=_joint_budget_check,
        description="activation candidates + gradient-ranked candidates, beam search",
        capabilities=_PROTOCOL_CAPABILITIES,
        checks=_BEAM_CHECKS[:2] + (
            ("synthetic", "tests/test_attacks_recovery.py::test_joint_gain_and_controls_erase_it",
             "joint gain over activation-only on a 1-block client; both controls erase it"),)),
    _joint_from(lambda ws, budget: ws.gradients, "gradient_ranking")))

registry.register(BeamAttack(
    registry.AttackSpec(
        "shuffled_gradients", "beam_inversion", ("activations", "gradients"),
        budget_fields=_JOINT_BUDGET + ("shuffle_seed",), validate_budget=_joint_budget_check,
        role="negative_control",
        description="joint attack with gradients deranged across documents"),
    _joint_from(_shuffled, "shuffled_gradient_ranking")))

registry.register(BeamAttack(
    registry.AttackSpec(
        "random_candidates", "beam_inversion", ("activations",), budget_fields=_JOINT_BUDGET,
        validate_budget=_joint_budget_check, role="negative_control",
        description="joint attack with the gradient slots filled by random tokens"),
    _random))

for _plain in ("activation", "joint"):
  _attack = registry.get_unloaded(_plain)
  registry.register(BeamAttack(
      dataclasses.replace(
          _attack.spec, name=f"{_plain}_defense_aware", defense_aware=True,
          reference_attack=_plain, role="baseline",
          threat_model="knows the defense's mechanism and public parameters and refits its "
          "ridge decoder on calibration passed through its own draw of the mechanism; a "
          "baseline, not an adaptive attack on a secret (PROTOCOL section 5a)",
          description=_attack.spec.description
          + "; ridge fitted on defended calibration activations"),
      _attack.candidates_of))


def _ranking(cfg, seq_len, num, materialised):
  return memory.ranking_bytes_per_doc(seq_len, cfg.vocab_size, cfg.n_embd, num, materialised)


def _searched(cfg, cut, seq_len, budget, num):
  return memory.beam_bytes_per_doc(cfg.n_embd, cut, seq_len, int(budget["beam_width"]), num,
                                   cost.kv_width(cfg))


def _activation_stages(cfg, cut, num_docs, seq_len, budget, materialised):
  del num_docs
  c = int(budget["candidates"])
  return [("activation_candidates", _ranking(cfg, seq_len, c, materialised)),
          ("beam_search", _searched(cfg, cut, seq_len, budget, c))]


def _flop_matched_stages(cfg, cut, num_docs, seq_len, budget, materialised):
  shape = types.SimpleNamespace(cfg=cfg, cut=cut, num_docs=num_docs, seq_len=seq_len)
  c = flop_matched_budget(shape, types.SimpleNamespace(**budget))
  return [("activation_candidates", _ranking(cfg, seq_len, c, materialised)),
          ("beam_search", _searched(cfg, cut, seq_len, budget, c))]


def _joint_stages(cfg, cut, num_docs, seq_len, budget, materialised):
  del num_docs
  c = int(budget["c_a"]) + int(budget["c_g"])
  return [("activation_candidates", _ranking(cfg, seq_len, c, materialised)),
          ("gradient_ranking", _ranking(cfg, seq_len, c, materialised)),
          ("beam_search", _searched(cfg, cut, seq_len, budget, c))]


def _random_stages(cfg, cut, num_docs, seq_len, budget, materialised):
  del num_docs
  c = int(budget["c_a"]) + int(budget["c_g"])
  return [("activation_candidates", _ranking(cfg, seq_len, c, materialised)),
          ("random_fill", memory.random_fill_bytes_per_doc(seq_len, cfg.vocab_size)),
          ("beam_search", _searched(cfg, cut, seq_len, budget, c))]


memory.declare_stages("activation", _activation_stages)
memory.declare_stages("activation_flop_matched", _flop_matched_stages)
memory.declare_stages("joint", _joint_stages)
memory.declare_stages("shuffled_gradients", _joint_stages)
memory.declare_stages("random_candidates", _random_stages)


# Analytic FLOPs (lla.attacks.flops): the search (W*C one-token steps per position) plus the
# candidate stages it reads.


def _search_flops(s: flops.Shape, budget: dict, num: int) -> float:
  return beam.analytic_flops(s.cfg, s.cut, s.num_docs, int(budget["beam_width"]), num,
                             s.seq_len)


def _activation_flops(s, budget):
  return _search_flops(s, budget, int(budget["candidates"])) + flops.activation_ranking(s)


def _flop_matched_flops(s, budget):
  c = flop_matched_budget(s, types.SimpleNamespace(**budget))
  return _search_flops(s, budget, c) + flops.activation_ranking(s)


def _joint_flops(s, budget):
  c = int(budget["c_a"]) + int(budget["c_g"])
  return (_search_flops(s, budget, c) + flops.activation_ranking(s)
          + flops.gradient_ranking(s))


def _random_flops(s, budget):
  return _search_flops(s, budget, int(budget["c_a"]) + int(budget["c_g"])) \
      + flops.activation_ranking(s)


flops.declare_flops("activation", _activation_flops)
flops.declare_flops("activation_flop_matched", _flop_matched_flops)
flops.declare_flops("joint", _joint_flops)
flops.declare_flops("shuffled_gradients", _joint_flops)
flops.declare_flops("random_candidates", _random_flops)
