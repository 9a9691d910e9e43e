"""lla.sweep.frontier's comparisons at common FLOP levels, on constructed points whose
levels, pairs and differences are worked out by hand here."""

import numpy as np
import pytest

from lla.sweep import frontier

LEVELS = (1e9, 2e9, 4e9, 8e9)
TOL = 1.5


def point(attack, flops, hits, family=None, truth="t"):
  hits = np.asarray(hits, float)
  return frontier.Point(attack, family or f"f_{attack}", flops, float(hits.mean()), hits,
                        truth, f"{attack}@{flops:g}", {})


POINTS = [
    # a: 1.1e9 at 1e9; 2.9e9 (x1.45) at 2e9; 4.2e9 at 4e9 (2.9e9 is x1.38 from it, further).
    point("a", 1.1e9, [1, 0, 1, 0]), point("a", 2.9e9, [1, 1, 1, 0]),
    point("a", 4.2e9, [1, 1, 1, 1]),
    # b: 0.7e9 (x1.43) at 1e9, 2.1e9 at 2e9; nothing within x1.5 of 4e9 or 8e9.
    point("b", 0.7e9, [0, 0, 1, 0]), point("b", 2.1e9, [0, 1, 1, 0]),
    point("c", 8.5e9, [1, 1, 0, 0]),                 # fixed cost, at 8e9
    point("d", 40e9, [1, 1, 1, 1]),                  # fixed cost, at no level
    point("e", 1.0e9, [0, 0, 0, 0], truth="other"),  # other documents
    # g: 0.62e9 is x1.61 from 1e9 (none); 11e9 is x1.375 from 8e9: g's range spans a's.
    point("g", 0.62e9, [0, 0, 0, 1], family="f_a"), point("g", 11e9, [0, 1, 0, 1], family="f_a"),
]


def rows_by_pair(rows):
  return {(r["a"], r["b"]): r for r in rows}


def test_level_table_takes_the_nearest_run_within_the_tolerance():
  table = frontier.level_table(POINTS, LEVELS, TOL)
  flops = {a: [None if p is None else p.flops for p in runs] for a, runs in table.items()}
  assert flops == {"a": [1.1e9, 2.9e9, 4.2e9, None], "b": [0.7e9, 2.1e9, None, None],
                   "c": [None, None, None, 8.5e9], "d": [None] * 4,
                   "e": [1.0e9, None, None, None], "g": [None, None, None, 11e9]}
  assert frontier.common_levels(table, LEVELS) == [0, 1, 3]  # 4e9: a alone
  # Ties in distance: the cheaper run.
  tie = [point("x", 2e9 / 1.2, [0]), point("x", 2e9 * 1.2, [1])]
  assert frontier.at_level(tie, 2e9, TOL).flops == pytest.approx(2e9 / 1.2)


def test_pairs_compared_at_every_common_level_with_a_paired_bootstrap():
  rows = rows_by_pair(frontier.pairwise(POINTS, LEVELS, TOL, n_replicates=2000))
  assert len(rows) == 15  # 6 attacks
  ab = rows[("a", "b")]
  assert [c["level"] for c in ab["comparisons"]] == [1e9, 2e9]
  # B - A per document: [0,0,1,0] - [1,0,1,0] and [0,1,1,0] - [1,1,1,0]: -25 pp each.
  for c, (fa, fb) in zip(ab["comparisons"], ((1.1e9, 0.7e9), (2.9e9, 2.1e9))):
    assert (c["a_flops"], c["b_flops"]) == (fa, fb)
    assert c["diff_pp"] == pytest.approx(-25.0)
    assert c["lo_pp"] <= c["diff_pp"] <= c["hi_pp"]
    assert c["lo_pp"] >= -100.0 and c["hi_pp"] <= 0.0  # differences are -1 or 0 per document
  assert "note" not in ab
  cg = rows[("c", "g")]
  assert [c["level"] for c in cg["comparisons"]] == [8e9]
  assert cg["comparisons"][0]["diff_pp"] == pytest.approx(100 * np.mean([-1, 0, 0, 1]))


def test_pairs_without_a_common_level_say_why():
  rows = rows_by_pair(frontier.pairwise(POINTS, LEVELS, TOL, n_replicates=200))
  # a's dearest run (4.2e9) is cheaper than c's only one (8.5e9).
  ac = rows[("a", "c")]
  assert ac["comparisons"] == [] and ac["dearer"] == "c"
  assert ac["ratio"] == pytest.approx(8.5 / 4.2)
  assert ac["note"] == "c's cheapest run (8.5e+09 FLOPs) costs 2.02x a's most expensive (4.2e+09)"
  assert rows[("b", "d")]["ratio"] == pytest.approx(40 / 2.1)
  assert rows[("c", "d")]["ratio"] == pytest.approx(40 / 8.5)
  # g's range (0.62e9 .. 11e9) covers a's, but they share no level.
  ag = rows[("a", "g")]
  assert "ratio" not in ag
  assert ag["note"] == "no common level: a at 1e+09, 2e+09, 4e+09; g at 8e+09"
  # e ran on other documents: compared at 1e9 with a and b, but not paired.
  ae = rows[("a", "e")]
  assert ae["comparisons"][0]["note"] == "runs on different documents: not paired"
  assert ae["note"] == "runs on different documents: not paired"


def test_summary_share_and_markdown():
  rows = frontier.pairwise(POINTS, LEVELS, TOL, n_replicates=200)
  compared = sorted((r["a"], r["b"]) for r in rows if any("diff_pp" in c for c in r["comparisons"]))
  assert compared == [("a", "b"), ("c", "g")]
  totals = frontier.summary(rows, LEVELS, TOL)
  assert (totals["pairs"], totals["compared"]) == (15, 2)
  assert totals["share"] == pytest.approx(2 / 15)
  table = frontier.level_table(POINTS, LEVELS, TOL)
  lines = frontier._markdown(POINTS, rows, set(), table, LEVELS, totals, "f.png")
  text = "\n".join(lines)
  assert "2 of 15 pairs compared at a common level (13%)" in text
  # The per-level table: common levels only (not 4e9), one row per attack by family.
  assert "| family | attack | 1e+09 | 2e+09 | 8e+09 |" in text
  assert "| f_a | a | 50.0% | 75.0% |  |" in text
  assert "| f_a | g |  |  | 50.0% |" in text
  assert "| f_d | d |  |  |  |" in text
  assert any(line.startswith("| a | b | -25.0 [") for line in lines)


def test_derived_levels_cover_every_run():
  levels = frontier.derived_levels(POINTS, TOL)
  assert levels[0] == pytest.approx(0.62e9 * 1.5)
  assert all(b / a == pytest.approx(TOL**2) for a, b in zip(levels, levels[1:]))
  assert levels[-1] * TOL >= 40e9 > levels[-2] * TOL
  for p in POINTS:
    assert any(frontier.isoflop.within(p.flops, level, TOL) for level in levels)
  assert frontier.derived_levels([point("z", 5e9, [1])], TOL) == (7.5e9,)


# Within a budget at LEVELS x TOL = 1.5e9, 3e9, 6e9, 12e9, worked out from POINTS: each
# attack's best run (highest recovery; ties: the cheaper) costing at most the budget.
BUDGET_FLOPS = {"a": [1.1e9, 2.9e9, 4.2e9, 4.2e9], "b": [0.7e9, 2.1e9, 2.1e9, 2.1e9],
                "c": [None, None, None, 8.5e9], "d": [None] * 4,
                "e": [1.0e9] * 4, "g": [0.62e9, 0.62e9, 0.62e9, 11e9]}


def test_budget_table_takes_the_best_run_under_each_budget():
  table = frontier.budget_table(POINTS, LEVELS, TOL)
  assert {a: [None if p is None else p.flops for p in runs] for a, runs in table.items()} \
      == BUDGET_FLOPS
  # The best, not the dearest: a dearer run that recovers less is passed over, at the bound
  # (1.5 x 2e9 = 3e9 counts) and beyond it (3.1e9 does not).
  runs = [point("h", 1e9, [1, 1]), point("h", 3e9, [0, 1]), point("h", 3.1e9, [1, 1])]
  assert frontier.within_budget(runs, 2e9, TOL).flops == 1e9
  assert frontier.within_budget(runs, 2.1e9, TOL).flops == 1e9  # tie at 100%: the cheaper
  assert frontier.within_budget(runs, 0.6e9, TOL) is None


def test_pairs_within_a_budget_pair_documents_and_say_who_spent_less():
  rows = rows_by_pair(frontier.pairwise(POINTS, LEVELS, TOL, n_replicates=2000))
  ab = rows[("a", "b")]
  # 1e9, 2e9: the iso-level runs; 4e9: a's 4.2e9 ([1,1,1,1]) against b's 2.1e9
  # ([0,1,1,0], spent less than 4e9 / 1.5): -50 pp; 8e9: both spent less, the same runs.
  assert [(c["level"], c["a_flops"], c["b_flops"], c["spent"]) for c in ab["within_budget"]] \
      == [(1e9, 1.1e9, 0.7e9, "both about L"), (2e9, 2.9e9, 2.1e9, "both about L"),
          (4e9, 4.2e9, 2.1e9, "B spent less"), (8e9, 4.2e9, 2.1e9, "both spent less")]
  assert [c["diff_pp"] for c in ab["within_budget"]] == pytest.approx([-25, -25, -50, -50])
  assert all(c["kind"] == "within budget" and c["lo_pp"] <= c["diff_pp"] <= c["hi_pp"]
             for c in ab["within_budget"])
  assert all(c["kind"] == "iso-level" for c in ab["comparisons"])
  # a and g share no level, yet compare within every budget: at 1e9 g's 0.62e9 [0,0,0,1]
  # against a's 1.1e9 [1,0,1,0]; at 8e9 g's 11e9 [0,1,0,1] against a's 4.2e9 [1,1,1,1].
  ag = rows[("a", "g")]
  assert ag["comparisons"] == [] and "budget_note" not in ag
  assert [(c["level"], c["spent"]) for c in ag["within_budget"]] == [
      (1e9, "B spent less"), (2e9, "B spent less"), (4e9, "B spent less"),
      (8e9, "A spent less")]
  assert [c["diff_pp"] for c in ag["within_budget"]] == pytest.approx(
      [100 * np.mean([-1, 0, -1, 1]), 100 * np.mean([-1, -1, -1, 1]),
       100 * np.mean([-1, -1, -1, 0]), 100 * np.mean([-1, 0, -1, 0])])
  # a and c: disjoint ranges, compared within the 8e9 budget only.
  assert [(c["level"], c["spent"]) for c in rows[("a", "c")]["within_budget"]] == [
      (8e9, "A spent less")]
  # c and g: both about 8e9, the same runs as the iso-level comparison.
  cg = rows[("c", "g")]
  assert [c["diff_pp"] for c in cg["within_budget"]] == [cg["comparisons"][0]["diff_pp"]]
  assert cg["within_budget"][0]["spent"] == "both about L"


def test_every_pair_whose_cheapest_runs_fit_the_largest_budget_is_compared():
  """The rule, checked against POINTS directly: a pair on the same documents is compared
  within a budget exactly when both cheapest runs cost at most the largest level x TOL."""
  rows = frontier.pairwise(POINTS, LEVELS, TOL, n_replicates=200)
  cheapest, truth = {}, {}
  for p in POINTS:
    cheapest[p.attack] = min(cheapest.get(p.attack, np.inf), p.flops)
    truth[p.attack] = p.truth_sha256
  for row in rows:
    a, b = row["a"], row["b"]
    expected = (truth[a] == truth[b] and max(cheapest[a], cheapest[b]) <= 8e9 * TOL)
    assert any("diff_pp" in c for c in row["within_budget"]) == expected, (a, b)
  totals = frontier.summary(rows, LEVELS, TOL)
  # Compared: a-b, a-c, a-g, b-c, b-g, c-g. Not: the five pairs with d (its floor, 40e9,
  # above 12e9) and the four others with e (other documents).
  assert (totals["compared"], totals["compared_within_budget"]) == (2, 6)
  assert totals["share_within_budget"] == pytest.approx(6 / 15)
  assert totals["not_compared"]["within budget"] == {"floor": 5, "different documents": 4}


def test_pairs_not_compared_say_why():
  rows = rows_by_pair(frontier.pairwise(POINTS, LEVELS, TOL, n_replicates=200))
  floor = "d's floor (its cheapest run, 4e+10 FLOPs) lies above the largest level (8e+09 x 1.5)"
  bd = rows[("b", "d")]
  assert [r["kind"] for r in bd["reasons"]] == ["floor", "disjoint"]
  assert bd["note"] == (floor + "; d's cheapest run (4e+10 FLOPs) costs 19x b's most "
                        "expensive (2.1e+09)")
  assert bd["budget_note"] == floor and bd["within_budget"] == []
  assert rows[("a", "e")]["budget_note"] == "runs on different documents: not paired"
  # Of the 13 pairs without an iso-level comparison: d's five (its floor, and disjoint
  # ranges: every other attack's dearest run is below 4e10); a-c, b-c, c-e disjoint;
  # a-e, b-e compared at 1e9 on other documents; a-g, b-g, e-g overlapping ranges without
  # a common level.
  totals = frontier.summary(list(rows.values()), LEVELS, TOL)
  assert totals["not_compared"]["iso-level"] == {
      "floor": 5, "disjoint": 8, "different documents": 2, "no common level": 3}
  # A ceiling below the smallest level: y's dearest run, 0.6e9, is under 1e9 / 1.5. It has no
  # level (and a's cheapest, 1.1e9, is dearer), but lies within every budget: compared with
  # a within each of them.
  y = [point("y", 0.3e9, [1, 1, 0, 0]), point("y", 0.6e9, [1, 1, 1, 0])]
  row, = frontier.pairwise(POINTS[:3] + y, LEVELS, TOL, n_replicates=200)
  assert [r["kind"] for r in row["reasons"]] == ["ceiling", "disjoint"]
  assert row["reasons"][0] == {"kind": "ceiling", "attack": "y", "flops": 0.6e9, "note":
                               "y's ceiling (its dearest run, 6e+08 FLOPs) lies below the "
                               "smallest level (1e+09 / 1.5)"}
  assert [c["b_flops"] for c in row["within_budget"]] == [0.6e9] * 4
  assert "budget_note" not in row


def test_markdown_shows_both_comparisons_labelled():
  rows = frontier.pairwise(POINTS, LEVELS, TOL, n_replicates=200)
  totals = frontier.summary(rows, LEVELS, TOL)
  lines = frontier._markdown(POINTS, rows, set(), frontier.level_table(POINTS, LEVELS, TOL),
                             LEVELS, totals, "f.png")
  text = "\n".join(lines)
  assert "2 of 15 pairs compared at a common level (13%); 6 of 15 within a budget (40%)" in text
  assert "### Pairs within a budget" in text and "(iso-level)" in text
  # Within a budget: levels at which two attacks have a run under the budget (all four).
  assert "| family | attack | <= 1e+09 | <= 2e+09 | <= 4e+09 | <= 8e+09 |" in text
  assert "| f_a | g | 25.0% | 25.0% | 25.0% | 50.0% |" in text
  assert any(line.startswith("| a | b | -25.0 [") and "-50.0 [" in line and "(B<)" in line
             and "(A<, B<)" in line for line in lines)
  assert "| f_d | d | 4e+10 | 4e+10 |  |  | 0 of 4 | d's floor" in text
  # What limits a floor and a ceiling, where the sweep's ladders say (report_options).
  limits = {"a": {"floor": "one step", "ceiling": "the largest level"}}
  text = "\n".join(frontier._markdown(POINTS, rows, set(), frontier.level_table(
      POINTS, LEVELS, TOL), LEVELS, totals, "f.png", limits=limits))
  assert "| f_a | a | 1.1e+09 | 4.2e+09 | one step | the largest level | 3 of 4 |  |" in text


def test_figure_draws_both_panels(tmp_path):
  path = tmp_path / "f.png"
  frontier.figure(POINTS, str(path), LEVELS, TOL)
  assert path.stat().st_size > 10_000


def test_report_options_name_what_limits_each_attack():
  """frontier_cpu's ladders from its target (the embedded model, 16 documents, 1,536
  calibration documents given): ridge's ceiling is the calibration data, a stepped attack's
  the largest level, and gradient_only runs once."""
  from configs import sweep  # pylint: disable=g-import-not-at-top
  options = frontier.report_options(sweep.get_config("frontier_cpu"))
  limits = options["limits"]
  assert len(limits) == 11
  assert limits["ridge"]["ceiling"] == "data.n_calibration at the 1536 calibration documents given"
  assert limits["tag"]["ceiling"] == "the largest level"
  assert limits["gradient_only"] == {"floor": frontier.ladders.FLOOR_WHY["gradient_only"],
                                     "ceiling": "one run"}
  assert options["levels"] and options["tolerance"] == 1.5


def test_runs_table_shows_recorded_over_analytic_flops():
  """A run recorded at 2e9 whose model predicted 8e9 shows 0.25 (it landed off its level);
  a run without a model shows nothing."""
  runs = [frontier.Point("m", "f", 2e9, 0.5, np.array([0.5]), "t", "c1", {}, 8e9),
          frontier.Point("n", "f", 3e9, 0.5, np.array([0.5]), "t", "c2", {})]
  rows = frontier.pairwise(runs, (2e9,), TOL, n_replicates=200)
  lines = frontier._markdown(runs, rows, set(), frontier.level_table(runs, (2e9,), TOL),
                             (2e9,), frontier.summary(rows, (2e9,), TOL), "f.png")
  assert "| f | m | — | 2e+09 | 0.25 | 50.00% |  |" in lines
  assert "| f | n | — | 3e+09 |  | 50.00% |  |" in lines
  assert runs[0].to_json()["analytic_flops"] == 8e9
