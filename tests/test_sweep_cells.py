"""Sweep cells (lla.sweep.cells): a shared base budget, each cell keeping its attacks' part."""

import pytest

from configs import sweep
from lla.attacks import budget as budget_lib
from lla.attacks import registry
from lla.sweep import cells


def config(base_changes: dict, grids):
  c = sweep.get_config("test")
  c.cell.budget.update(base_changes)
  c.grids = grids
  return c


def test_each_cell_keeps_the_base_budget_fields_its_attacks_read():
  grid = ((("attacks", (("ridge",), ("tag",))),),)
  shared = cells.expand(config({"tag_steps": 7, "tag_adam_eps": 1e-12, "ridge_alpha": 0.5}, grid))
  by_attack = {tuple(c.config["attacks"]): c for c in shared}
  assert by_attack[("ridge",)].config["budget"] == {"ridge_alpha": 0.5}
  # TAG reads its steps and Adam epsilon, and ridge_alpha through its position-0 ridge
  # decoder (PROTOCOL section 4b): every base field above is one of its own.
  assert by_attack[("tag",)].config["budget"] == {"tag_steps": 7, "tag_adam_eps": 1e-12,
                                                 "ridge_alpha": 0.5}
  # A field only other attacks read leaves a cell's identity as if it were at its default.
  alone = cells.expand(config({"ridge_alpha": 0.5}, ((("attacks", (("ridge",),)),),)))
  assert alone[0].cell_id == by_attack[("ridge",)].cell_id


def test_a_grid_axis_no_attack_of_the_cell_reads_is_refused():
  grid = ((("attacks", (("ridge",),)), ("budget.tag_steps", (3,))),)
  with pytest.raises(budget_lib.BudgetError, match="tag_steps"):
    cells.expand(config({}, grid))
