"""FLOP-matched comparison of attacks: token recovery against recorded FLOPs.

From a sweep's study (configs/sweep.py:frontier runs every attack family at several
budgets on one capture) it draws each run as a point (x: the FLOPs its record was charged,
log scale; y: token recovery on its scored positions) with a Pareto frontier per family
(the runs no cheaper run of the family beats), and compares every pair of attacks at equal
FLOPs: at F = the smaller of the two attacks' largest budgets, each attack's best run that
spent at most F, and the paired difference of their per-document recovery with a
percentile bootstrap interval over documents (lla.scoring.bootstrap; marginal 95%
intervals, not corrected for the number of pairs).

`report(study, out_dir)` writes frontier.png, frontier.json and frontier.md and returns
the markdown lines (for the main job's report).
"""

from __future__ import annotations

import dataclasses
import itertools
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from lla.evidence import files, rundir  # noqa: E402
from lla.evidence.records import AttackRecord  # noqa: E402
from lla.scoring import bootstrap, metrics  # noqa: E402
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


def _best_within(runs: list[Point], flops: float) -> Point | None:
  affordable = [p for p in runs if p.flops <= flops]
  return max(affordable, key=lambda p: (p.recovery, -p.flops)) if affordable else None


def pairwise(all_points: list[Point],
             n_replicates: int = bootstrap.DEFAULT_REPLICATES) -> list[dict]:
  """Every pair of attacks compared at equal FLOPs (see the module doc)."""
  by_attack = {}
  for point in all_points:
    by_attack.setdefault(point.attack, []).append(point)
  rows = []
  for a, b in itertools.combinations(sorted(by_attack), 2):
    cap = min(max(p.flops for p in by_attack[a]), max(p.flops for p in by_attack[b]))
    pa, pb = _best_within(by_attack[a], cap), _best_within(by_attack[b], cap)
    row = {"a": a, "b": b, "flops_cap": cap}
    if pa is None or pb is None:
      row["note"] = "no run of one of them within the other's largest budget"
    elif pa.truth_sha256 != pb.truth_sha256:
      row["note"] = "runs on different documents: not paired"
    else:
      diff = (pb.per_document - pa.per_document)[None, :]
      interval = bootstrap.interval(diff, CONFIDENCE, n_replicates, scale=100.0)
      row.update(a_flops=pa.flops, a_recovery=pa.recovery, a_cell=pa.cell_id,
                 b_flops=pb.flops, b_recovery=pb.recovery, b_cell=pb.cell_id,
                 diff_pp=interval["estimate"], lo_pp=interval["lo"], hi_pp=interval["hi"])
    rows.append(row)
  return rows


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
           figure_link: str = FIGURE) -> list[str]:
  """Writes the figure, the table (JSON) and frontier.md to out_dir; returns the markdown,
  whose image links to `figure_link` (the figure's path from where the markdown lands)."""
  all_points = points(study)
  if not all_points:
    raise ValueError(f"{study}: no measured run to draw")
  os.makedirs(out_dir, exist_ok=True)
  figure(all_points, os.path.join(out_dir, FIGURE))
  rows = pairwise(all_points, n_replicates)
  fronts = {id(p) for family in {p.family for p in all_points}
            for p in pareto([q for q in all_points if q.family == family])}
  files.atomic_write_json(os.path.join(out_dir, TABLE),
                          {"points": [dict(p.to_json(), on_frontier=id(p) in fronts)
                                      for p in all_points], "pairwise": rows},
                          overwrite=True)
  text = "\n".join(_markdown(all_points, rows, fronts, FIGURE)) + "\n"
  files.atomic_write_bytes(os.path.join(out_dir, MARKDOWN), text.encode(), overwrite=True)
  return _markdown(all_points, rows, fronts, figure_link)


def _markdown(all_points: list[Point], rows: list[dict], fronts: set[int],
              figure_link: str) -> list[str]:
  """The section's lines: figure, runs (frontier points marked), pairs at equal FLOPs."""
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
  lines += ["", f"Pairs at equal FLOPs: each attack's best run within the cap F (the smaller "
            f"of the two largest budgets); B - A in percentage points with a "
            f"{int(100 * CONFIDENCE)}% paired bootstrap interval over documents.", "",
            "| A | B | F | A: FLOPs, recovery | B: FLOPs, recovery | B - A (pp) |",
            "|---|---|---|---|---|---|"]
  for row in rows:
    if "note" in row:
      lines.append(f"| {row['a']} | {row['b']} | {row['flops_cap']:.3g} | — | — | "
                   f"{row['note']} |")
      continue
    lines.append(f"| {row['a']} | {row['b']} | {row['flops_cap']:.3g} | "
                 f"{row['a_flops']:.3g}, {100 * row['a_recovery']:.2f}% | "
                 f"{row['b_flops']:.3g}, {100 * row['b_recovery']:.2f}% | "
                 f"{row['diff_pp']:+.2f} [{row['lo_pp']:+.2f}, {row['hi_pp']:+.2f}] |")
  return lines
