"""Analytic FLOP models: what an attack will be charged, from its knobs, before it runs.

Each attack module declares its model next to its memory stages:

    flops.declare_flops("tag", _tag_flops)

where `_tag_flops(shape, budget)` returns the analytic FLOPs the run's record will carry as
`flops_analytic` (lla.attacks.workspace.Workspace.charge): the attack's own work plus every
shared stage it uses, in full. `shape` is a `Shape` (the attacker's model config, the cut,
the captured documents, their length and the calibration documents), `budget` a dict of
every declared budget field (defaults filled in). The shared stages' formulas are here,
the same arithmetic as the Workspace's:

  calibration_activations   2 N T k (W + T A)          the client on N calibration documents
  ridge                     2 (2 N T d (2 d) + d^3 / 3 + 2 d^3)   the fit, counted twice as
                                                       the Workspace does (stage + host)
  activation_candidates     2 B T V d + 2 B T d^2      decode and distances to every row
  gradient_ranking          2 B T V d                  <-g, wte[v]> for every row

W is the weight-matrix entries of one block and A = H D the attention width, read from the
config (lla.model.cost: GPT-2 12 d^2 and d; a RoPE family q, k, v, o with GQA and a gated
or gelu MLP). Attacks' per-block costs use `cost.token_block_flops` (2 W + 4 T A a token
and block: GPT-2's 24 d^2 + 4 T d). The ridge decoder (d x d) and the vocabulary head
(V x d, tied or not) are the same for every family.

A sweep asks for a cost instead of a budget (lla.sweep.isoflop): it evaluates the model on
a ladder of knob values and places the attack at the value whose predicted cost lands
nearest each FLOP level. The record's XLA count stays what is compared; the analytic
model counts matrix products only, so XLA's count lies above it (their records hold both):
1.0-1.3x on a tiny GPT-2 and a tiny GQA Llama, the ridge fit's second count taken off
(tests/test_attacks_flops.py), less at realistic widths, where elementwise work is a
smaller share.

A model may be a lower bound (`lower_bound=True`): SipIt's search stops where a token
verifies, so its cost depends on the data; its model counts the work every run does.
The `_defense_aware` variants share the model of the attack they refit (their mechanism's
cost on the calibration documents is the defense's, not counted).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from lla.attacks import budget as budget_lib
from lla.attacks import candidates as cand_lib
from lla.attacks import registry
from lla.attacks import ridge
from lla.model import cost
from lla.model.decoder import DecoderConfig
from lla.model.gpt2 import GPT2Config


@dataclasses.dataclass(frozen=True)
class Shape:
  """What a run's cost depends on besides its budget. Its attributes are named as the
  Workspace's, so that formulas written against a workspace take it too."""

  cfg: GPT2Config | DecoderConfig
  cut: int
  num_docs: int
  seq_len: int
  n_calibration: int
  gradients: bool = True    # the capture holds g (attacks that use it where present)


@dataclasses.dataclass(frozen=True)
class FlopModel:
  flops: Callable[[Shape, dict], float]
  lower_bound: bool = False


_MODELS: dict[str, FlopModel] = {}


def declare_flops(name: str, model: Callable[[Shape, dict], float],
                  lower_bound: bool = False) -> None:
  """Declares attack `name`'s analytic FLOP model (its `_defense_aware` variant shares it)."""
  if name in _MODELS:
    raise ValueError(f"the FLOP model of attack {name!r} is declared twice")
  _MODELS[name] = FlopModel(model, lower_bound)


def model(name: str) -> FlopModel | None:
  """The declared model of attack `name`, or None (plugins and attacks that declare none)."""
  registry.load_builtin()
  return _MODELS.get(name.removesuffix("_defense_aware"))


def attack_flops(name: str, cfg: GPT2Config | DecoderConfig, cut: int, num_docs: int,
                 seq_len: int, budget: dict, n_calibration: int,
                 gradients: bool = True) -> float | None:
  """Predicted analytic FLOPs of running attack `name` with `budget` (missing fields at
  their defaults) on num_docs documents of seq_len tokens at cut `cut`, with
  n_calibration calibration documents (and the capture's g where `gradients`); None for an
  attack without a model."""
  declared = model(name)
  if declared is None:
    return None
  values = {**budget_lib.defaults(), **dict(budget)}
  return float(declared.flops(Shape(cfg, int(cut), int(num_docs), int(seq_len),
                                    int(n_calibration), bool(gradients)), values))


# --- shared stages (lla.attacks.workspace) --------------------------------------------------


def calibration_activations(s: Shape) -> float:
  """The client on the calibration documents: per position and block, 2 FLOPs for each
  weight-matrix entry, and T A for attention (half the 4 T A its scores and values
  compute: the causal half). GPT-2: 2 N T k (12 d^2 + T d)."""
  rows, width = s.n_calibration * s.seq_len, cost.attention_width(s.cfg)
  return 2.0 * rows * s.cut * (cost.block_weights(s.cfg) + s.seq_len * width)


def ridge_fit(s: Shape) -> float:
  """The `ridge` stage with the calibration activations it reads."""
  d, rows = s.cfg.n_embd, s.n_calibration * s.seq_len
  return 2.0 * ridge.ridge_flops(rows, d, d) + calibration_activations(s)


def activation_ranking(s: Shape) -> float:
  """The `activation_candidates` stage with the ridge fit it reads (the decode, 2 B T d^2,
  is the ridge's d x d map, not a block)."""
  positions = s.num_docs * s.seq_len
  return (cand_lib.candidate_flops(positions, s.cfg.vocab_size, s.cfg.n_embd)
          + 2.0 * positions * s.cfg.n_embd**2 + ridge_fit(s))


def gradient_ranking(s: Shape) -> float:
  return cand_lib.candidate_flops(s.num_docs * s.seq_len, s.cfg.vocab_size, s.cfg.n_embd)
