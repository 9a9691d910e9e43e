"""Iso-FLOP sweeps: ask for a cost instead of a budget.

A sweep config may name FLOP levels and, per attack, a ladder of knob values:

  config.frontier.levels     FLOPs per evaluation document (a cell on B documents aims at
                             level * B); empty: every rung of every ladder runs (a grid).
  config.frontier.tolerance  a run counts at a level when its FLOPs lie within this factor
                             of it (both ways); placement keeps to the same bound.
  config.frontier.knobs      ((attack, ((path, ladder), ...)), ...): the config paths that
                             buy the attack more work, each with a ladder of values; the
                             paths of one attack move together (rung i takes value i of
                             each), so a ladder may trade two knobs (e.g. fewer calibration
                             documents at the cheap end, then more epochs).
  config.frontier.ladders    "target": an attack's empty knobs are generated from the
                             target's costs, and empty levels derived from its attacks'
                             floors (lla.sweep.ladders); "table" (or absent): as given.

`resolve(config)` evaluates each attack's analytic FLOP model (lla.attacks.flops) at every
rung on the base cell's shapes (target model, cut, documents, calibration documents; a
rung may change them) and, for every level, places the attack at the rung whose predicted
cost lies nearest the level on a log scale, if within the tolerance (`place`). The placed
rungs become grids of one-attack cells, added before `config.grids`. An attack without a
model runs every rung. The record's XLA count is what the report compares (lla.sweep.frontier
counts a run at a level by its measured FLOPs, with the same tolerance); the analytic
models lie within ~10% of it for the built-in attacks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import ml_collections

from lla.attacks import flops as flops_lib
from lla.sweep import cells as cells_lib
from lla.sweep.cell_shape import TOLERANCE, rung_cell, shape_of

_SLACK = 1e-9    # relative: a cost exactly at the bound counts


def log_distance(flops: float, level: float) -> float:
  return abs(math.log(flops / level))


def within(flops: float, level: float, tolerance: float) -> bool:
  """Whether `flops` lies within a factor `tolerance` of `level` (both ways)."""
  return log_distance(flops, level) <= math.log(tolerance) + _SLACK


def place(costs: Sequence[float | None], levels: Sequence[float],
          tolerance: float) -> list[int | None]:
  """For each level, the index of the cost nearest it on a log scale (ties: the cheaper,
  then the earlier), or None when no cost lies within a factor `tolerance` of it. Costs
  that are None (no prediction) are never placed."""
  if tolerance < 1:
    raise ValueError(f"tolerance must be >= 1, got {tolerance}")
  out = []
  for level in levels:
    if not level > 0:
      raise ValueError(f"FLOP levels must be positive, got {level}")
    ranked = sorted((log_distance(c, level), c, i) for i, c in enumerate(costs)
                    if c is not None and c > 0)
    best = ranked[0] if ranked else None
    out.append(best[2] if best is not None and within(best[1], level, tolerance) else None)
  return out


@dataclasses.dataclass(frozen=True)
class Placement:
  """One attack at one level: the rung chosen (None: no rung within the tolerance; then
  `predicted` is the nearest rung's cost), its knob values and predicted FLOPs."""

  attack: str
  level: float
  rung: int | None
  knobs: dict
  predicted: float | None

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def predicted(base: dict, attack: str, knobs: Sequence[tuple[str, Sequence]]) -> list:
  """The attack's predicted analytic FLOPs at every rung (None without a model)."""
  rungs = _rungs(attack, knobs)
  if flops_lib.model(attack) is None:
    return [None] * rungs
  out = []
  for rung in range(rungs):
    cell = rung_cell(base, knobs, rung)
    out.append(flops_lib.attack_flops(attack, budget=cell["budget"], **shape_of(cell)))
  return out


def _rungs(attack: str, knobs) -> int:
  sizes = {len(ladder) for _, ladder in knobs}
  if not sizes:
    return 1  # a fixed-cost attack: one rung
  if len(sizes) != 1:
    raise cells_lib.SweepConfigError(f"frontier knobs of {attack!r}: ladders of different "
                                     f"lengths {sorted(sizes)} (the paths move together)")
  return sizes.pop()


def _frontier(config: ml_collections.ConfigDict) -> dict:
  """The config's frontier dict; with `ladders` "target", its empty knobs and levels filled
  from the target's costs (lla.sweep.ladders)."""
  frontier = (config.get("frontier") or ml_collections.ConfigDict()).to_dict()
  if frontier.get("ladders") == "target":
    from lla.sweep import ladders  # pylint: disable=g-import-not-at-top  (it imports isoflop)
    frontier = ladders.from_target(config.cell.to_dict(), frontier)
  return frontier


def absolute_levels(config: ml_collections.ConfigDict) -> tuple[float, ...]:
  """The sweep's levels in FLOPs per cell (per-document levels times the documents)."""
  levels = tuple(float(x) for x in _frontier(config).get("levels") or ())
  if not levels:
    return ()
  num_docs = shape_of(config.cell.to_dict())["num_docs"]
  return tuple(level * num_docs for level in levels)


def tolerance_of(config: ml_collections.ConfigDict) -> float:
  return float(_frontier(config).get("tolerance") or TOLERANCE)


def placements(config: ml_collections.ConfigDict) -> list[Placement]:
  """Every (attack, level) of the sweep's knobs, placed (see the module doc); an attack
  without a FLOP model gets one Placement per rung with level 0."""
  base = config.cell.to_dict()
  levels, tolerance = absolute_levels(config), tolerance_of(config)
  out = []
  for attack, knobs in _frontier(config).get("knobs") or ():
    costs = predicted(base, attack, knobs)
    values = lambda rung: {path: ladder[rung] for path, ladder in knobs}
    if all(c is None for c in costs) or not levels:
      out += [Placement(attack, 0.0, rung, values(rung), None) for rung in range(len(costs))]
      continue
    for level, rung in zip(levels, place(costs, levels, tolerance)):
      if rung is None:
        nearest = min((c for c in costs if c), key=lambda c: log_distance(c, level))
        out.append(Placement(attack, level, None, {}, nearest))
      else:
        out.append(Placement(attack, level, rung, values(rung), costs[rung]))
  return out


def resolve(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A copy of `config` whose grids hold the placed cells (then `config.grids`)."""
  chosen = []
  for p in placements(config):
    if p.rung is None:
      continue
    grid = (("attacks", ((p.attack,),)),) + tuple((path, (value,))
                                                  for path, value in p.knobs.items())
    if grid not in chosen:
      chosen.append(grid)
  out = ml_collections.ConfigDict(config.to_dict())
  out.grids = tuple(chosen) + tuple(config.grids or ())
  return out


def describe(config: ml_collections.ConfigDict) -> str:
  """The placement as text: per attack and level, the rung and its predicted FLOPs."""
  lines = [f"iso-FLOP placement (tolerance x{tolerance_of(config):g}):"]
  for p in placements(config):
    where = f"level {p.level:.3g}" if p.level else "every rung (no FLOP model)"
    if p.rung is None:
      lines.append(f"  {p.attack:14s}{where}: none within the tolerance (nearest rung "
                   f"{p.predicted:.3g})")
    else:
      knobs = ", ".join(f"{k}={v}" for k, v in p.knobs.items())
      cost = "" if p.predicted is None else f" -> {p.predicted:.3g}"
      lines.append(f"  {p.attack:14s}{where}: {knobs}{cost}")
  return "\n".join(lines)
