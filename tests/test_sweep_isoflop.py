"""lla.sweep.isoflop: placing attacks at FLOP levels, against placements worked out by hand.

`place` on a constructed cost function (10 + 5 k FLOPs at knob k) with the nearest rung
and the tolerance computed here; `resolve` on the test sweep with a constructed FLOP model
(monkeypatched into lla.attacks.flops): the cells it adds, the per-document levels scaled
by the cell's documents, a two-knob ladder moving together, an attack without a model
running every rung; the frontier configs' ladders reaching every family's levels.
"""

import math
import types

import pytest

from configs import main_table, sweep
from lla.attacks import flops, registry
from lla.sweep import cells, isoflop, ladders


def cost(k: float) -> float:
  return 10.0 + 5.0 * k


def test_place_picks_the_nearest_rung_within_the_tolerance():
  ladder = (1, 2, 4, 8, 16)
  costs = [cost(k) for k in ladder]            # 15, 20, 30, 50, 90
  levels = (12.0, 25.0, 60.0, 200.0, 5.0)
  # 12: 15 is x1.25 away -> rung 0. 25: 20 is x1.25, 30 is x1.2 -> rung 2. 60: 50 is
  # x1.2, 90 x1.5 -> rung 3. 200: 90 is x2.2 -> none. 5: 15 is x3 -> none.
  assert isoflop.place(costs, levels, 1.5) == [0, 2, 3, None, None]
  # A wider tolerance reaches 200 (x2.22 from 90) but not 5 (x3 from 15).
  assert isoflop.place(costs, levels, 2.5) == [0, 2, 3, 4, None]


def test_place_ties_and_bounds():
  # 10 and 40 are both x2 from 20: outside x1.5, inside x2 where the cheaper wins.
  assert isoflop.place([40.0, 10.0], [20.0], 1.5) == [None]
  assert isoflop.place([40.0, 10.0], [20.0], 2.0) == [1]
  # Exactly at the bound counts, both ways; a rung without a prediction is never placed.
  assert isoflop.place([15.0], [10.0], 1.5) == [0]
  assert isoflop.place([10.0], [15.0], 1.5) == [0]
  assert isoflop.place([None, 15.1], [10.0], 1.5) == [None]
  assert isoflop.within(14.999, 10.0, 1.5) and not isoflop.within(15.01, 10.0, 1.5)
  with pytest.raises(ValueError):
    isoflop.place([1.0], [1.0], 0.5)


@pytest.fixture
def linear_model(monkeypatch):
  """activation costs 1000 * (10 + 5 C) per document plus 100 per calibration document."""
  registry.load_builtin()  # the built-in model is declared, then replaced for the test
  model = lambda s, budget: (1000.0 * cost(budget["candidates"]) * s.num_docs
                             + 100.0 * s.n_calibration)
  monkeypatch.setitem(flops._MODELS, "activation", flops.FlopModel(model))
  return model


def config(knobs, levels, tolerance=1.5):
  c = sweep.get_config("test")
  c.cell.data.n_eval = 4
  c.cell.data.n_calibration = 10
  c.grids = ((("attacks", (("gradient_only",),)),),)
  c.frontier.knobs = knobs
  c.frontier.levels = levels
  c.frontier.tolerance = tolerance
  return c


def test_resolve_adds_the_placed_cells_before_the_grids(linear_model):
  knobs = (("activation", (("budget.candidates", (1, 2, 4, 8, 16)),)),)
  # Per document 12k, 25k, 60k, 200k; 4 documents: 48k, 100k, 240k, 800k per cell.
  c = config(knobs, (12e3, 25e3, 60e3, 200e3))
  assert isoflop.absolute_levels(c) == (48e3, 100e3, 240e3, 800e3)
  # By hand, 4 documents x 1000 x (10 + 5 C) + 10 calibration documents x 100:
  # C = 1, 2, 4, 8, 16 cost 61k, 81k, 121k, 201k, 361k. 48k: 61k (x1.27). 100k: 81k is
  # x1.235 away, 121k x1.21 -> C = 4. 240k: 201k (x1.19). 800k: 361k is x2.2: none.
  placed = isoflop.placements(c)
  assert [(p.level, p.rung, p.predicted) for p in placed] == [
      (48e3, 0, 61e3), (100e3, 2, 121e3), (240e3, 3, 201e3), (800e3, None, 361e3)]
  assert [p.knobs for p in placed] == [{"budget.candidates": 1}, {"budget.candidates": 4},
                                       {"budget.candidates": 8}, {}]
  # A fifth level, 80k per cell: 81k (C = 2); placements in level order, then the grids.
  resolved = isoflop.resolve(config(knobs, (12e3, 25e3, 60e3, 200e3, 20e3)))
  assert resolved.grids == (
      (("attacks", (("activation",),)), ("budget.candidates", (1,))),
      (("attacks", (("activation",),)), ("budget.candidates", (4,))),
      (("attacks", (("activation",),)), ("budget.candidates", (8,))),
      (("attacks", (("activation",),)), ("budget.candidates", (2,))),
      (("attacks", (("gradient_only",),)),))
  expanded = cells.expand(resolved)
  assert [(cl.attacks, cl.config["budget"].get("candidates")) for cl in expanded] == [
      (("activation",), 1), (("activation",), 4), (("activation",), 8), (("activation",), 2),
      (("gradient_only",), None)]
  assert "none within the tolerance (nearest rung 3.61e+05)" in isoflop.describe(c)
  # Two levels placing the same rung give one cell.
  assert len(isoflop.resolve(config(knobs, (12e3, 12.5e3))).grids) == 2
  # No levels: every rung, then the grids.
  assert [cl.config["budget"].get("candidates")
          for cl in cells.expand(isoflop.resolve(config(knobs, ())))] == [1, 2, 4, 8, 16, None]
  assert cells.expand(isoflop.resolve(config((), (1e3,)))) == cells.expand(config((), ()))


def test_knobs_of_one_attack_move_together(linear_model):
  # Rung i: (n_calibration, candidates) = (10, 1), (1000, 1), (10, 4): 61k, 160k, 121k.
  knobs = (("activation", (("data.n_calibration", (10, 1000, 10)),
                           ("budget.candidates", (1, 1, 4)))),)
  placed = isoflop.placements(config(knobs, (40e3,)))  # 160k per cell
  assert [(p.rung, p.knobs, p.predicted) for p in placed] == [
      (1, {"data.n_calibration": 1000, "budget.candidates": 1}, 4000 * cost(1) + 100e3)]
  with pytest.raises(cells.SweepConfigError, match="different lengths"):
    isoflop.placements(config((("activation", (("data.n_calibration", (10, 20)),
                                               ("budget.candidates", (1,)))),), (1e3,)))


def test_an_attack_without_a_model_runs_every_rung(monkeypatch):
  registry.load_builtin()
  monkeypatch.delitem(flops._MODELS, "tag")
  knobs = (("tag", (("budget.tag_steps", (3, 7)),)),)
  resolved = isoflop.resolve(config(knobs, (1e9,)))
  assert resolved.grids[:2] == ((("attacks", (("tag",),)), ("budget.tag_steps", (3,))),
                                (("attacks", (("tag",),)), ("budget.tag_steps", (7,))))


@pytest.fixture
def two_attack_ladders(monkeypatch, linear_model):
  """activation (the linear model: calibration documents, then candidates) and tag (20k FLOPs
  a step and document; steps alone) with ladders generated from the target."""
  monkeypatch.setitem(flops._MODELS, "tag", flops.FlopModel(
      lambda s, budget: 20e3 * budget["tag_steps"] * s.num_docs))
  monkeypatch.setattr(ladders, "knobs", lambda: {
      "activation": (ladders.Knob(("data.n_calibration",), None, ladders.GIVEN),
                     ladders.Knob(("budget.candidates",), 1, None)),
      "tag": (ladders.Knob(("budget.tag_steps",), 1, None),)})
  c = config((("activation", ()), ("tag", ())), ())
  c.frontier.ladders = "target"
  return c


def test_ladders_raise_the_knobs_in_turn_up_to_the_largest_level(two_attack_ladders,
                                                                 monkeypatch):
  base = two_attack_ladders.cell.to_dict()
  # Tiny target: d = 32, T = 32, so the floor is 1 calibration document; 10 are given.
  # 4 documents x 1000 x (10 + 5 C) + 100 x n: the floor (1, 1) costs 60.1k; then n and C
  # in turn along 1, 2, 3, 4, 6, 8, ...; n stops at 8 (12 > 10 given); the first rung past
  # 200k ends the ladder: C = 8 at 4000 x 50 + 800 = 200.8k.
  lad = ladders.ladder(base, "activation", 200e3)
  assert [(r["data.n_calibration"], r["budget.candidates"]) for r in lad.rungs] == [
      (1, 1), (2, 1), (2, 2), (3, 2), (3, 3), (4, 3), (4, 4), (6, 4), (6, 6), (8, 6), (8, 8)]
  assert lad.predicted == pytest.approx([4000 * cost(c) + 100 * n for n, c in (
      (1, 1), (2, 1), (2, 2), (3, 2), (3, 3), (4, 3), (4, 4), (6, 4), (6, 6), (8, 6), (8, 8))])
  assert (lad.floor, lad.ceiling, lad.ceiling_why) == (60.1e3, 200.8e3, "the largest level")
  # The calibration documents alone, up to those given: the cap says what stopped it.
  only_n = ladders.Knob(("data.n_calibration",), None, ladders.GIVEN)
  monkeypatch.setattr(ladders, "knobs", lambda: {"activation": (only_n,)})
  lad = ladders.ladder(base, "activation", 1e9)
  assert [r["data.n_calibration"] for r in lad.rungs] == [1, 2, 3, 4, 6, 8]  # 12 > 10
  assert lad.ceiling_why == "data.n_calibration at the 10 calibration documents given"


def test_levels_derived_from_the_floors_and_placed(two_attack_ladders):
  c = two_attack_ladders
  # Floors per document: activation 60.1k / 4 = 15,025; tag 20k. Levels x2 from the
  # cheapest floor to the first at or above the dearest, then one more.
  assert isoflop.absolute_levels(c) == pytest.approx((60.1e3, 120.2e3, 240.4e3))
  # The ladders reach 240.4k x 1.5 = 360.6k: activation's stops at its first rung past it
  # (C = 16 at 4000 x 90 + 800 = 360.8k), tag's at 5 steps would be 400k: 1, 2, 3, 4, 6.
  knobs = dict(isoflop._frontier(c)["knobs"])
  assert knobs["tag"] == (("budget.tag_steps", (1, 2, 3, 4, 6)),)
  assert dict(knobs["activation"])["budget.candidates"][-1] == 16
  # Placed: tag's 1, 2 and 3 steps (80k, 160k, 240k) at 60.1k (x1.33), 120.2k and 240.4k.
  tag = [(p.level, p.knobs) for p in isoflop.placements(c) if p.attack == "tag"]
  assert tag == [(pytest.approx(60.1e3), {"budget.tag_steps": 1}),
                 (pytest.approx(120.2e3), {"budget.tag_steps": 2}),
                 (pytest.approx(240.4e3), {"budget.tag_steps": 3})]
  # Levels the config fixes are kept.
  c.frontier.levels = (50e3,)
  assert isoflop.absolute_levels(c) == (200e3,)


def test_min_calibration_leaves_d_rows_and_one_held_out_document():
  cfg = lambda d: types.SimpleNamespace(n_embd=d)
  # ceil(d / T) documents give the ridge d rows; SIP (sip_holdout 0.25) also needs one held
  # out: round(0.25 n) >= 1 first at n = 3 (round(0.5) is 0).
  assert ladders.min_calibration("ridge", {"cfg": cfg(128), "seq_len": 32}) == 4
  assert ladders.min_calibration("sip", {"cfg": cfg(128), "seq_len": 32}) == 4
  assert ladders.min_calibration("ridge", {"cfg": cfg(128), "seq_len": 128}) == 1
  assert ladders.min_calibration("bisr_b", {"cfg": cfg(128), "seq_len": 128}) == 3
  # The cell's own sip_holdout: 0.5 holds one of 2 out (round(1.0) = 1).
  assert ladders.min_calibration("sip", {"cfg": cfg(128), "seq_len": 128},
                                 {"sip_holdout": 0.5}) == 2


@pytest.mark.parametrize("variant", ["cpu", "paper"])
def test_frontier_ladders_from_the_target_reach_every_attack(variant):
  """The main job's frontier at both scales, ladders from its target: every knobbed attack
  placed, each placement within the tolerance; levels x2 apart from the cheapest floor, and
  every attack's floor within the largest level's budget (every pair compared within a
  budget); no rung draws more calibration documents than given."""
  c = main_table.get_config(variant).frontier.sweep
  placed = isoflop.placements(c)
  tolerance = isoflop.tolerance_of(c)
  at = {}
  for p in placed:
    if p.rung is not None:
      assert isoflop.within(p.predicted, p.level, tolerance)
      at.setdefault(p.attack, set()).add(p.level)
      assert p.knobs.get("data.n_calibration", 0) <= sweep.FRONTIER_CALIBRATION[variant]
  assert set(at) == {name for name, _ in c.frontier.knobs}
  levels = isoflop.absolute_levels(c)
  assert all(b == pytest.approx(2 * a) for a, b in zip(levels, levels[1:]))
  shape = isoflop.shape_of(c.cell.to_dict())
  generated, _ = ladders.generate(c.cell.to_dict(), c.frontier.to_dict())
  floors = [lad.floor for lad in generated.values()]
  # gradient_only runs once: 2 B T V d, one vocabulary ranking.
  floors.append(2.0 * shape["num_docs"] * shape["seq_len"] * 50257 * shape["cfg"].n_embd)
  assert levels[0] == pytest.approx(min(floors))
  assert max(floors) <= levels[-1] * tolerance


@pytest.mark.parametrize("variant", ["frontier_table_cpu", "frontier_table"])
def test_table_ladders_reach_the_levels(variant):
  """The fixed ladders (FRONTIER_KNOBS, kept for comparison) on the embedded target and
  GPT-2 small, as issue 23 tuned them: every knobbed attack placed at the levels its ladder
  spans, each within the tolerance, and every pair of knobbed attacks sharing a level."""
  c = sweep.get_config(variant)
  assert c.frontier.ladders == "table"
  placed = isoflop.placements(c)
  tolerance = isoflop.tolerance_of(c)
  at = {}
  for p in placed:
    if p.rung is not None:
      assert isoflop.within(p.predicted, p.level, tolerance)
      at.setdefault(p.attack, set()).add(p.level)
  assert set(at) == {name for name, _ in c.frontier.knobs}
  names = sorted(at)
  lonely = [(a, b) for i, a in enumerate(names) for b in names[i + 1:] if not at[a] & at[b]]
  assert lonely == []
  levels = isoflop.absolute_levels(c)
  assert len(levels) >= 8 and all(b == pytest.approx(2 * a) for a, b in zip(levels, levels[1:]))


def test_calibration_from_a_npy_is_no_knob(two_attack_ladders, tmp_path):
  """A .npy of calibration documents is used whole (lla.sweep.worker): the ladder raises
  the candidates alone, its cost counting the file's 10 rows."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  c = two_attack_ladders
  for name, rows in (("tokens", 4), ("calibration", 10)):
    np.save(tmp_path / f"{name}.npy", np.zeros((rows, 32), np.int32))
  c.cell.data.tokens_npy = str(tmp_path / "tokens.npy")
  c.cell.data.calibration_npy = str(tmp_path / "calibration.npy")
  lad = ladders.ladder(c.cell.to_dict(), "activation", 100e3)
  # 4000 x (10 + 5 C) + 100 x 10: C = 1, 2 (61k, 81k), then C = 3 at 101k > 100k ends it.
  assert list(lad.rungs) == [{"budget.candidates": v} for v in (1, 2, 3)]
  assert lad.predicted == pytest.approx([61e3, 81e3, 101e3])
