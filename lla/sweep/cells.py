"""Cells of a sweep: a grid over config fields, each cell frozen and named by its hash.

A sweep config holds a base cell (`config.cell`) and `config.grids`: a tuple of grids, each
a tuple of (path, values) axes whose product gives cells; the sweep is their union, in
order, without repeats. A path names a field of the cell ("cut", "seed",
"defense.strength", "budget.candidates", "attacks", "data.n_calibration"); budget paths
may name any declared budget field (plugins' included).

The base cell's budget is shared (e.g. a job's whole budget): each cell keeps the fields
its attacks read, and a grid axis on a field none of them reads is refused. A cell's
frozen config is canonical JSON in which the budget holds only the fields that
differ from their declared defaults, so that declaring a new field elsewhere leaves every
cell id unchanged. Cells that differ only in their attacks and in budget fields that no
shared stage reads (`STAGE_FREE_FIELDS`) form one group: one worker runs them in order on
one Workspace, so that the ridge fit, candidate rankings and trained inverters are
computed once (each attack is still charged every stage it used, in full).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json

import ml_collections

from lla import defenses
from lla.attacks import budget as budget_lib
from lla.attacks import registry
from lla.evidence import files

# Budget fields that only an attack's own work reads, never a shared stage: cells that
# differ in them can share a Workspace. Any other field (one declared later included)
# separates groups. A ranking stage asked for more candidates than it holds is recomputed;
# asked for fewer, it gives a prefix of the same stable order.
STAGE_FREE_FIELDS = frozenset({
    "candidates", "beam_width", "c_a", "c_g", "shuffle_seed", "bisr_f_steps", "eia_steps",
    "tag_steps", "lamp_steps", "bisr_b_steps",
})
ID_CHARS = 16  # hex digits of a cell id (64 bits)


class SweepConfigError(ValueError):
  """A sweep config that cannot run; the message names the field."""


@dataclasses.dataclass(frozen=True)
class Cell:
  """One frozen cell: `config` (a JSON-ready dict), `cell_id`, and the `group` of cells
  that share its Workspace."""

  cell_id: str
  config: dict
  group: str

  @property
  def attacks(self) -> tuple[str, ...]:
    return tuple(self.config["attacks"])


def canonical(config: dict) -> bytes:
  return files.canonical_json(config)


def cell_id(config: dict) -> str:
  return hashlib.sha256(canonical(config)).hexdigest()[:ID_CHARS]


def group_key(config: dict) -> str:
  shared = copy.deepcopy(config)
  shared.pop("attacks")
  shared["budget"] = {k: v for k, v in shared["budget"].items() if k not in STAGE_FREE_FIELDS}
  return hashlib.sha256(canonical(shared)).hexdigest()[:ID_CHARS]


def assign(config: dict, path: str, value) -> None:
  """Sets field `path` (e.g. "budget.candidates") of a cell config dict, checked."""
  *parents, leaf = path.split(".")
  node = config
  for i, name in enumerate(parents):
    if not isinstance(node, dict) or name not in node:
      raise SweepConfigError(f"grid axis {path!r}: the cell has no field "
                             f"{'.'.join(parents[:i + 1])!r}")
    node = node[name]
  if parents == ["budget"]:
    budget_lib.get(leaf)  # BudgetError naming the field and listing the declared ones.
  elif leaf not in node:
    raise SweepConfigError(f"grid axis {path!r}: the cell has no field {path!r}")
  node[leaf] = list(value) if isinstance(value, tuple) else value


def freeze(config: dict) -> dict:
  """The canonical cell config: budget without fields at their defaults, tuples as lists."""
  frozen = json.loads(json.dumps(config))
  defaults = budget_lib.defaults()
  for name, value in list(frozen["budget"].items()):
    field = budget_lib.get(name)
    value = float(value) if field.kind is float else value
    if name in defaults and value == defaults[name]:
      del frozen["budget"][name]
    else:
      frozen["budget"][name] = value
  # No fixed parameters: the id a cell had before the defense could hold any.
  if not frozen["defense"].get("fixed"):
    frozen["defense"].pop("fixed", None)
  # "a,b" (a command-line override) or ("a", "b"): one list of names.
  attacks = [frozen["attacks"]] if isinstance(frozen["attacks"], str) else frozen["attacks"]
  frozen["attacks"] = [a.strip() for item in attacks for a in item.split(",") if a.strip()]
  return frozen


def expand(config: ml_collections.ConfigDict) -> list[Cell]:
  """Every cell of the sweep, in grid order, each once.

  Raises:
    SweepConfigError / budget.BudgetError / KeyError (unknown attack): naming the field,
    before anything runs.
  """
  registry.load_plugins(config.cell.plugins)
  base = config.cell.to_dict()
  grids = config.grids or ((),)
  cells, seen = [], set()
  for grid in grids:
    for axis in grid:
      if len(axis) != 2 or not isinstance(axis[0], str) or not isinstance(axis[1], (tuple, list)):
        raise SweepConfigError(f"grid axis {axis!r}: expected (path, (values, ...))")
      if not axis[1]:
        raise SweepConfigError(f"grid axis {axis[0]!r} has no values")
    gridded = {path.split(".", 1)[1] for path, _ in grid if path.startswith("budget.")}
    for values in itertools.product(*(axis[1] for axis in grid)):
      config_dict = copy.deepcopy(base)
      for (path, _), value in zip(grid, values):
        assign(config_dict, path, value)
      # The base budget is shared by every cell (e.g. a job's whole budget): each cell keeps
      # the fields its attacks read. A grid axis is never dropped, so `check` refuses one
      # that none of the cell's attacks reads.
      read = set(registry.relevant_budget(config_dict["budget"], freeze(config_dict)["attacks"]))
      config_dict["budget"] = {k: v for k, v in config_dict["budget"].items()
                               if k in read or k in gridded}
      frozen = freeze(config_dict)
      check(frozen)
      identity = cell_id(frozen)
      if identity not in seen:
        seen.add(identity)
        cells.append(Cell(identity, frozen, group_key(frozen)))
  return cells


def check(frozen: dict) -> None:
  """What can be checked without loading a model: the attacks exist, the budget fields
  exist and are in range and are read by one of the cell's attacks."""
  if not frozen["attacks"]:
    raise SweepConfigError("a cell has no attacks")
  if frozen["knowledge"] not in ("public", "trained"):
    raise SweepConfigError(f"knowledge {frozen['knowledge']!r}: expected public or trained")
  specs = [registry.get(name).spec for name in frozen["attacks"]]
  budget_lib.validate(frozen["budget"], specs, vocab_size=10**9)
  if frozen["defense"]["name"] != "none":
    try:
      defense_of(frozen["defense"])
    except defenses.DefenseError as e:
      raise SweepConfigError(f"cell defense: {e}") from None


def defense_of(d: dict) -> defenses.Defense:
  """A cell's defense (its config's `defense`, not "none"): `param` at `strength`, plus
  `fixed`."""
  fixed = dict((name, value) for name, value in d.get("fixed", ()))
  return defenses.make(d["name"], **({d["param"]: d["strength"]} if d["param"] else {}),
                       **fixed)


def defense_label(d: dict) -> str:
  """A defended cell's label (its config's `defense`): `name_paramvalue`, then
  `_paramvalue` for each fixed parameter, as lla.study.defense_sweep.Configuration's."""
  return f"{d['name']}_{d['param']}{d['strength']}" + "".join(
      f"_{name}{value}" for name, value in d.get("fixed", ()))


def groups(cells: list[Cell]) -> list[list[Cell]]:
  """Cells grouped by shared Workspace, groups in order of their first cell."""
  out: dict[str, list[Cell]] = {}
  for cell in cells:
    out.setdefault(cell.group, []).append(cell)
  return list(out.values())
