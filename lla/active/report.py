"""The main job's "active server" section: tables and figures from an active workdir.

  lines = section(active_dir, out_dir)   # markdown lines; PNGs written into out_dir
  path = write(active_dir, out_dir)      # the same as out_dir/active_server.md

Reads `summary.json` (lla.active.run) and, if present, `decoy_probe/decoy_probe.json`
(lla.active.decoy_probe). Figures: token recovery against hijacked steps, the client's task
loss against steps, and every detector's alarm score against steps with its threshold.
"""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from lla.active import detectors  # noqa: E402
from lla.evidence import files  # noqa: E402

SUMMARY, PROBE = "summary.json", "decoy_probe/decoy_probe.json"
COLOURS = {"honest": "tab:green", "fsha": "tab:red"}


def _pct(x) -> str:
  return "n/a" if x is None else f"{100 * x:.2f}%"


def _colour(server: str) -> str:
  return COLOURS.get(server, "tab:orange")


def recovery_table(summary: dict) -> list[str]:
  rows = summary["recovery"]
  steps = sorted({r["step"] for r in rows})
  out = ["| server | attack (knowledge) | " + " | ".join(f"N = {s}" for s in steps) +
         " | baseline p0 |", "|" + "---|" * (len(steps) + 3)]
  keys = sorted({(r["server"], r["attack"]) for r in rows})
  for server, attack in keys:
    cells = {r["step"]: r for r in rows if r["server"] == server and r["attack"] == attack}
    knowledge = "none" if attack == "fsha_decode" else "trained"
    base = next((c["baseline"] for c in cells.values() if c["baseline"] is not None), None)
    out.append(f"| {server} | {attack} ({knowledge}) | " + " | ".join(
        _pct(cells[s]["token_recovery"]) if s in cells else "-" for s in steps) +
               f" | {_pct(base)} |")
  return out


def loss_table(summary: dict) -> list[str]:
  rows = summary["task_loss"]
  steps = sorted({r["step"] for r in rows})
  out = ["| server | tail | " + " | ".join(f"N = {s}" for s in steps) + " |",
         "|" + "---|" * (len(steps) + 2)]
  for server in sorted({r["server"] for r in rows}):
    cells = {r["step"]: r for r in rows if r["server"] == server}
    for key, tail in (("task_loss", "served"), ("public_tail_loss", "public pre-trained")):
      if key == "task_loss" and server == "fsha":
        tail = "none trained: public pre-trained"
      out.append(f"| {server} | {tail} | " +
                 " | ".join(f"{cells[s][key]:.3f}" for s in steps) + " |")
  return out


def progress_table(summary: dict) -> list[str]:
  rows = summary.get("hijack_progress", [])
  steps = sorted({r["step"] for r in rows})
  out = ["| server | " + " | ".join(f"N = {s}" for s in steps) + " |",
         "|" + "---|" * (len(steps) + 1)]
  for server in sorted({r["server"] for r in rows}):
    cells = {r["step"]: r["critic_gap"] for r in rows if r["server"] == server}
    out.append(f"| {server} | " + " | ".join(f"{cells[s]:+.2f}" for s in steps) + " |")
  return out


def detection_table(summary: dict) -> list[str]:
  out = ["| detector | threshold (alarm score) | calibration windows | server | fired / "
         "windows | rate | Wilson upper | runs detected | first firing step per seed |",
         "|" + "---|" * 9]
  for name, det in summary["detection"].items():
    for server, r in sorted((k, v) for k, v in det.items() if k != "threshold"):
      what = "false alarms" if server == "honest" else "detections"
      out.append(
          f"| {name} | {det['threshold']:.4f} | {summary['calibration_windows'][name]} | "
          f"{server} ({what}) | {r['fired']} / {r['windows']} | {_pct(r['rate'])} | "
          f"{_pct(r['wilson_upper'])} | {r['runs_detected']} / {r['runs']} | "
          f"{', '.join('-' if s is None else str(s) for s in r['first_steps'])} |")
  return out


def _label(curve: dict) -> str:
  return f"mixed{curve['beta']:g}" if curve["kind"] == "mixed" else curve["kind"]


def separation_table(summary: dict) -> list[str]:
  """AUC and the empirical detection rate above every judged honest window, per detector
  and malicious server (threshold-free, computed from the stored windows)."""
  out = ["| detector | server | AUC (malicious vs honest windows) | detected above every "
         "honest window |", "|---|---|---|---|"]
  for name in summary["detection"]:
    scores = {}
    for curve in summary["curves"].values():
      scores.setdefault(_label(curve), []).extend(s for _, s in curve["windows"][name])
    for server in sorted(k for k in scores if k != "honest"):
      sep = detectors.separation(scores.get("honest", []), scores[server])
      auc = "n/a" if sep["auc"] is None else f"{sep['auc']:.3f}"
      out.append(f"| {name} | {server} | {auc} | {_pct(sep['tpr_above_honest'])} |")
  return out


def probe_table(probe: dict) -> list[str]:
  out = ["| mitigation | amplitude a | seeds | probe row agreement | passive (by norm) | "
         "chance | probe exact frames | TLN held-out CE increase (nats) | train-loss increase |",
         "|" + "---|" * 9]
  for r in probe["table"]:
    out.append(f"| {r['mitigation']} | {r['amplitude']:g} | {r['seeds']} | "
               f"{_pct(r['probe_agreement'])} | {_pct(r['passive_agreement'])} | "
               f"{_pct(r['chance'])} | {r['frames_exact']} / {r['frames']} | "
               f"{r['ce_increase']:+.4f} | {r['loss_increase']:+.4f} |")
  return out


def recovery_figure(summary: dict, path: pathlib.Path) -> None:
  fig, (ax_rec, ax_loss) = plt.subplots(1, 2, figsize=(11, 4))
  for server, attack in sorted({(r["server"], r["attack"]) for r in summary["recovery"]}):
    rows = sorted((r for r in summary["recovery"]
                   if r["server"] == server and r["attack"] == attack), key=lambda r: r["step"])
    points = [(r["step"], 100 * r["token_recovery"]) for r in rows
              if r["token_recovery"] is not None]
    if points:
      ax_rec.plot(*zip(*points), marker="o", color=_colour(server),
                  linestyle="-" if attack == "fsha_decode" else ("--" if attack == "activation"
                                                                 else ":"),
                  label=f"{server}: {attack}")
  ax_rec.set_xlabel("hijacked (or honest) steps N")
  ax_rec.set_ylabel("token recovery (%)")
  ax_rec.legend(fontsize=7)
  ax_rec.grid(alpha=0.3)
  for server in sorted({r["server"] for r in summary["task_loss"]}):
    rows = sorted((r for r in summary["task_loss"] if r["server"] == server),
                  key=lambda r: r["step"])
    ax_loss.plot([r["step"] for r in rows], [r["task_loss"] for r in rows], marker="o",
                 color=_colour(server), label=server)
  ax_loss.set_xlabel("steps N")
  ax_loss.set_ylabel("client's held-out CE (nats)")
  ax_loss.legend(fontsize=7)
  ax_loss.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def detection_figure(summary: dict, path: pathlib.Path) -> None:
  names = list(summary["detection"])
  fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
  for ax, name in zip(axes[0], names):
    seen = set()
    for curve in summary["curves"].values():
      server = curve["kind"] if curve["kind"] != "mixed" else f"mixed{curve['beta']:g}"
      points = curve["windows"][name]
      if points:
        ax.plot(*zip(*points), marker=".", color=_colour(server), alpha=0.7,
                label=None if server in seen else server)
        seen.add(server)
    ax.axhline(summary["detection"][name]["threshold"], color="black", linestyle="--",
               label="threshold (calibration q0.99)")
    ax.set_yscale("symlog", linthresh=1e-3)  # Honest and mixed scores sit near 0.
    ax.set_ylim(bottom=0.0)
    ax.set_title(name)
    ax.set_xlabel("training step")
    ax.set_ylabel("alarm score (symlog)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def probe_figure(probe: dict, path: pathlib.Path) -> None:
  fig, ax = plt.subplots(figsize=(5.5, 4))
  for arm, style in (("none", "-"), ("mitigated", "--")):
    rows = sorted((r for r in probe["table"] if r["mitigation"] == arm),
                  key=lambda r: r["amplitude"])
    ax.plot([r["ce_increase"] for r in rows], [100 * r["probe_agreement"] for r in rows],
            marker="o", linestyle=style, label=f"probe, mitigation {arm}")
    for r in rows:
      ax.annotate(f"a={r['amplitude']:g}", (r["ce_increase"], 100 * r["probe_agreement"]),
                  fontsize=7)
  ax.axhline(100 * probe["table"][0]["chance"], color="gray", linestyle=":", label="chance")
  ax.set_xlabel("TLN held-out CE increase (nats)")
  ax.set_ylabel("real/decoy row agreement (%)")
  ax.legend(fontsize=7)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def section(active_dir, out_dir) -> list[str]:
  """Markdown lines of the section; its figures are written into `out_dir`."""
  active_dir, out_dir = pathlib.Path(active_dir), pathlib.Path(out_dir)
  if not (active_dir / SUMMARY).exists():
    return ["Not run: no active/summary.json (this section is unmeasured)."]
  summary = files.read_json(str(active_dir / SUMMARY))
  out_dir.mkdir(parents=True, exist_ok=True)
  recovery_figure(summary, out_dir / "active_recovery.png")
  detection_figure(summary, out_dir / "active_detection.png")
  lines = [
      "A malicious server returns crafted gradients instead of dL/dh while the client "
      "fine-tunes its layers (knowledge `trained`). FSHA (Pasquini et al., CCS'21) as "
      "published: WGAN-GP critic, pilot and decoder trained on public WikiText-2 text "
      "disjoint from the client's documents, no client weights (knowledge `none`); "
      "`mixed<beta>` returns (1-beta) g_task + beta |g_task|/|g_adv| g_adv per row. At each "
      "step N the client's evaluation documents are captured through its frozen layers and "
      "replayed: `fsha_decode` on hijacked captures, the passive ridge + beam attacks "
      "under `trained` knowledge on the same documents.", "",
      "### Token recovery against steps N (pooled over seeds)", "", *recovery_table(summary),
      "", "### The client's task loss (held-out CE of its layers and a tail)", "",
      "`served`: the tail the server trains for the task (FSHA as published trains none, so "
      "its client is served the public pre-trained tail); `public pre-trained`: the same "
      "fixed tail for every server.", "",
      *loss_table(summary), "", "![recovery and task loss](active_recovery.png)", "",
      "The critic's gap D(h) - D(pilot features) at step N-1 (mean over seeds): a hijack "
      "that converges drives it to 0. The decoder inverts "
      f"{_pct(summary.get('pilot_self_inversion'))} of its own pilot's features (on "
      "public documents), so what it fails to invert is the client's h.", "",
      *progress_table(summary), "",
      "### Client-side detection at thresholds fixed on calibration honest seeds", "",
      f"Thresholds sha256 `{summary['thresholds_sha256'][:16]}...`: the 0.99 quantile of "
      "the calibration runs' alarm scores. A window fires when its score exceeds the "
      "threshold; on honest runs a firing is a false alarm, on malicious ones a detection. "
      "The Wilson bound is one-sided at 95%.", "", *detection_table(summary), "",
      "Threshold-free, on the judged runs' windows:", "", *separation_table(summary), "",
      "![detection curves](active_detection.png)"]
  card_path = active_dir / "study" / "scorecard.json"
  if card_path.exists():
    coverage = files.read_json(str(card_path))["coverage"]
    lines += ["", "### Coverage of this study by tier (study/scorecard.md)", "",
              "| tier | covered | partial | unmeasured | out of scope |", "|---|---|---|---|---|"]
    lines += [f"| {tier} | {n['covered']} | {n['partial']} | {n['unmeasured']} | "
              f"{n['out of scope']} |" for tier, n in sorted(coverage["tiers"].items())]
  if (active_dir / PROBE).exists():
    probe = files.read_json(str(active_dir / PROBE))
    probe_figure(probe, out_dir / "active_decoy_probe.png")
    lines += ["", "### Decoy-row split: the cloud's active probe (PROTOCOL section 7)", "",
              "The cloud adds a secret unit vector at amplitude a to each output row and "
              "ranks rows by <g_r, u_r>; the top 32 of 80 are predicted real. Passive control: "
              "ranking by |g_r| on the same frames.", "", *probe_table(probe), "",
              "![decoy probe](active_decoy_probe.png)"]
  return lines


def write(active_dir, out_dir) -> pathlib.Path:
  """out_dir/active_server.md with the section and its figures."""
  out_dir = pathlib.Path(out_dir)
  lines = ["# Active server", "", *section(active_dir, out_dir)]
  path = out_dir / "active_server.md"
  path.write_text("\n".join(lines) + "\n")
  return path
