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
  - a pair without a common level says why: where one attack's cheapest run costs more than
    the other's most expensive, by what ratio; else at which levels each one ran;
  - per attack (grouped by family), its recovery at each common level (a level at which at
    least two attacks ran): a table to read across families.

The levels are the sweep's (`report_options(config)`), or, for a study without them, a
ladder a factor tolerance^2 apart from the cheapest run up, so that every run counts at
one level at least.

`report(study, out_dir)` writes frontier.png, frontier.json and frontier.md and returns
the markdown lines (for the main job's report).
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
from lla.sweep import study as study_lib  # noqa: E402

FIGURE, TABLE, MARKDOWN = "frontier.png", "frontier.json", "frontier.md"
CONFIDENCE = 0.95


@dataclasses.dataclass(frozen=True)
class Point:
  """One measured run: its attack, FLOPs, token recovery and per-document recovery [B]."""

  attack: str
  family: str
  flops: float
  recovery: float
  per_document: np.ndarray
  truth_sha256: str
  cell_id: str
  knobs: dict

  def to_json(self) -> dict:
    return {"attack": self.attack, "family": self.family, "flops": self.flops,
            "recovery": self.recovery, "cell_id": self.cell_id, "knobs": self.knobs}


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
                       files.sha256_bytes(truth.tobytes()), cell["cell_id"], knobs))
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


def level_table(all_points: list[Point], levels, tolerance: float) -> dict[str, list]:
  """attack -> [its run at each level, or None]."""
  by_attack = {}
  for point in all_points:
    by_attack.setdefault(point.attack, []).append(point)
  return {attack: [at_level(runs, level, tolerance) for level in levels]
          for attack, runs in sorted(by_attack.items())}


def common_levels(table: dict[str, list], levels) -> list[int]:
  """Indices of the levels at which at least two attacks have a run."""
  return [i for i in range(len(levels))
          if sum(runs[i] is not None for runs in table.values()) >= 2]


def _no_common_level(a: str, b: str, runs_a: list[Point], runs_b: list[Point],
                     at_a: list, at_b: list, levels) -> dict:
  lo_a, hi_a = min(p.flops for p in runs_a), max(p.flops for p in runs_a)
  lo_b, hi_b = min(p.flops for p in runs_b), max(p.flops for p in runs_b)
  for dear, lo, cheap, hi in ((a, lo_a, b, hi_b), (b, lo_b, a, hi_a)):
    if lo > hi:
      return {"ratio": lo / hi, "dearer": dear,
              "note": f"{dear}'s cheapest run ({lo:.3g} FLOPs) costs {lo / hi:.3g}x "
                      f"{cheap}'s most expensive ({hi:.3g})"}
  where = lambda at: ", ".join(f"{levels[i]:.3g}" for i, p in enumerate(at) if p) or "none"
  return {"note": f"no common level: {a} at {where(at_a)}; {b} at {where(at_b)}"}


def pairwise(all_points: list[Point], levels, tolerance: float = isoflop.TOLERANCE,
             n_replicates: int = bootstrap.DEFAULT_REPLICATES) -> list[dict]:
  """Every pair of attacks compared at every level where both ran (see the module doc).

  Each row: a, b, `comparisons` (per common level: the level, each one's run and the
  paired difference B - A in percentage points with its interval, or a note when the runs
  are on different documents), and where there is no common level a `note` (with `ratio`
  and `dearer` when one's cheapest run costs more than the other's most expensive).
  """
  table = level_table(all_points, levels, tolerance)
  by_attack = {}
  for point in all_points:
    by_attack.setdefault(point.attack, []).append(point)
  rows = []
  for a, b in itertools.combinations(sorted(by_attack), 2):
    row = {"a": a, "b": b, "comparisons": []}
    for i, level in enumerate(levels):
      pa, pb = table[a][i], table[b][i]
      if pa is None or pb is None:
        continue
      entry = {"level": level, "a_flops": pa.flops, "a_recovery": pa.recovery,
               "a_cell": pa.cell_id, "b_flops": pb.flops, "b_recovery": pb.recovery,
               "b_cell": pb.cell_id}
      if pa.truth_sha256 != pb.truth_sha256:
        entry["note"] = "runs on different documents: not paired"
      else:
        diff = (pb.per_document - pa.per_document)[None, :]
        interval = bootstrap.interval(diff, CONFIDENCE, n_replicates, scale=100.0)
        entry.update(diff_pp=interval["estimate"], lo_pp=interval["lo"], hi_pp=interval["hi"])
      row["comparisons"].append(entry)
    if not any("diff_pp" in c for c in row["comparisons"]):
      if row["comparisons"]:
        row["note"] = "runs on different documents: not paired"
      else:
        row.update(_no_common_level(a, b, by_attack[a], by_attack[b], table[a], table[b],
                                    levels))
    rows.append(row)
  return rows


def summary(rows: list[dict], levels, tolerance: float) -> dict:
  """How many pairs carry a paired difference at a common level."""
  compared = sum(any("diff_pp" in c for c in row["comparisons"]) for row in rows)
  return {"pairs": len(rows), "compared": compared,
          "share": compared / len(rows) if rows else math.nan,
          "levels": list(levels), "tolerance": tolerance}


def report_options(config) -> dict:
  """The levels (FLOPs per cell) and tolerance of a sweep config, for `report`; empty
  levels (a sweep without them) leave `report` to derive its own."""
  return {"levels": isoflop.absolute_levels(config), "tolerance": isoflop.tolerance_of(config)}


def figure(all_points: list[Point], path: str) -> None:
  families = sorted({p.family for p in all_points})
  colors = plt.get_cmap("tab10")
  markers = itertools.cycle("osD^v<>pP*X")
  fig, ax = plt.subplots(figsize=(8, 5.5))
  for i, family in enumerate(families):
    members = [p for p in all_points if p.family == family]
    color = colors(i % 10)
    for attack in sorted({p.attack for p in members}):
      runs = [p for p in members if p.attack == attack]
      ax.scatter([p.flops for p in runs], [100 * p.recovery for p in runs], color=color,
                 marker=next(markers), label=f"{attack} ({family})", zorder=3)
    front = pareto(members)
    ax.step([p.flops for p in front], [100 * p.recovery for p in front], where="post",
            color=color, alpha=0.6, zorder=2)
  ax.set_xscale("log")
  ax.set_xlabel("FLOPs charged to the run (XLA cost analysis, shared stages included)")
  ax.set_ylabel("token recovery (%)")
  ax.set_title("Token recovery against compute; lines: Pareto frontier per family")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=7, loc="best")
  fig.tight_layout()
  fig.savefig(path, dpi=150)
  plt.close(fig)


def _knob_text(point: Point, varied: set[str]) -> str:
  return ", ".join(f"{k}={point.knobs[k]}" for k in sorted(varied) if k in point.knobs) or "—"


def report(study: str, out_dir: str, n_replicates: int = bootstrap.DEFAULT_REPLICATES,
           figure_link: str = FIGURE, levels=(), tolerance: float = isoflop.TOLERANCE
           ) -> list[str]:
  """Writes the figure, the table (JSON) and frontier.md to out_dir; returns the markdown,
  whose image links to `figure_link` (the figure's path from where the markdown lands).
  `levels`: FLOPs per cell at which attacks are compared (empty: `derived_levels`)."""
  all_points = points(study)
  if not all_points:
    raise ValueError(f"{study}: no measured run to draw")
  levels = tuple(float(x) for x in levels) or derived_levels(all_points, tolerance)
  os.makedirs(out_dir, exist_ok=True)
  figure(all_points, os.path.join(out_dir, FIGURE))
  rows = pairwise(all_points, levels, tolerance, n_replicates)
  table = level_table(all_points, levels, tolerance)
  fronts = {id(p) for family in {p.family for p in all_points}
            for p in pareto([q for q in all_points if q.family == family])}
  totals = summary(rows, levels, tolerance)
  files.atomic_write_json(os.path.join(out_dir, TABLE), {
      "points": [dict(p.to_json(), on_frontier=id(p) in fronts) for p in all_points],
      "at_levels": {attack: [None if p is None else {"cell_id": p.cell_id, "flops": p.flops,
                                                  "recovery": p.recovery} for p in runs]
                 for attack, runs in table.items()},
      "pairwise": rows, "summary": totals}, overwrite=True)
  text = "\n".join(_markdown(all_points, rows, fronts, table, levels, totals, FIGURE)) + "\n"
  files.atomic_write_bytes(os.path.join(out_dir, MARKDOWN), text.encode(), overwrite=True)
  return _markdown(all_points, rows, fronts, table, levels, totals, figure_link)


def _pp(entry: dict) -> str:
  if "diff_pp" not in entry:
    return entry.get("note", "")
  return f"{entry['diff_pp']:+.1f} [{entry['lo_pp']:+.1f}, {entry['hi_pp']:+.1f}]"


def _markdown(all_points: list[Point], rows: list[dict], fronts: set[int], table: dict,
              levels, totals: dict, figure_link: str) -> list[str]:
  """The section's lines: figure, runs (frontier points marked), recovery per level, pairs
  at common levels."""
  tolerance = totals["tolerance"]
  lines = ["## Attacks at matched FLOPs", "",
           f"![token recovery against FLOPs]({figure_link})", "",
           "| family | attack | budget | FLOPs | token recovery | on the frontier |",
           "|---|---|---|---|---|---|"]
  for attack in sorted({p.attack for p in all_points}):
    runs = [p for p in all_points if p.attack == attack]
    varied = {k for k in runs[0].knobs if len({str(p.knobs.get(k)) for p in runs}) > 1}
    for p in runs:
      lines.append(f"| {p.family} | {p.attack} | {_knob_text(p, varied)} | {p.flops:.3g} | "
                   f"{100 * p.recovery:.2f}% | {'yes' if id(p) in fronts else ''} |")
  shown = common_levels(table, levels)
  family = {p.attack: p.family for p in all_points}
  order = sorted(table, key=lambda a: (family[a], a))
  lines += ["", "### Token recovery at common FLOP levels", "",
            f"Each attack's run within a factor {tolerance:g} of each level (the nearest; "
            "recorded FLOPs, XLA's count); levels at which at least two attacks ran. "
            "Empty: no run of the attack at that level.", "",
            "| family | attack | " + " | ".join(f"{levels[i]:.3g}" for i in shown) + " |",
            "|---|---|" + "---|" * len(shown)]
  for attack in order:
    cells = [("" if table[attack][i] is None else f"{100 * table[attack][i].recovery:.1f}%")
             for i in shown]
    lines.append(f"| {family[attack]} | {attack} | " + " | ".join(cells) + " |")
  lines += ["", "### Pairs at common FLOP levels", "",
            f"{totals['compared']} of {totals['pairs']} pairs compared at a common level "
            f"({100 * totals['share']:.0f}%). Per level, B - A in percentage points of token "
            f"recovery with a {int(100 * CONFIDENCE)}% paired bootstrap interval over "
            "documents; a pair without a common level says why.", "",
            "| A | B | " + " | ".join(f"{levels[i]:.3g}" for i in shown) + " | note |",
            "|---|---|" + "---|" * (len(shown) + 1)]
  for row in rows:
    by_level = {c["level"]: c for c in row["comparisons"]}
    cells = [_pp(by_level[levels[i]]) if levels[i] in by_level else "" for i in shown]
    lines.append(f"| {row['a']} | {row['b']} | " + " | ".join(cells)
                 + f" | {row.get('note', '')} |")
  return lines
