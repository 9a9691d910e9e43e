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
