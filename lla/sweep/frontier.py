"""FLOP-matched comparison of attacks: token recovery against recorded FLOPs.

From a sweep's study (configs/sweep.py:frontier runs every attack family on one capture,
each placed at FLOP levels by its analytic cost model, lla.sweep.isoflop) it draws each run
as a point (x: the FLOPs its record was charged, XLA's count, log scale; y: token recovery
on its scored positions) with a Pareto frontier per family (the runs no cheaper run of the
family beats), and compares attacks at common FLOP levels:

  - a run counts at a level when its recorded FLOPs lie within a factor `tolerance` of it
    (both ways); an attack's run at a level is its nearest one (log scale; ties: cheaper);
  - every pair of attacks is compared at every level where both have a run: the paired
    difference of their per-document recovery with a percentile bootstrap interval over
    documents (lla.scoring.bootstrap; marginal 95% intervals, not corrected for the number
    of pairs and levels);
  - a pair without a common level says why: an attack whose cheapest run lies above the
    largest level (its floor, times the tolerance) or whose dearest lies below the smallest
    (its ceiling, over the tolerance); where one attack's cheapest run costs more than the
    other's most expensive, by what ratio; else at which levels each one ran;
  - recovery within a budget, beside: at level L an attack's run is its best (highest token
    recovery; ties: the cheaper) among those whose recorded FLOPs are at most L x tolerance,
    so an attack that is done at a lower cost (a one-shot heuristic, SipIt exact) keeps its
    answer at every higher budget. The run is chosen on its overall recovery and compared
    with its per-document recovery, so the paired bootstrap still pairs documents (choosing
    per document would pick each document's luckiest run). Every pair whose two cheapest
    runs lie within the largest level (times the tolerance) is compared there at least; a
    pair that is not says which attack's floor lies above it. Each within-budget comparison
    says whether both runs spent about L (within the tolerance both ways: the iso-level
    comparison) or one spent less;
  - per attack (grouped by family), its floor and ceiling (with what limits each, for
    ladders placed from the target) and its recovery at each common level (a level at which
    at least two attacks ran) and within each level's budget: tables to read across
    families.

The levels are the sweep's (`report_options(config)`: fixed by the config, or derived from
the target's floors by lla.sweep.ladders), or, for a study without them, a ladder a factor
tolerance^2 apart from the cheapest run up, so that every run counts at one level at least.

`report(study, out_dir)` writes frontier.png (left: the runs and Pareto frontiers; right:
recovery within each level's budget, filled where the run spent about the level),
frontier.json and frontier.md and returns the markdown lines (for the main job's report).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from lla.evidence import files, rundir  # noqa: E402
from lla.evidence.records import AttackRecord  # noqa: E402
from lla.scoring import bootstrap, metrics  # noqa: E402
from lla.sweep import isoflop  # noqa: E402
from lla.sweep import ladders  # noqa: E402
from lla.sweep import study as study_lib  # noqa: E402

FIGURE, TABLE, MARKDOWN = "frontier.png", "frontier.json", "frontier.md"
CONFIDENCE = 0.95


@dataclasses.dataclass(frozen=True)
class Point:
  """One measured run: its attack, FLOPs, token recovery and per-document recovery [B], and
  the analytic FLOPs its placement predicted (None: no model)."""

  attack: str
  family: str
  flops: float
  recovery: float
  per_document: np.ndarray
  truth_sha256: str
  cell_id: str
  knobs: dict
  analytic: float | None = None

  def to_json(self) -> dict:
    return {"attack": self.attack, "family": self.family, "flops": self.flops,
            "analytic_flops": self.analytic, "recovery": self.recovery,
            "cell_id": self.cell_id, "knobs": self.knobs}


def points(study: str) -> list[Point]:
  """Every measured run of the study's finished cells."""
  out, truths = [], {}
  directory = os.path.join(study, study_lib.CELLS)
  for name in sorted(os.listdir(directory)):
    cell = files.read_json(os.path.join(directory, name))
    knobs = dict(cell["config"]["budget"], n_calibration=cell["config"]["data"]["n_calibration"])
    for entry in cell["attacks"]:
      record = AttackRecord.load(os.path.join(study, entry["record"]))
      if record.status != "ok" or record.flops is None:
        continue
      truth_path = rundir.resolve(study, record.truth_file)
      if truth_path not in truths:
        truths[truth_path] = rundir.load_truth(truth_path)
      truth = truths[truth_path]
      predictions = rundir.load_predictions(os.path.join(study, entry["predictions"]))
      hits = metrics.per_document_hits(predictions, truth, record.scored_positions)
      scored = int(metrics.position_mask(truth.shape[1], record.scored_positions).sum())
      per_document = hits / scored
      out.append(Point(record.attack, record.family, float(record.flops),
                       float(hits.sum() / (scored * truth.shape[0])), per_document,
                       files.sha256_bytes(truth.tobytes()), cell["cell_id"], knobs,
                       record.flops_analytic))
  return sorted(out, key=lambda p: (p.family, p.attack, p.flops))


def pareto(family_points: list[Point]) -> list[Point]:
  """The points no cheaper-or-equal point beats: sorted by FLOPs, recovery increasing."""
  front, best = [], -1.0
  for point in sorted(family_points, key=lambda p: (p.flops, -p.recovery)):
    if point.recovery > best:
      front.append(point)
      best = point.recovery
  return front


def derived_levels(all_points: list[Point], tolerance: float) -> tuple[float, ...]:
  """Levels a factor tolerance^2 apart from tolerance x the cheapest run up to the dearest:
  every run lies within a factor `tolerance` of one of them (for a study without levels)."""
  if not all_points or tolerance <= 1:
    return ()
  low, high = min(p.flops for p in all_points), max(p.flops for p in all_points)
  levels, level = [], low * tolerance
  while True:
    levels.append(level)
    if level * tolerance >= high * (1 - 1e-12):
      return tuple(levels)
    level *= tolerance**2


def at_level(runs: list[Point], level: float, tolerance: float) -> Point | None:
  """The run nearest `level` (log scale; ties: the cheaper) among those within a factor
  `tolerance` of it, or None."""
  near = [p for p in runs if isoflop.within(p.flops, level, tolerance)]
  return min(near, key=lambda p: (isoflop.log_distance(p.flops, level), p.flops)) if near else None


def within_budget(runs: list[Point], level: float, tolerance: float) -> Point | None:
  """The best run (highest recovery; ties: the cheaper) among those whose FLOPs are at most
  `level` x `tolerance`, or None."""
  under = [p for p in runs if p.flops <= level * tolerance * (1 + isoflop._SLACK)]
  return min(under, key=lambda p: (-p.recovery, p.flops)) if under else None


def budget_table(all_points: list[Point], levels, tolerance: float) -> dict[str, list]:
  """attack -> [its best run within each level's budget, or None]."""
  return {attack: [within_budget(runs, level, tolerance) for level in levels]
          for attack, runs in sorted(_by_attack(all_points).items())}


def _by_attack(all_points: list[Point]) -> dict[str, list[Point]]:
  out = {}
  for point in all_points:
    out.setdefault(point.attack, []).append(point)
  return out


def level_table(all_points: list[Point], levels, tolerance: float) -> dict[str, list]:
  """attack -> [its run at each level, or None]."""
  return {attack: [at_level(runs, level, tolerance) for level in levels]
          for attack, runs in sorted(_by_attack(all_points).items())}


def common_levels(table: dict[str, list], levels) -> list[int]:
  """Indices of the levels at which at least two attacks have a run."""
  return [i for i in range(len(levels))
          if sum(runs[i] is not None for runs in table.values()) >= 2]


def _outside(attack: str, runs: list[Point], levels, tolerance: float) -> list[dict]:
  """Why `attack` has no run at any level: its floor (cheapest run) above the largest level
  x the tolerance, or its ceiling (dearest run) below the smallest over the tolerance."""
  lo, hi = min(p.flops for p in runs), max(p.flops for p in runs)
  out = []
  if levels and lo > max(levels) * tolerance * (1 + isoflop._SLACK):
    out.append({"kind": "floor", "attack": attack, "flops": lo,
                "note": f"{attack}'s floor (its cheapest run, {lo:.3g} FLOPs) lies above the "
                        f"largest level ({max(levels):.3g} x {tolerance:g})"})
  if levels and hi < min(levels) / tolerance * (1 - isoflop._SLACK):
    out.append({"kind": "ceiling", "attack": attack, "flops": hi,
                "note": f"{attack}'s ceiling (its dearest run, {hi:.3g} FLOPs) lies below the "
                        f"smallest level ({min(levels):.3g} / {tolerance:g})"})
  return out


def _no_common_level(a: str, b: str, runs_a: list[Point], runs_b: list[Point],
                     at_a: list, at_b: list, levels, tolerance: float) -> dict:
  """Why a pair shares no level: each one's floor or ceiling outside the levels, and where
  one's cheapest run costs more than the other's most expensive, by what ratio; else at
  which levels each one ran."""
  reasons = _outside(a, runs_a, levels, tolerance) + _outside(b, runs_b, levels, tolerance)
  out = {}
  lo_a, hi_a = min(p.flops for p in runs_a), max(p.flops for p in runs_a)
  lo_b, hi_b = min(p.flops for p in runs_b), max(p.flops for p in runs_b)
  for dear, lo, cheap, hi in ((a, lo_a, b, hi_b), (b, lo_b, a, hi_a)):
    if lo > hi:
      out = {"ratio": lo / hi, "dearer": dear}
      reasons.append({"kind": "disjoint", "attack": dear,
                      "note": f"{dear}'s cheapest run ({lo:.3g} FLOPs) costs {lo / hi:.3g}x "
                              f"{cheap}'s most expensive ({hi:.3g})"})
      break
  if not reasons:
    where = lambda at: ", ".join(f"{levels[i]:.3g}" for i, p in enumerate(at) if p) or "none"
    reasons.append({"kind": "no common level",
                    "note": f"no common level: {a} at {where(at_a)}; {b} at {where(at_b)}"})
  return dict(out, reasons=reasons, note="; ".join(r["note"] for r in reasons))


def _entry(level: float, pa: Point, pb: Point, kind: str, n_replicates: int) -> dict:
  """One comparison at `level`: each one's run and B - A in percentage points with its
  paired bootstrap interval over documents (a note instead when on different documents)."""
  entry = {"level": level, "kind": kind, "a_flops": pa.flops, "a_recovery": pa.recovery,
           "a_cell": pa.cell_id, "b_flops": pb.flops, "b_recovery": pb.recovery,
           "b_cell": pb.cell_id}
  if pa.truth_sha256 != pb.truth_sha256:
    entry["note"] = "runs on different documents: not paired"
  else:
    diff = (pb.per_document - pa.per_document)[None, :]
    interval = bootstrap.interval(diff, CONFIDENCE, n_replicates, scale=100.0)
    entry.update(diff_pp=interval["estimate"], lo_pp=interval["lo"], hi_pp=interval["hi"])
  return entry


def _spent(level: float, pa: Point, pb: Point, tolerance: float) -> str:
  """Within a budget: whether both runs spent about the level or which spent less."""
  less = [name for name, p in (("A", pa), ("B", pb))
          if not isoflop.within(p.flops, level, tolerance)]
  if len(less) == 1:
    return f"{less[0]} spent less"
  return "both spent less" if less else "both about L"


def pairwise(all_points: list[Point], levels, tolerance: float = isoflop.TOLERANCE,
             n_replicates: int = bootstrap.DEFAULT_REPLICATES) -> list[dict]:
  """Every pair of attacks compared at every level where both ran, and within every
  level's budget where both have a run under it (see the module doc).

  Each row: a, b, `comparisons` (iso-level: per common level the level, each one's run and
  the paired difference B - A in percentage points with its interval, or a note when the
  runs are on different documents) and where there is no common level a `note` and its
  `reasons` (with `ratio` and `dearer` when one's cheapest run costs more than the other's
  most expensive); `within_budget` (per level where both have a run under its budget, the
  same entries with `spent`: "both about L", "A spent less", "B spent less" or "both spent
  less") and where there is none a `budget_note` and its `budget_reasons`.
  """
  table = level_table(all_points, levels, tolerance)
  budget = budget_table(all_points, levels, tolerance)
  by_attack = _by_attack(all_points)
  rows = []
  for a, b in itertools.combinations(sorted(by_attack), 2):
    row = {"a": a, "b": b, "comparisons": [], "within_budget": []}
    for i, level in enumerate(levels):
      pa, pb = table[a][i], table[b][i]
      if pa is not None and pb is not None:
        row["comparisons"].append(_entry(level, pa, pb, "iso-level", n_replicates))
      pa, pb = budget[a][i], budget[b][i]
      if pa is not None and pb is not None:
        entry = _entry(level, pa, pb, "within budget", n_replicates)
        row["within_budget"].append(dict(entry, spent=_spent(level, pa, pb, tolerance)))
    different = {"kind": "different documents", "note": "runs on different documents: not paired"}
    if not any("diff_pp" in c for c in row["comparisons"]):
      if row["comparisons"]:
        row.update(note=different["note"], reasons=[different])
      else:
        row.update(_no_common_level(a, b, by_attack[a], by_attack[b], table[a], table[b],
                                    levels, tolerance))
    if not any("diff_pp" in c for c in row["within_budget"]):
      reasons = ([different] if row["within_budget"] else
                 [r for r in _outside(a, by_attack[a], levels, tolerance)
                  + _outside(b, by_attack[b], levels, tolerance) if r["kind"] == "floor"])
      row.update(budget_reasons=reasons, budget_note="; ".join(r["note"] for r in reasons))
    rows.append(row)
  return rows


def summary(rows: list[dict], levels, tolerance: float) -> dict:
  """How many pairs carry a paired difference at a common level and within a budget, and
  how many of those that do not fail for each reason (a pair may have two)."""
  compared = sum(any("diff_pp" in c for c in row["comparisons"]) for row in rows)
  within = sum(any("diff_pp" in c for c in row["within_budget"]) for row in rows)
  why = {"iso-level": {}, "within budget": {}}
  for row in rows:
    for kind, key in (("iso-level", "reasons"), ("within budget", "budget_reasons")):
      for reason in {r["kind"] for r in row.get(key, ())}:
        why[kind][reason] = why[kind].get(reason, 0) + 1
  share = lambda n: n / len(rows) if rows else math.nan
  return {"pairs": len(rows), "compared": compared, "share": share(compared),
          "compared_within_budget": within, "share_within_budget": share(within),
          "not_compared": why, "levels": list(levels), "tolerance": tolerance}


def report_options(config) -> dict:
  """The levels (FLOPs per cell), tolerance and, for ladders placed from the target, what
  limits each attack's floor and ceiling (lla.sweep.ladders) of a sweep config, for
  `report`; empty levels (a sweep without them) leave `report` to derive its own."""
  frontier = config.frontier.to_dict()
  limits = {}
  if frontier.get("ladders") == "target":
    generated, _ = ladders.generate(config.cell.to_dict(), frontier)
    limits = {name: {"floor": ladders.FLOOR_WHY[name], "ceiling": lad.ceiling_why}
              for name, lad in generated.items()}
    limits.update({name: {"floor": ladders.FLOOR_WHY[name], "ceiling": "one run"}
                   for name in frontier.get("fixed") or () if name in ladders.FLOOR_WHY})
  return {"levels": isoflop.absolute_levels(config), "tolerance": isoflop.tolerance_of(config),
          "limits": limits}


def figure(all_points: list[Point], path: str, levels=(), tolerance: float = isoflop.TOLERANCE
           ) -> None:
  """Left: every run and each family's Pareto frontier. Right (with levels): each attack's
  recovery within each level's budget; a filled marker where its run spent about the level
  (iso-level), a hollow one where it spent less."""
  families = sorted({p.family for p in all_points})
  colors = plt.get_cmap("tab10")
  fig, axes = plt.subplots(1, 2 if levels else 1, figsize=(15 if levels else 8, 5.5),
                           squeeze=False)
  ax = axes[0][0]
  budget = budget_table(all_points, levels, tolerance)
  for i, family in enumerate(families):
    members = [p for p in all_points if p.family == family]
    color = colors(i % 10)
    for attack, marker in zip(sorted({p.attack for p in members}), itertools.cycle("osD^v<>pP*X")):
      runs = [p for p in members if p.attack == attack]
      ax.scatter([p.flops for p in runs], [100 * p.recovery for p in runs], color=color,
                 marker=marker, label=f"{attack} ({family})", zorder=3)
      if levels:
        best = budget[attack]
        xs = [level for level, p in zip(levels, best) if p is not None]
        ys = [100 * p.recovery for p in best if p is not None]
        iso = [isoflop.within(p.flops, level, tolerance) for level, p in zip(levels, best)
               if p is not None]
        axes[0][1].plot(xs, ys, color=color, alpha=0.6, zorder=2)
        axes[0][1].scatter(xs, ys, marker=marker, zorder=3, edgecolors=color,
                           facecolors=[color if k else "none" for k in iso])
    front = pareto(members)
    ax.step([p.flops for p in front], [100 * p.recovery for p in front], where="post",
            color=color, alpha=0.6, zorder=2)
  ax.set_xlabel("FLOPs charged to the run (XLA cost analysis, shared stages included)")
  ax.set_title("Token recovery against compute; lines: Pareto frontier per family")
  ax.legend(fontsize=7, loc="best")
  if levels:
    axes[0][1].set_xlabel(f"FLOP level L (budget: recorded FLOPs <= L x {tolerance:g})")
    axes[0][1].set_title("Recovery within a budget: filled, the run spent about L "
                         "(iso-level); hollow, less", fontsize=10)
  for axis in axes[0]:
    axis.set_xscale("log")
    axis.set_ylabel("token recovery (%)")
    axis.grid(True, which="both", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=150)
  plt.close(fig)


def _knob_text(point: Point, varied: set[str]) -> str:
  return ", ".join(f"{k}={point.knobs[k]}" for k in sorted(varied) if k in point.knobs) or "—"


def report(study: str, out_dir: str, n_replicates: int = bootstrap.DEFAULT_REPLICATES,
           figure_link: str = FIGURE, levels=(), tolerance: float = isoflop.TOLERANCE,
           limits: dict | None = None) -> list[str]:
  """Writes the figure, the table (JSON) and frontier.md to out_dir; returns the markdown,
  whose image links to `figure_link` (the figure's path from where the markdown lands).
  `levels`: FLOPs per cell at which attacks are compared (empty: `derived_levels`);
  `limits`: per attack, what limits its floor and ceiling (`report_options`)."""
  all_points = points(study)
  if not all_points:
    raise ValueError(f"{study}: no measured run to draw")
  levels = tuple(float(x) for x in levels) or derived_levels(all_points, tolerance)
  os.makedirs(out_dir, exist_ok=True)
  figure(all_points, os.path.join(out_dir, FIGURE), levels, tolerance)
  rows = pairwise(all_points, levels, tolerance, n_replicates)
  table = level_table(all_points, levels, tolerance)
  budget = budget_table(all_points, levels, tolerance)
  fronts = {id(p) for family in {p.family for p in all_points}
            for p in pareto([q for q in all_points if q.family == family])}
  totals = summary(rows, levels, tolerance)
  files.atomic_write_json(os.path.join(out_dir, TABLE), {
      "points": [dict(p.to_json(), on_frontier=id(p) in fronts) for p in all_points],
      "at_levels": {attack: [None if p is None else {"cell_id": p.cell_id, "flops": p.flops,
                                                  "recovery": p.recovery} for p in runs]
                 for attack, runs in table.items()},
      "within_budget": {attack: [None if p is None else {"cell_id": p.cell_id, "flops": p.flops,
                                                       "recovery": p.recovery} for p in runs]
                        for attack, runs in budget.items()},
      "attacks": {attack: dict(r, limits=(limits or {}).get(attack))
                  for attack, r in attack_ranges(all_points, levels, tolerance).items()},
      "pairwise": rows, "summary": totals}, overwrite=True)
  text = "\n".join(_markdown(all_points, rows, fronts, table, levels, totals, FIGURE,
                             budget, limits)) + "\n"
  files.atomic_write_bytes(os.path.join(out_dir, MARKDOWN), text.encode(), overwrite=True)
  return _markdown(all_points, rows, fronts, table, levels, totals, figure_link, budget, limits)


def attack_ranges(all_points: list[Point], levels, tolerance: float) -> dict[str, dict]:
  """Per attack: its floor and ceiling (cheapest and dearest recorded FLOPs), the levels at
  which it has a run, and its floor or ceiling where it lies outside the levels."""
  table = level_table(all_points, levels, tolerance)
  return {attack: {"floor": min(p.flops for p in runs), "ceiling": max(p.flops for p in runs),
                   "levels": [levels[i] for i, p in enumerate(table[attack]) if p],
                   "outside": [r["note"] for r in _outside(attack, runs, levels, tolerance)]}
          for attack, runs in sorted(_by_attack(all_points).items())}


def _pp(entry: dict) -> str:
  if "diff_pp" not in entry:
    return entry.get("note", "")
  text = f"{entry['diff_pp']:+.1f} [{entry['lo_pp']:+.1f}, {entry['hi_pp']:+.1f}]"
  # Within a budget, a mark where one run spent less than about the level.
  return text + {"A spent less": " (A<)", "B spent less": " (B<)",
                 "both spent less": " (A<, B<)"}.get(entry.get("spent"), "")


def _level_rows(table: dict, order: list[str], family: dict, shown: list[int]) -> list[str]:
  return [f"| {family[attack]} | {attack} | " + " | ".join(
      "" if table[attack][i] is None else f"{100 * table[attack][i].recovery:.1f}%"
      for i in shown) + " |" for attack in order]


def _pair_rows(rows: list[dict], key: str, note: str, levels, shown: list[int]) -> list[str]:
  out = ["| A | B | " + " | ".join(f"{levels[i]:.3g}" for i in shown) + " | note |",
         "|---|---|" + "---|" * (len(shown) + 1)]
  for row in rows:
    by_level = {c["level"]: c for c in row[key]}
    cells = [_pp(by_level[levels[i]]) if levels[i] in by_level else "" for i in shown]
    out.append(f"| {row['a']} | {row['b']} | " + " | ".join(cells) + f" | {row.get(note, '')} |")
  return out


def _markdown(all_points: list[Point], rows: list[dict], fronts: set[int], table: dict,
              levels, totals: dict, figure_link: str, budget: dict | None = None,
              limits: dict | None = None) -> list[str]:
  """The section's lines: figure, runs (frontier points marked), each attack's floor and
  ceiling, recovery per level (iso-level, then within a budget), pairs at common levels and
  within a budget, each pair not compared with why."""
  tolerance = totals["tolerance"]
  budget = budget if budget is not None else budget_table(all_points, levels, tolerance)
  lines = ["## Attacks at matched FLOPs", "",
           f"![token recovery against FLOPs]({figure_link})", "",
           "Recorded FLOPs (XLA's count) and, where the attack has a model, their ratio to "
           "the analytic FLOPs its placement predicted (far from 1: the run landed off its "
           "level).", "",
           "| family | attack | budget | FLOPs | / analytic | token recovery | on the frontier |",
           "|---|---|---|---|---|---|---|"]
  for attack in sorted({p.attack for p in all_points}):
    runs = [p for p in all_points if p.attack == attack]
    varied = {k for k in runs[0].knobs if len({str(p.knobs.get(k)) for p in runs}) > 1}
    for p in runs:
      ratio = f"{p.flops / p.analytic:.2f}" if p.analytic else ""
      lines.append(f"| {p.family} | {p.attack} | {_knob_text(p, varied)} | {p.flops:.3g} | "
                   f"{ratio} | {100 * p.recovery:.2f}% | {'yes' if id(p) in fronts else ''} |")
  family = {p.attack: p.family for p in all_points}
  order = sorted(table, key=lambda a: (family[a], a))
  ranges = attack_ranges(all_points, levels, tolerance)
  limits = limits or {}
  lines += ["", "### Each attack's floor and ceiling", "",
            "Its cheapest and dearest recorded runs, what limits each (for ladders placed "
            "from the target, lla.sweep.ladders) and where they lie outside the levels.", "",
            "| family | attack | floor | ceiling | floor: its cheapest meaningful run | "
            "ceiling: limited by | levels reached | outside the levels |",
            "|---|---|---|---|---|---|---|---|"]
  for attack in order:
    r, why = ranges[attack], limits.get(attack, {})
    lines.append(f"| {family[attack]} | {attack} | {r['floor']:.3g} | {r['ceiling']:.3g} | "
                 f"{why.get('floor', '')} | {why.get('ceiling', '')} | "
                 f"{len(r['levels'])} of {len(levels)} | {'; '.join(r['outside'])} |")
  shown = common_levels(table, levels)
  lines += ["", "### Token recovery at common FLOP levels (iso-level)", "",
            f"Each attack's run within a factor {tolerance:g} of each level (the nearest; "
            "recorded FLOPs, XLA's count); levels at which at least two attacks ran. "
            "Empty: no run of the attack at that level.", "",
            "| family | attack | " + " | ".join(f"{levels[i]:.3g}" for i in shown) + " |",
            "|---|---|" + "---|" * len(shown)]
  lines += _level_rows(table, order, family, shown)
  in_budget = common_levels(budget, levels)
  lines += ["", "### Token recovery within a budget", "",
            f"Each attack's best run whose recorded FLOPs are at most the level x {tolerance:g} "
            "(an attack done at a lower cost keeps its recovery at every higher budget). "
            "Empty: every run of the attack costs more.", "",
            "| family | attack | " + " | ".join(f"<= {levels[i]:.3g}" for i in in_budget)
            + " |", "|---|---|" + "---|" * len(in_budget)]
  lines += _level_rows(budget, order, family, in_budget)
  share = lambda key: f"{100 * totals[key]:.0f}%"
  lines += ["", "### Pairs at common FLOP levels (iso-level)", "",
            f"{totals['compared']} of {totals['pairs']} pairs compared at a common level "
            f"({share('share')}); {totals['compared_within_budget']} of {totals['pairs']} "
            f"within a budget ({share('share_within_budget')}). Per level, B - A in percentage "
            f"points of token recovery with a {int(100 * CONFIDENCE)}% paired bootstrap "
            "interval over documents; a pair without a common level says why.", ""]
  lines += _pair_rows(rows, "comparisons", "note", levels, shown)
  lines += ["", "### Pairs within a budget", "",
            f"Per level L, B - A between each attack's best run costing at most L x "
            f"{tolerance:g}; (A<) or (B<): that run spent less than L / {tolerance:g} (not "
            "iso-level); unmarked: both spent about L. A pair not compared says why.", ""]
  lines += _pair_rows(rows, "within_budget", "budget_note", levels, in_budget)
  return lines
