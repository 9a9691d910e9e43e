"""report.md of a main-table study: every number read from the study's scorecard.json.

The report is a view: it computes nothing that the scorecard does not hold, so
`experiments/rescore.py` re-derives every number in it from predictions and ground truth.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from lla.active import report as active_report  # noqa: E402
from lla.evidence import rundir  # noqa: E402
from lla.sweep import frontier as flops_frontier  # noqa: E402
from lla.scoring import scorecard  # noqa: E402
from lla.study import seed_figures  # noqa: E402
from lla.model import loading  # noqa: E402

REPORT_FILE = "report.md"


def _pct(x) -> str:
  return "—" if x is None else f"{100 * x:.2f}%"


def _pp(x) -> str:
  return "—" if x is None else f"{x:+.2f}"


def main_rows(card: dict) -> list[tuple[dict, str, dict]]:
  """(config, attack, pooled metrics) of the undefended WikiText-2 settings."""
  rows = []
  for group in card["undefended"]:
    if group["config"]["corpus"].startswith("wikitext"):
      for attack, metrics in sorted(group["pooled"].items()):
        rows.append((group["config"], attack, metrics))
  return sorted(rows, key=lambda r: (-r[0]["cut"], r[0]["knowledge"], r[1]))


def main_table(card: dict) -> list[str]:
  lines = ["| k | knowledge | attack | token rec. | exact doc | baseline p0 | n | U95 | "
           "excess pp | seed figure (GPT-2 124M) |", "|" + "---|" * 10]
  for config, attack, m in main_rows(card):
    seed = seed_figures.TOKEN_RECOVERY.get(attack) if (
        config["cut"] == 6 and config["knowledge"] == "public") else None
    lines.append(
        f"| {config['cut']} | {config['knowledge']} | {attack} | {_pct(m['token_recovery'])} | "
        f"{_pct(m['exact_doc_recovery'])} | {_pct(m['baseline_p0'])} | {m['n']} | "
        f"{_pct(m['wilson_upper'])} | {_pp(m['excess_pp'])} | {_pct(seed)} |")
  return lines


def _flops(x) -> str:
  return "—" if x is None else f"{x:.3g}"


def attack_table(card: dict, cut: int) -> list[str]:
  """Every attack at the primary setting (k = cut, undefended WikiText-2), per knowledge:
  what it needs, token accuracy, exact documents, ROUGE-L, FLOPs and wall time per
  document, and the published figure beside ours where one exists."""
  modules = {m["name"]: m for m in (card["inputs"].get("modules") or [])}
  lines = ["| attack | family | needs | knowledge | token acc. | exact doc | ROUGE-L tokens | "
           "ROUGE-L text | token-set F1 | FLOPs / doc | wall s / doc | published (metric, "
           "setting) |", "|" + "---|" * 12]
  for group in card["undefended"]:
    config = group["config"]
    if config["cut"] != cut or not config["corpus"].startswith("wikitext"):
      continue
    for key, m in sorted(group["pooled"].items()):
      name = key.split("[")[0]
      rows = [r for r in card["rows"] if r["attack"] == name and r["metrics"] is not None
              and r["defense"] == "none" and r["cut"] == cut
              and r["knowledge"] == config["knowledge"] and r["corpus"] == config["corpus"]]
      docs = sum(r["metrics"]["docs"] for r in rows) or 1
      flops = (None if any(r["flops"] is None for r in rows)
               else sum(r["flops"] for r in rows) / docs)
      wall = sum(r["wall_s"] or 0.0 for r in rows) / docs
      sim = group.get("similarity", {}).get(key, {})
      module = modules.get(name, {})
      needs = "+".join(module.get("requires", [])) or "—"
      published = seed_figures.PUBLISHED.get(name)
      cite = "—" if published is None else (f"{_pct(published[0])} ({published[1]}; "
                                            f"{published[2]})")
      lines.append(
          f"| {key} | {module.get('family', '—')} | {needs} | {config['knowledge']} | "
          f"{_pct(m['token_recovery'])} | {_pct(m['exact_doc_recovery'])} | "
          f"{_pct(sim.get('rouge_l_tokens'))} | {_pct(sim.get('rouge_l_text'))} | "
          f"{_pct(sim.get('token_set_f1'))} | {_flops(flops)} | {wall:.3f} | {cite} |")
  return lines


def corpus_table(card: dict, cut: int) -> list[str]:
  lines = ["| corpus | k | ridge token rec. | frequency baseline | exact doc | n | "
           "seed figure (rec. / baseline) |", "|" + "---|" * 7]
  for group in card["undefended"]:
    ridge = group["pooled"].get("ridge")
    corpus = group["config"]["corpus"]
    if (ridge is None or group["config"]["knowledge"] != "public"
        or group["config"]["cut"] != cut or group["config"]["defense"] != "none"):
      continue
    seed = seed_figures.CORPUS_STUDY.get(corpus)
    seed_text = "—" if seed is None else f"{_pct(seed[0])} / {_pct(seed[1])}"
    lines.append(f"| {corpus} | {group['config']['cut']} | {_pct(ridge['token_recovery'])} | "
                 f"{_pct(ridge['baseline_p0'])} | {_pct(ridge['exact_doc_recovery'])} | "
                 f"{ridge['n']} | {seed_text} |")
  return lines


def _interval(entry: dict) -> str:
  return f"[{entry['lo']:+.2f}, {entry['hi']:+.2f}]"


def _contrast_name(name: str) -> str:
  return " − ".join(name.split("-", 1)) if "-" in name else name


def contrasts(card: dict) -> list[str]:
  """The primary test and the secondary contrasts as one table, then the verdict."""
  if card["contrasts"] is None:
    return ["Not computed for this scorecard."]
  test = card["contrasts"]["test"]
  setting = f"k = {test['cut']}, {test['knowledge']} knowledge"
  lines = ["| contrast | corpus | estimate (pp) | interval (pp) | threshold | passed |",
           "|---|---|---|---|---|---|"]
  verdicts = []
  for entry in card["contrasts"]["primary"]:
    name = f"**primary**: {test['treatment']} − {test['control']} ({setting})"
    if not entry.get("evaluated"):
      lines.append(f"| {name} | {entry.get('corpus', '—')} | — | — | lower bound > "
                   f"{test['lower_bound_above_pp']:+.1f} | not evaluated |")
      verdicts.append(f"The pre-registered primary test ({test['name']}) was not evaluated: "
                      f"{entry.get('reason')}.")
      continue
    level = f"{100 * entry['confidence']:.0f}%"
    lines.append(f"| {name} | {entry['corpus']} | {entry['estimate']:+.2f} | "
                 f"{_interval(entry)} ({level}) | lower bound > "
                 f"{entry['threshold_pp']:+.1f} | {'yes' if entry['passed'] else 'no'} |")
    verdicts.append(
        f"The pre-registered primary test ({test['treatment']} minus {test['control']} "
        f"token recovery, {setting}, corpus {entry['corpus']}, {entry['models']} models x "
        f"{entry['documents']} documents) is {'met' if entry['passed'] else 'not met'}: "
        f"{entry['estimate']:+.2f} pp, {level} interval {_interval(entry)} "
        f"{'lies above' if entry['passed'] else 'does not lie above'} "
        f"{entry['threshold_pp']:+.1f} pp.")
  for entry in card["contrasts"]["secondary"]:
    name = f"secondary: {_contrast_name(entry['contrast'])}"
    if entry.get("evaluated") is False:
      lines.append(f"| {name} | {entry.get('corpus', '—')} | — | — | — | not evaluated: "
                   f"{entry.get('reason')} |")
      continue
    level = (f"{100 * entry['confidence']:.2f}%, Bonferroni over "
             f"{entry['bonferroni_k']}")
    lines.append(f"| {name} | {entry['corpus']} | {entry['estimate']:+.2f} | "
                 f"{_interval(entry)} ({level}) | — (reported, no threshold) | — |")
  if len(lines) == 2:
    return ["No contrast evaluated."]
  return lines + [""] + verdicts


def recovery_figure(card: dict, path: pathlib.Path) -> None:
  """Exact-document against token recovery, one point per (setting, attack)."""
  fig, ax = plt.subplots(figsize=(6, 4.5))
  for config, attack, m in main_rows(card):
    ax.scatter(100 * m["token_recovery"], 100 * m["exact_doc_recovery"], s=18)
    ax.annotate(f"{attack} k{config['cut']} {config['knowledge'][0]}",
                (100 * m["token_recovery"], 100 * m["exact_doc_recovery"]), fontsize=6)
  ax.set_xlabel("token recovery (%)")
  ax.set_ylabel("exact document recovery (%)")
  ax.set_title("Exact-document against token recovery (k, public/trained)")
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def defense_label(defense: str, params: dict) -> tuple[str, object]:
  """(label, strength) of a gated configuration in the verdict table: the main job's own
  label (`name_paramvalue`), or for the decoy-row split its arm (the mitigation, with the
  clip and noise of the mitigated arm), or the defense's name."""
  if "label" in params:
    return params["label"], params.get("strength")
  if "mitigation" in params:
    arm = params["mitigation"]
    strength = (f"clip {params['grad_clip']:g}, noise {params['grad_noise']:g}"
                if "grad_clip" in params and "grad_noise" in params else "none")
    return f"{defense} (arm: {arm})", strength
  return defense, params.get("strength")


def _defense_points(card: dict, utility: dict) -> list[dict]:
  """One point per gated defense configuration: label, envelope, exact-doc, CE cost."""
  points = []
  for gate in card["gates"]:
    params = gate["config"]["defense_params"]
    label, strength = defense_label(gate["config"]["defense"], params)
    costs = [u["cross_entropy_increase"]["value"] for key, u in utility.items()
             if key.startswith(label + "/")]
    pooled = gate["pooled"].values()
    points.append({
        "defense": gate["config"]["defense"], "label": label, "cut": gate["config"]["cut"],
        "strength": strength, "decision": gate["decision"],
        "reasons": gate["reasons"], "n_seeds": gate["n_seeds"],
        "envelope_pp": (gate["envelope"] or {}).get("envelope_pp"),
        "envelope_by": (gate["envelope"] or {}).get("argmax"),
        "floor_pp": (gate["envelope"] or {}).get("floor_pp"),
        "exact_doc": max((m["exact_doc_recovery"] for m in pooled), default=None),
        "token": max((m["token_recovery"] for m in pooled), default=None),
        "ce_increase": sum(costs) / len(costs) if costs else None,
        "ce_increase_per_seed": costs,
    })
  return sorted(points, key=lambda p: (p["defense"], _weakest_first(p), p["label"]))


def _weakest_first(point: dict) -> float:
  """Sort key: the defense's own strength (larger is stronger: 1 / epsilon for an epsilon,
  so epsilon-parameterised defenses run from large epsilon to small); a configuration
  without a numeric strength (the decoy-row arms) last."""
  strength = point["strength"]
  numeric = isinstance(strength, (int, float)) and not isinstance(strength, bool)
  return float(strength) if numeric else float("inf")


def _strength(strength) -> str:
  if strength is None:
    return "—"
  return f"{strength:.4g}" if isinstance(strength, float) else str(strength)


def defense_table(points: list[dict]) -> list[str]:
  lines = ["| defense | strength (larger is stronger; 1/epsilon for an epsilon) | decision | "
           "envelope pp | set by | floor pp | best token rec. | best exact doc | CE increase "
           "(nats, mean over seeds) | seeds | reasons |", "|" + "---|" * 11]
  for p in points:
    ce = "—" if p["ce_increase"] is None else f"{p['ce_increase']:+.4f}"
    lines.append(f"| {p['label']} | {_strength(p['strength'])} | **{p['decision']}** | "
                 f"{_pp(p['envelope_pp'])} | {p['envelope_by'] or '—'} | {_pp(p['floor_pp'])} | "
                 f"{_pct(p['token'])} | "
                 f"{_pct(p['exact_doc'])} | {ce} | {p['n_seeds']} | "
                 f"{'; '.join(p['reasons'])} |")
  return lines


def frontier_figure(points: list[dict], path: pathlib.Path) -> None:
  """Privacy (envelope, exact-document recovery) against utility cost, one curve per defense
  drawn from its weakest configuration to its strongest (the defense's own strength, so an
  epsilon runs from large to small)."""
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
  markers = {"PASS": "o", "FAIL": "x", "INSUFFICIENT_EVIDENCE": "s"}
  for name in sorted({p["defense"] for p in points}):
    curve = sorted((p for p in points if p["defense"] == name and p["ce_increase"] is not None),
                   key=_weakest_first)
    if not curve:
      continue
    for ax, key, scale in ((axes[0], "envelope_pp", 1.0), (axes[1], "exact_doc", 100.0)):
      xs = [p["ce_increase"] for p in curve]
      ys = [scale * p[key] for p in curve]
      line, = ax.plot(xs, ys, "-", alpha=0.6, label=name)
      for x, y, p in zip(xs, ys, curve):
        ax.scatter([x], [y], marker=markers[p["decision"]], color=line.get_color(), zorder=3)
  axes[0].axhline(1.0, color="k", lw=0.8, ls="--")
  axes[0].set_ylabel("attack envelope (pp over baseline, Wilson U95)")
  axes[1].set_ylabel("exact document recovery (%)")
  for ax in axes:
    ax.set_xlabel("held-out cross-entropy increase (nats)")
    ax.grid(alpha=0.3)
  if axes[0].get_legend_handles_labels()[0]:  # No curve: no defense had a utility cost.
    axes[0].legend(fontsize=7, title="o PASS  x FAIL  s INSUFFICIENT", title_fontsize=7)
  fig.suptitle("Privacy-utility frontier")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def cost_table(card: dict) -> list[str]:
  lines = ["| run | FLOPs | source | wall s |", "|---|---|---|---|"]
  for row in card["rows"]:
    flops = "—" if row["flops"] is None else f"{row['flops']:.3g}"
    wall = "—" if row["wall_s"] is None else f"{row['wall_s']:.1f}"
    lines.append(f"| {row['run_id']} | {flops} | {row['flops_source']} | {wall} |")
  return lines


def decoy_section(workdir: pathlib.Path, out: pathlib.Path) -> list[str]:
  """The decoy-row experiment's own table (lla.decoy.report) and dose-response figure."""
  decoy = workdir / "decoy"
  if not (decoy / "results.md").exists():
    return ["Not run: no decoy/results.md (this section is unmeasured)."]
  lines = [(decoy / "results.md").read_text()]
  if (decoy / "dose_response.png").exists():
    shutil.copyfile(decoy / "dose_response.png", out / "dose_response.png")
    lines += ["", "![dose response](dose_response.png)"]
  return lines


def phase_table(invocations: list[dict]) -> list[str]:
  """Minutes per phase of each invocation (timing.json; a phase ends where the next, or
  the invocation, does); of them, the seconds this process spent compiling (JAX's
  tracing, lowering and backend compilation, lla.runtime.compile_totals) and the rest;
  the executables it built, and how many of those the persistent compilation cache gave;
  the process's peak RSS by the phase's end (where it rises, the phase holds the peak) and
  malloc's bytes in use at its end (what the job still holds). "—" where timing.json
  predates the measurement or malloc is not glibc's."""
  lines = ["| invocation | phase | minutes | compile s | run s | executables (from cache) | "
           "peak RSS by its end (GB) | malloc in use at its end (GB) |",
           "|---|---|---|---|---|---|---|---|"]
  gb = lambda mb: "—" if mb is None else f"{mb / 1024:.1f}"
  for number, inv in enumerate(invocations, 1):
    phases = inv.get("phases", [])
    ends = [p["started_unix"] for p in phases[1:]] + [inv.get("finished_unix")]
    at_end = phases[1:] + [inv]
    for phase, end, after in zip(phases, ends, at_end):
      seconds = None if end is None else end - phase["started_unix"]
      minutes = "—" if seconds is None else f"{seconds / 60:.1f}"
      compile_s = run_s = executables = "—"
      if seconds is not None and "compile" in phase and "compile" in after:
        spent = {key: after["compile"][key] - phase["compile"][key] for key in phase["compile"]}
        spent_s = spent["trace_s"] + spent["lower_s"] + spent["backend_s"]
        compile_s, run_s = f"{spent_s:.0f}", f"{seconds - spent_s:.0f}"
        executables = f"{spent['executables']} ({spent['cache_hits']})"
      lines.append(f"| {number} | {phase['name']} | {minutes} | {compile_s} | {run_s} | "
                   f"{executables} | {gb(after.get('peak_rss_mb'))} | "
                   f"{gb((after.get('heap') or {}).get('in_use_mb'))} |")
  return lines


def flop_frontier_section(config, workdir: pathlib.Path, out: pathlib.Path) -> list[str]:
  """The FLOP-matched frontier of the main job's sweep (lla.sweep.frontier), drawn into
  out/flops_frontier."""
  study = workdir / "frontier" / "study"
  if not config.frontier.enabled or not study.exists():
    return ["## Attacks at matched FLOPs", "",
            "Not run (`config.frontier.enabled` is False)." if not config.frontier.enabled
            else f"Not run: {study} does not exist."]
  cells = config.frontier.sweep.cell
  return [*flops_frontier.report(str(study), str(out / "flops_frontier"),
                                 figure_link="flops_frontier/" + flops_frontier.FIGURE,
                                 **flops_frontier.report_options(config.frontier.sweep)),
          "", f"(Sweep of its own under `frontier/`: the first fine-tuned model at k = "
          f"{cells.cut}, {cells.knowledge} knowledge, undefended, {cells.data.n_eval} documents "
          "per cell.)"]


def _weights_note(model) -> str:
  """Where a published model's weights came from, when they are not an lla checkpoint."""
  if loading.first_source(model) in ("gguf", "gguf_package"):
    return (f" (GGUF file {model.get('gguf') or 'of the package ' + model.gguf_package}, "
            "dequantised to float32; its own tokenizer)")
  return f" (hf_dir {model.hf_dir})" if model.get("hf_dir") else ""


def seal_line(study: pathlib.Path) -> str:
  """The study's seal hash (lla.evidence.rundir.anchor): what to publish beside the report,
  and the command that checks the study against it."""
  anchor = rundir.anchor(str(study))
  if anchor is None:
    return "Seal: none (the study is not sealed; `experiments.verify` fails on it)."
  card = study / rundir.SCORECARD_JSON
  changed = scorecard.stale(str(study), json.loads(card.read_text())) if card.exists() else []
  stale = (f"**Stale scorecard**: {scorecard.stale_line(str(study), changed)}; the verdicts "
           "below are of the study before those files. " if changed else "")
  return (stale + f"Seal: `{anchor['hash']}` (log entry {anchor['index']}); publish it with the "
          f"results: `python -m experiments.verify --workdir={study} --expect={anchor['hash']}` "
          "fails on any study that does not end with this seal.")


def render(config, workdir) -> pathlib.Path:
  """Writes workdir/report/report.md (+ PNGs) from workdir/study/scorecard.json."""
  workdir = pathlib.Path(workdir)
  card = json.loads((workdir / "study" / "scorecard.json").read_text())
  out = workdir / "report"
  out.mkdir(exist_ok=True)
  recovery_figure(card, out / "recovery.png")
  # The study's own file, read through its log (lla.study.defense_sweep.UTILITY_FILE).
  utility = rundir.read_logged_json(str(workdir / "study"),
                                    f"{rundir.INPUTS}/defense_utility.json") or {}
  points = _defense_points(card, utility)
  (out / "frontier.json").write_text(json.dumps(points, indent=1, sort_keys=True) + "\n")
  frontier_figure(points, out / "frontier.png")
  timing = workdir / "timing.json"
  invocations = json.loads(timing.read_text())["invocations"] if timing.exists() else []
  finished = [i["finished_unix"] for i in invocations if i["finished_unix"]]
  wall = finished[-1] - invocations[0]["started_unix"] if finished else None
  scorecard_md = scorecard.markdown(card)
  lines = [
      f"# lla main table ({config.variant})", "",
      f"**Unmeasured share of the declared threat space: {100 * card['unmeasured_share']:.1f}%** "
      "(coverage report below).", "",
      f"Target: {config.model.name}{_weights_note(config.model)}, (k, knowledge) "
      f"{[tuple(s) for s in config.settings]}, "
      f"{config.finetune.num_models} "
      f"fine-tuned models, {config.data.n_eval} evaluation documents of T = {config.data.seq_len}. "
      f"Scorecard `{card['e_hash'][:16]}`; wall time "
      f"{'—' if wall is None else f'{wall / 60:.1f} min'} elapsed over {len(invocations)} "
      f"invocation(s) (each interruption and resume adds one).", "",
      seal_line(workdir / "study"), "",
      "## Main table (pooled over models and attack seeds)", "", *main_table(card), "",
      seed_figures.why_different(config.model), "",
      f"## Every attack at the primary setting (k = {config.primary_cut}, undefended)", "",
      "Token accuracy and exact documents are PROTOCOL section 5's; ROUGE-L and token-set F1 "
      "are the published attacks' own metrics (lla.scoring.similarity), computed from the same "
      "predictions. FLOPs are XLA's count of what ran, every shared stage charged. Published "
      "figures come from other models and settings (see their setting); they are context, "
      "not targets.", "", *attack_table(card, int(config.primary_cut)), "",
      "## Pre-registered primary test and secondary contrasts", "", *contrasts(card), "",
      "## Corpus study: ridge inversion alone", "",
      *corpus_table(card, int(config.corpus_study.cut)), "",
      "## Defense verdicts (scorecard-policy.v3) and utility cost", "",
      "Every registered attack that fits the defended capture (PROTOCOL section 5a: the "
      "generic attacks on both channels, the defense-aware baselines and the attacks adaptive "
      "to the mechanism), each linked to the undefended run of its reference attack on the "
      "same target; `set by` names the attack with the largest excess. A fitting attack not "
      "measured, or a mechanism no registered attack adapts to, withholds PASS.", "",
      *defense_table(points), "",
      "![frontier](frontier.png) (data: frontier.json)", "",
      *flop_frontier_section(config, workdir, out), "",
      "## Decoy-row training split (PROTOCOL section 7)", "",
      *decoy_section(workdir, out), "",
      "## Active server (a malicious server that crafts the returned gradients)", "",
      *active_report.section(workdir / "active", out), "",
      "## Wall time per phase", "", *phase_table(invocations), "",
      "## Exact-document against token recovery", "", "![recovery](recovery.png)", "",
      "## FLOPs and wall time per attack run", "", *cost_table(card), "",
      "## Scorecard (gates, coverage, qualification)", "", scorecard_md,
  ]
  path = out / REPORT_FILE
  path.write_text("\n".join(lines) + "\n")
  return path
