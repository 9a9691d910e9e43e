"""Knob ladders placed from the target: each attack's ladder and the FLOP levels, generated
from the analytic FLOP models (lla.attacks.flops) on the sweep's own target.

A fixed table of ladders (configs/sweep.py FRONTIER_KNOBS) is tuned to one target: on a
smaller one the dear attacks' cheapest rungs lie above the cheap attacks' only runs, and a
ladder of calibration documents runs past the documents given. Here each attack declares
which knobs buy it more work, in order (`knobs()`), each from a floor value (the least that
still runs the attack's own algorithm once) to a cap:

  - the floor rung sets every knob to its floor: the attack's cheapest meaningful run, whose
    predicted cost is its floor (`FLOOR_WHY` says what limits it);
  - the ladder then raises the knobs in turn, one step each along 1, 2, 3, 4, 6, 8, 12, ...
    (values about sqrt(2) apart, as configs/sweep._series), so that every knob grows by the
    same factor and each rung costs at most about sqrt(2) times the last: every level in the
    attack's range has a rung within a factor 1.5 of it;
  - a cap is the calibration documents given (`GIVEN`: the cell's n_calibration; a cell
    whose calibration documents come from a .npy uses all its rows, so there they are no
    knob), the vocabulary (`VOCAB`), a number (the published setting of a secondary knob),
    or none: the attack's own iterations rise until the predicted cost passes the largest
    level x the tolerance. The ladder's last rung is the attack's ceiling, limited by its
    caps or by the largest level.

Levels, when the config gives none: per evaluation document, a factor 2 apart from the
cheapest attack's floor up to the first at or above the dearest attack's floor, and one
more, so that every attack's cheapest run lies within the largest level's budget (every
pair is compared within a budget) and the dearest has two rungs.

`from_target(cell, frontier)` fills a sweep's `frontier` dict (knobs, levels) when its
`ladders` is "target" (lla.sweep.isoflop reads it there); `describe` says per attack its
floor, ceiling and what limits each.
"""

from __future__ import annotations

import dataclasses
import math
import types

from lla.attacks import budget as budget_lib
from lla.attacks import flops as flops_lib
from lla.attacks import registry
from lla.attacks.published import sip
from lla.sweep import cell_shape

GIVEN, VOCAB = "given", "vocab"
N_CAL = "data.n_calibration"
LEVEL_FACTOR = 2.0  # per-document levels a factor 2 apart, as FRONTIER_LEVELS


@dataclasses.dataclass(frozen=True)
class Knob:
  """Config paths that move together (one value), from `floor` to `cap` (int, GIVEN, VOCAB
  or None: until the largest level). `floor` None: the least calibration documents the
  attack runs on (`min_calibration`)."""

  paths: tuple[str, ...]
  floor: int | None
  cap: int | str | None


def _k(path: str | tuple[str, ...], floor: int | None, cap) -> Knob:
  return Knob((path,) if isinstance(path, str) else tuple(path), floor, cap)


def _default(field: str) -> int:
  return int(budget_lib.get(field).default)


# Per attack, the knobs its ladder raises in turn: the calibration documents of its shared
# stages (up to those given), secondary knobs (up to their published setting) and the
# attack's own iterations (unbounded). Steps and epochs start at 1 (0 would skip the
# attack's own work); candidates at 1.
def knobs() -> dict[str, tuple[Knob, ...]]:
  """Per attack, the knobs its ladder raises."""
  registry.load_builtin()  # the budget fields the caps read
  sip_stage = (_k(N_CAL, None, GIVEN), _k("budget.sip_epochs", 1, _default("sip_epochs")))
  return {
      "ridge": (_k(N_CAL, None, GIVEN),),
      "activation": (_k(N_CAL, None, GIVEN), _k("budget.candidates", 1, VOCAB)),
      "joint": (_k(N_CAL, None, GIVEN), _k(("budget.c_a", "budget.c_g"), 1, VOCAB)),
      "gradient_only": (),
      "sipit": (_k(N_CAL, None, GIVEN),),
      "sip": (_k(N_CAL, None, GIVEN), _k("budget.sip_epochs", 1, None)),
      "bisr_f": sip_stage + (_k("budget.bisr_f_steps", 1, None),),
      "bisr_b": sip_stage + (_k("budget.bisr_b_steps", 1, None),),
      "eia": (_k(N_CAL, None, GIVEN),
              _k("budget.eia_mapper_epochs", 1, _default("eia_mapper_epochs")),
              _k("budget.eia_steps", 1, None)),
      "tag": (_k(N_CAL, None, GIVEN), _k("budget.candidates", 1, _default("candidates")),
              _k("budget.tag_steps", 1, None)),
      "lamp": (_k(N_CAL, None, GIVEN), _k("budget.candidates", 1, _default("candidates")),
               _k("budget.lamp_candidates", 2, _default("lamp_candidates")),
               _k("budget.lamp_steps", 1, None)),
  }


FLOOR_WHY = {
    "ridge": "one vocabulary ranking of every captured position and the ridge fit on the "
             "fewest calibration documents that give d rows",
    "activation": "the ridge ranking and a beam search with one candidate per position",
    "joint": "the ridge and gradient rankings and a beam search with one candidate of each",
    "gradient_only": "one gradient ranking of every captured position: no knob",
    "sipit": "the ridge ranking and one proposal batch per position (a lower bound: it "
             "stops where a token verifies, so its record depends on the data)",
    "sip": "one epoch of SIP on the fewest calibration documents that leave one held out",
    "bisr_f": "SIP at its floor and one forward-matching step",
    "bisr_b": "SIP at its floor and one gradient-matching step",
    "eia": "one mapper epoch on the fewest calibration documents and one inversion step",
    "tag": "position 0 from one ridge candidate and one gradient-matching step",
    "lamp": "position 0 from one ridge candidate, one gradient-matching step and one "
            "phase of 2 permutation candidates",
}


def min_calibration(attack: str, shape: dict, budget: dict | None = None) -> int:
  """The fewest calibration documents an attack runs on: the ridge's d x d system needs
  d rows (ceil(d / T) documents); SIP also holds one document out (the budget's
  sip_holdout, default where not given)."""
  rows = max(1, math.ceil(shape["cfg"].n_embd / shape["seq_len"]))
  if attack in ("sip", "bisr_f", "bisr_b"):
    values = {**budget_lib.defaults(), **(budget or {})}
    settings = sip.Settings.from_budget(types.SimpleNamespace(**values), "gru")
    while sip.split_sizes(settings, rows)[1] < 1:
      rows += 1
  return rows


def _series_above(low: int, high: float) -> list[int]:
  values = sorted({v for k in range(48) for v in (1 << k, 3 << k)})
  return [v for v in values if low < v <= high]


def _cap(knob: Knob, shape: dict, given: int) -> float:
  if knob.cap == GIVEN:
    return given
  if knob.cap == VOCAB:
    # The joint attack's two knobs share the vocabulary (c_a + c_g <= V).
    return shape["cfg"].vocab_size // len(knob.paths)
  return math.inf if knob.cap is None else knob.cap


@dataclasses.dataclass(frozen=True)
class Ladder:
  """One attack's generated ladder: rungs (dicts path -> value), their predicted FLOPs per
  cell, and what limits its ceiling."""

  attack: str
  rungs: tuple[dict, ...]
  predicted: tuple[float, ...]
  ceiling_why: str

  @property
  def floor(self) -> float:
    return self.predicted[0]

  @property
  def ceiling(self) -> float:
    return self.predicted[-1]

  def knobs(self) -> tuple:
    """The ladder as config.frontier.knobs holds it: ((path, values), ...)."""
    paths = list(self.rungs[0]) if self.rungs else []
    return tuple((path, tuple(rung[path] for rung in self.rungs)) for path in paths)


def _cost(base: dict, attack: str, rung: dict) -> float:
  cell = cell_shape.rung_cell(base, tuple((path, (value,)) for path, value in rung.items()), 0)
  return flops_lib.attack_flops(attack, budget=cell["budget"], **cell_shape.shape_of(cell))


def ladder(base: dict, attack: str, top: float) -> Ladder:
  """`attack`'s ladder on the cell config `base`: from its floor rung, the knobs raised in
  turn one series step each (every knob grows by the same factor), its last rung the first
  whose predicted cost passes `top` (FLOPs per cell), or where every knob reached its cap."""
  shape = cell_shape.shape_of(base)
  given = shape["n_calibration"]
  # Calibration documents from a .npy are all used (lla.sweep.worker): no knob there.
  own = tuple(k for k in knobs()[attack]
              if not (base["data"].get("calibration_npy") and N_CAL in k.paths))
  rung = {}
  for knob in own:
    floor = (min(min_calibration(attack, shape, base["budget"]), given) if knob.floor is None
             else knob.floor)
    rung.update({path: floor for path in knob.paths})
  rungs, costs = [dict(rung)], [_cost(base, attack, rung)]
  rising = list(own)
  while rising and costs[-1] <= top:
    for knob in list(rising):
      higher = _series_above(rung[knob.paths[0]], _cap(knob, shape, given))
      if not higher:
        rising.remove(knob)
        continue
      rung.update({path: higher[0] for path in knob.paths})
      rungs.append(dict(rung))
      costs.append(_cost(base, attack, rung))
      if costs[-1] > top:
        break
  if not own:
    why = "no knob: one run"
  elif costs[-1] > top:
    why = "the largest level"
  else:
    why = "; ".join(_cap_text(knob, shape, given) for knob in own)
  return Ladder(attack, tuple(rungs), tuple(costs), why)


def _cap_text(knob: Knob, shape: dict, given: int) -> str:
  cap = _cap(knob, shape, given)
  what = {GIVEN: f"the {given} calibration documents given",
          VOCAB: f"the vocabulary ({int(cap)})"}.get(knob.cap, f"{cap:g}, the default")
  return f"{', '.join(knob.paths)} at {what}"


def derived_levels(floors: dict[str, float], num_docs: int) -> tuple[float, ...]:
  """Per-document levels a factor LEVEL_FACTOR apart from the cheapest floor up to the
  first at or above the dearest floor, and one more."""
  low, high = min(floors.values()) / num_docs, max(floors.values()) / num_docs
  levels = [low]
  while levels[-1] < high * (1 - 1e-12):
    levels.append(levels[-1] * LEVEL_FACTOR)
  return tuple(levels + [levels[-1] * LEVEL_FACTOR])


def generate(cell: dict, frontier: dict) -> tuple[dict[str, Ladder], tuple[float, ...]]:
  """The ladders of the frontier's attacks that have knobs here (their entries in
  frontier["knobs"] left empty) and the per-document levels (frontier["levels"], or derived
  from the floors of those and of the attacks that run once, frontier["fixed"])."""
  shape = cell_shape.shape_of(cell)
  tolerance = float(frontier.get("tolerance") or cell_shape.TOLERANCE)
  names = [name for name, given in frontier.get("knobs") or () if not given
           and name in knobs()]
  levels = tuple(float(x) for x in frontier.get("levels") or ())
  if not levels:
    floors = {name: ladder(cell, name, 0.0).floor for name in names}
    floors.update({name: flops_lib.attack_flops(name, budget=cell["budget"], **shape)
                   for name in frontier.get("fixed") or () if flops_lib.model(name)})
    levels = derived_levels(floors, shape["num_docs"]) if floors else ()
  top = max(levels, default=0.0) * shape["num_docs"] * tolerance
  return {name: ladder(cell, name, top) for name in names}, levels


def from_target(cell: dict, frontier: dict) -> dict:
  """The frontier dict with its empty knobs filled by the target's ladders and its levels
  derived where none are given."""
  ladders, levels = generate(cell, frontier)
  placed = tuple((name, ladders[name].knobs() if name in ladders else tuple(given))
                 for name, given in frontier.get("knobs") or ())
  return dict(frontier, knobs=placed, levels=levels)


def describe(cell: dict, frontier: dict) -> str:
  """Per attack: its floor and ceiling (predicted FLOPs per cell) and what limits each."""
  ladders, levels = generate(cell, frontier)
  docs = cell_shape.shape_of(cell)["num_docs"]
  lines = [f"ladders from the target: levels {', '.join(f'{x * docs:.3g}' for x in levels)} "
           "FLOPs per cell"]
  for name, lad in ladders.items():
    lines.append(f"  {name:14s}floor {lad.floor:.3g} ({FLOOR_WHY[name]}); ceiling "
                 f"{lad.ceiling:.3g} ({lad.ceiling_why}); {len(lad.rungs)} rungs")
  return "\n".join(lines)
