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


def test_a_cell_defense_takes_fixed_parameters_and_an_empty_set_keeps_the_old_id():
  c = config({}, ((("defense.name", ("dp_forward",)), ("defense.param", ("epsilon",)),
                   ("defense.strength", (8.0,)),
                   ("defense.fixed", ((("delta", 1e-5), ("clip_norm", 6.0)),))),))
  [cell] = cells.expand(c)
  defense = cells.defense_of(cell.config["defense"])
  assert (defense.epsilon, defense.delta, defense.clip_norm) == (8.0, 1e-5, 6.0)
  assert (cells.defense_label(cell.config["defense"])
          == "dp_forward_epsilon8.0_delta1e-05_clip_norm6.0")
  # Without fixed parameters the frozen cell holds no `fixed` key: its id is the one the
  # same cell had before cells could hold them (hashed here from the config without it).
  plain = config({}, ((("defense.name", ("gaussian",)), ("defense.param", ("sigma",)),
                       ("defense.strength", (0.3,))),))
  [cell] = cells.expand(plain)
  assert "fixed" not in cell.config["defense"]
  without = plain.cell.to_dict()
  del without["defense"]["fixed"]
  without["defense"].update(name="gaussian", param="sigma", strength=0.3)
  without["budget"] = {k: v for k, v in without["budget"].items()
                       if k in registry.relevant_budget(without["budget"], cell.config["attacks"])}
  assert cells.cell_id(cells.freeze(without)) == cell.cell_id
  assert cells.defense_label(cell.config["defense"]) == "gaussian_sigma0.3"


def test_a_fixed_parameter_the_defense_does_not_declare_is_refused_before_anything_runs():
  c = config({}, ((("defense.name", ("gaussian",)), ("defense.param", ("sigma",)),
                   ("defense.strength", (0.3,)), ("defense.fixed", ((("top_k", 5),),))),))
  with pytest.raises(cells.SweepConfigError, match="top_k"):
    cells.expand(c)


def test_the_defenses_variant_runs_each_defense_with_the_attack_that_adapts_to_it():
  registry.load_builtin()
  expanded = cells.expand(sweep.get_config("defenses_cpu"))
  defended = [c for c in expanded if c.config["defense"]["name"] != "none"]
  assert len(expanded) == 7 and len(defended) == 6
  for cell in defended:
    defense = cells.defense_of(cell.config["defense"])
    adaptive = [a for a in cell.config["attacks"]
                if defense.name in registry.get(a).spec.adapts_to]
    assert len(adaptive) == 1 and "activation" in cell.config["attacks"], cell.config
  assert sorted({(c.config["defense"]["name"], c.config["defense"]["strength"])
                 for c in defended}) == [("custext", 5.0), ("custext", 20.0),
                                         ("santext", 5.0), ("santext", 10.0),
                                         ("snd", 40.0), ("snd", 400.0)]
