"""The bridge: one protocol on several models, side by side, and what transfers between them.

Seed 000 drew its conclusions on GPT-2 and qualified them on larger models without a common
protocol. Here every column is a finished main job (lla.study.main_table) of its own model,
run with the same protocol: the table puts their undefended recoveries, the pre-registered
primary test and each defense's verdict side by side, each read from the job's sealed study
after it verifies (so a column is the study's evidence, not a copy of it), and
`conclusions` states, one sentence per conclusion, whether it holds on every column.

  columns = [bridge.read(workdir) for workdir in workdirs]
  lines = bridge.markdown(columns)
"""

from __future__ import annotations

import dataclasses
import pathlib

from lla.evidence import files, rundir
from lla.scoring import scorecard
from lla.study import report

STUDY = "study"
DECOY_DEFENSE = "decoy_rows"
INSUFFICIENT = "INSUFFICIENT_EVIDENCE"


class BridgeError(ValueError):
  """A workdir that is not a finished, verifying main job (one line naming it)."""


@dataclasses.dataclass(frozen=True)
class Column:
  """One main job: what it ran and what its scorecard says."""

  workdir: str
  variant: str
  model: str
  n_eval: int
  num_models: int
  e_hash: str
  seal: str   # the study's seal (lla.evidence.rundir.anchor): `experiments.verify --expect`
  wall_min: float | None
  card: dict

  @property
  def name(self) -> str:
    return f"{self.model} ({self.variant})"


def read(workdir: str | pathlib.Path) -> Column:
  """The column of the main job in `workdir`, once its study is sealed and verifies.

  Raises:
    BridgeError: no sealed study, or one that fails verification.
  """
  workdir = pathlib.Path(workdir)
  study = workdir / STUDY
  if not rundir.started(str(study)) or not rundir.log(str(study)).sealed:
    raise BridgeError(f"{workdir}: no finished main job (a sealed {STUDY}/) to read")
  problems = rundir.verify(str(study))
  if problems:
    raise BridgeError(f"{study}: fails verification: {problems[0]}")
  card = files.read_json(str(study / rundir.SCORECARD_JSON))
  changed = scorecard.stale(str(study), card)
  if changed:  # Its verdicts are of an earlier state of the study: not compared.
    raise BridgeError(scorecard.stale_line(str(study), changed))
  config = files.read_json(str(study / rundir.PROTOCOL))["config"]
  timing = workdir / "timing.json"
  invocations = files.read_json(str(timing))["invocations"] if timing.exists() else []
  finished = [i["finished_unix"] for i in invocations if i["finished_unix"]]
  wall = (finished[-1] - invocations[0]["started_unix"]) / 60 if finished else None
  return Column(str(workdir), config["variant"], config["model"]["name"],
                int(config["data"]["n_eval"]), int(config["finetune"]["num_models"]),
                card["e_hash"], rundir.anchor(str(study))["hash"], wall, card)


def recoveries(column: Column) -> dict[tuple[int, str, str], dict]:
  """(k, knowledge, attack) -> pooled metrics of the undefended WikiText-2 settings."""
  return {(config["cut"], config["knowledge"], attack): metrics
          for config, attack, metrics in report.main_rows(column.card)}


def primary(column: Column) -> dict | None:
  """The evaluated primary contrast on WikiText-2, or None."""
  entries = (column.card.get("contrasts") or {}).get("primary") or []
  return next((e for e in entries if e.get("evaluated")), None)


def verdicts(column: Column) -> dict[str, dict]:
  """Defense label -> {decision, envelope_pp, by, floor_pp} of each gated configuration on
  the job's model (the decoy-row split's gates are left out: it trains a model of its own,
  the same in every job)."""
  out = {}
  for gate in column.card["gates"]:
    if gate["config"]["defense"] == DECOY_DEFENSE:
      continue
    label, _ = report.defense_label(gate["config"]["defense"], gate["config"]["defense_params"])
    envelope = gate["envelope"] or {}
    out[label] = {"decision": gate["decision"], "envelope_pp": envelope.get("envelope_pp"),
                  "by": envelope.get("argmax"), "floor_pp": envelope.get("floor_pp")}
  return out


def _recovery_cell(metrics: dict | None) -> str:
  if metrics is None:
    return "—"
  return (f"{100 * metrics['token_recovery']:.2f}% ({100 * metrics['exact_doc_recovery']:.2f}% "
          f"exact, n {metrics['n']})")


def _primary_cell(entry: dict | None) -> str:
  if entry is None:
    return "not evaluated"
  return (f"{entry['estimate']:+.2f} pp [{entry['lo']:+.2f}, {entry['hi']:+.2f}] "
          f"({'met' if entry['passed'] else 'not met'})")


def _verdict_cell(verdict: dict | None) -> str:
  if verdict is None:
    return "—"
  envelope = verdict["envelope_pp"]
  amount = "" if envelope is None else f" {envelope:+.2f} pp ({verdict['by']})"
  return f"{verdict['decision']}{amount}"


def conclusions(columns: list[Column]) -> list[str]:
  """One sentence per conclusion: the primary test, and each defense's verdict, on every
  column that measured it, and whether it is the same on all of them (it transfers), differs
  (it does not), or is undecided somewhere (INSUFFICIENT_EVIDENCE says nothing either way)."""
  names = [c.name for c in columns]
  sentences = []
  outcomes = [primary(c) for c in columns]
  said = "; ".join(f"{n}: {_primary_cell(o)}" for n, o in zip(names, outcomes))
  if any(o is None for o in outcomes):
    sentences.append(f"Primary test: not evaluated on every model ({said}).")
  else:
    met = {o["passed"] for o in outcomes}
    sentences.append(f"Primary test ({said}): "
                     + ("the same outcome on every model, so it transfers." if len(met) == 1
                        else "met on some models and not on others, so it does not transfer."))
  per_model = [verdicts(c) for c in columns]
  for label in sorted(set().union(*per_model)):
    measured = [(n, v[label]) for n, v in zip(names, per_model) if label in v]
    said = "; ".join(f"{n}: {_verdict_cell(v)}" for n, v in measured)
    decided = {v["decision"] for _, v in measured} - {INSUFFICIENT}
    if len(measured) < len(columns):
      tail = "not run on every model."
    elif len(decided) > 1:
      tail = "the verdicts differ, so it does not transfer."
    elif any(v["decision"] == INSUFFICIENT for _, v in measured):
      tail = (f"undecided on some model ({INSUFFICIENT}), so whether it transfers is open"
              + (f"; {decided.pop()} where decided." if decided else "."))
    else:
      tail = f"{decided.pop()} on every model, so it transfers."
    sentences.append(f"{label} ({said}): {tail}")
  return sentences


def markdown(columns: list[Column]) -> list[str]:
  """The side-by-side table, then the conclusions."""
  head = "| measure | " + " | ".join(c.name for c in columns) + " |"
  lines = [head, "|" + "---|" * (len(columns) + 1)]
  lines.append("| documents x fine-tuned models | " + " | ".join(
      f"{c.n_eval} x {c.num_models}" for c in columns) + " |")
  lines.append("| wall time | " + " | ".join(
      "—" if c.wall_min is None else f"{c.wall_min:.1f} min" for c in columns) + " |")
  lines.append("| study seal | " + " | ".join(f"`{c.seal[:12]}`" for c in columns) + " |")
  per_model = [recoveries(c) for c in columns]
  keys = sorted(set().union(*per_model), key=lambda k: (-k[0], k[1], k[2]))
  for cut, knowledge, attack in keys:
    cells = [_recovery_cell(r.get((cut, knowledge, attack))) for r in per_model]
    lines.append(f"| k = {cut}, {knowledge}: {attack} | " + " | ".join(cells) + " |")
  lines.append("| primary test (95% interval) | " + " | ".join(
      _primary_cell(primary(c)) for c in columns) + " |")
  judged = [verdicts(c) for c in columns]
  for label in sorted(set().union(*judged)):
    lines.append(f"| {label} | " + " | ".join(_verdict_cell(v.get(label)) for v in judged) + " |")
  return lines + [""] + [f"* {s}" for s in conclusions(columns)]


def to_json(columns: list[Column]) -> dict:
  """What the table shows, per column, for a reader that computes on it."""
  return {"columns": [{
      "workdir": c.workdir, "variant": c.variant, "model": c.model, "n_eval": c.n_eval,
      "num_models": c.num_models, "scorecard_e_hash": c.e_hash, "seal": c.seal,
      "wall_min": c.wall_min,
      "recoveries": {f"k{k}/{kn}/{a}": {f: m[f] for f in ("token_recovery",
                                                          "exact_doc_recovery", "n")}
                     for (k, kn, a), m in recoveries(c).items()},
      "primary": primary(c), "verdicts": verdicts(c)} for c in columns],
      "conclusions": conclusions(columns)}
