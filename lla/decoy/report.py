"""Tables and the dose-response figure of the decoy-row experiment.

`summarise` turns per-seed results into one summary (the decision included); `write`
stores it as results.json, results.md, dose_response.json and dose_response.png.
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from lla.evidence import files  # noqa: E402


def _seed_row(seed: dict, arm: str) -> dict:
  r = seed[arm]
  c = r["content"]
  row = {"seed": seed["seed"], "mitigation": arm,
         "structural_frames_exact": r["structural"]["frames_exact"],
         "frames": r["structural"]["frames"],
         "structural_row_agreement": r["structural"]["row_agreement"],
         "base_rate": r["structural"]["base_rate"],
         # A seed finished before the norm attack existed has no result for it.
         "norm_row_agreement": r["norm"]["row_agreement"] if "norm" in r else None,
         "baseline_accuracy": c["baseline"]["accuracy"], "floor_pp": c["baseline"]["floor_pp"],
         "arms": {k: {"advantage_pp": v["advantage_pp"], "ci_pp": v["ci_pp"],
                      "gate_pp": v["gate_pp"],
                      "shuffled_advantage_pp": v["shuffled"]["advantage_pp"],
                      "shuffled_ci_pp": v["shuffled"]["ci_pp"]}
                  for k, v in c["arms"].items()},
         "G_pp": c["G_pp"], "gate": c["gate"], "heldout_ce": r["heldout_ce"]["final"]}
  if arm == "mitigated":
    row["ce_cost_nats"] = seed["utility"]["ce_cost_nats"]
    row["utility_gate"] = seed["utility"]["gate"]
  return row


def _decision(rows: list[dict], calibration: list[dict], policy: dict) -> dict:
  """PASS / FAIL / INSUFFICIENT_EVIDENCE for the mitigated system, with the reason."""
  mit = [r for r in rows if r["mitigation"] == "mitigated"]
  leak = [r["seed"] for r in mit if r["gate"] == "FAIL"]
  costly = [r["seed"] for r in mit if r["utility_gate"] == "FAIL"]
  fired = [c["first_firing"]["rho"] is not None for c in calibration]
  if leak or costly:
    return {"decision": "FAIL", "reason": f"leak gate fails on seeds {leak}, utility gate "
            f"on seeds {costly}"}
  if len(mit) < policy["min_seeds"]:
    return {"decision": "INSUFFICIENT_EVIDENCE",
            "reason": f"{len(mit)} seeds < min_seeds {policy['min_seeds']}"}
  if not fired or not all(fired):
    return {"decision": "INSUFFICIENT_EVIDENCE",
            "reason": "positive control missing: the calibration did not make the gate fire"}
  return {"decision": "PASS", "reason": f"G <= {policy['threshold_pp']} pp and CE cost <= "
          f"{policy['utility_max_ce_increase_nats']} nats on all {len(mit)} seeds; the "
          "calibrated instrument fires on injected leaks"}


def summarise(seeds: list[dict], policy: dict, policy_sha: str, unmeasured) -> dict:
  rows = [_seed_row(s, arm) for s in seeds for arm in ("none", "mitigated")]
  calibration = [dict(seed=s["seed"], **s["none"]["calibration"]) for s in seeds
                 if "calibration" in s["none"]]
  return {"schema": "lla.decoy_leak.v1", "policy": policy["policy_id"],
          "policy_sha256": policy_sha, "threshold_pp": policy["threshold_pp"],
          "rows": rows, "calibration": calibration,
          "decision_mitigated": _decision(rows, calibration, policy),
          "declared_unmeasured": list(unmeasured)}


def _ci(v: dict, key: str = "") -> str:
  adv, ci = (v[f"{key}advantage_pp"], v[f"{key}ci_pp"])
  return f"{adv:+.2f} [{ci[0]:+.2f}, {ci[1]:+.2f}]"


def markdown(summary: dict) -> str:
  arms = list(summary["rows"][0]["arms"])
  head = (["seed", "mitigation", "structural exact frames", "row agreement (base)",
           "norm attack row agreement"] + arms +
          ["G (pp)", "gate", "held-out CE", "CE cost (nats)"])
  lines = ["# Decoy-row split: returned-gradient leak (PROTOCOL 7)", "",
           f"Policy `{summary['policy']}` sha256 `{summary['policy_sha256']}`; gate fails "
           f"when G > {summary['threshold_pp']} pp. Arm cells: paired per-frame advantage "
           "over the most-frequent-token baseline, pp, [95% frame-cluster bootstrap]. The norm "
           "attack takes each frame's R rows of largest returned-gradient norm (chance "
           "1 - 2R(M-R)/M^2).", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in summary["rows"]:
    cost = (f"{r['ce_cost_nats']:+.4f} ({r['utility_gate']})" if "ce_cost_nats" in r else "")
    cells = ([str(r["seed"]), r["mitigation"], f"{r['structural_frames_exact']} / {r['frames']}",
              f"{r['structural_row_agreement']:.4f} ({r['base_rate']:.2f})",
              "not run" if r["norm_row_agreement"] is None
              else f"{r['norm_row_agreement']:.4f}"] +
             [_ci(r["arms"][a]) for a in arms] +
             [f"{r['G_pp']:+.2f}", r["gate"], f"{r['heldout_ce']:.4f}", cost])
    lines.append("| " + " | ".join(cells) + " |")
  lines += ["", "Shuffled-label controls (same arms, training labels permuted):", "",
            "| seed | mitigation | " + " | ".join(arms) + " |", "|" + "---|" * (len(arms) + 2)]
  for r in summary["rows"]:
    lines.append(f"| {r['seed']} | {r['mitigation']} | " +
                 " | ".join(_ci(r["arms"][a], "shuffled_") for a in arms) + " |")
  for c in summary["calibration"]:
    lines += ["", f"Calibration (seed {c['seed']}, injected into {c['injected_into']}): gate "
              f"first fires at rho = {c['first_firing']['rho']} (a = 1) and at a = "
              f"{c['first_firing']['a']} (rho = 1).", "", "| series | dose | G (pp) | fires |",
              "|---|---|---|---|"]
    lines += [f"| {p['series']} | {p['x']} | {p['G_pp']:+.2f} | {p['fires']} |"
              for p in c["points"]]
  d = summary["decision_mitigated"]
  lines += ["", f"**Mitigated system: {d['decision']}** ({d['reason']}).", "",
            "Declared unmeasured (PROTOCOL 7): " + "; ".join(summary["declared_unmeasured"]) + "."]
  return "\n".join(lines) + "\n"


def figure(calibration: list[dict], threshold_pp: float, path: str) -> None:
  """G versus dose (rho at a = 1; a at rho = 1), per calibrated seed, with the threshold."""
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for ax, series, label in ((axes[0], "rho", "rho (fraction of rows), a = 1"),
                            (axes[1], "a", "a (codeword amplitude), rho = 1")):
    for c in calibration:
      pts = [p for p in c["points"] if p["series"] == series]
      ax.plot([p["x"] for p in pts], [p["G_pp"] for p in pts], "o-", label=f"seed {c['seed']}")
      first = c["first_firing"][series]
      if first is not None:
        ax.axvline(first, color="gray", ls=":", lw=1)
    ax.axhline(threshold_pp, color="red", ls="--", lw=1, label=f"gate {threshold_pp} pp")
    # rho includes 0, so its axis is linear near 0 and logarithmic above 0.005.
    if series == "rho":
      ax.set_xscale("symlog", linthresh=0.005)
      ax.set_xlim(0, 1.2)
    else:
      ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_xlabel(label)
    ax.set_ylabel("G (pp)")
    ax.legend(fontsize=8)
  fig.suptitle("Leak-injection dose response of the content gate")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write(workdir: str, summary: dict) -> None:
  """results.json, results.md and (if calibrated) dose_response.{json,png}; overwrites."""
  files.atomic_write_json(os.path.join(workdir, "results.json"), summary, overwrite=True)
  files.atomic_write_bytes(os.path.join(workdir, "results.md"),
                           markdown(summary).encode("utf-8"), overwrite=True)
  if summary["calibration"]:
    files.atomic_write_json(os.path.join(workdir, "dose_response.json"),
                            {"threshold_pp": summary["threshold_pp"],
                             "calibration": summary["calibration"]}, overwrite=True)
    figure(summary["calibration"], summary["threshold_pp"],
           os.path.join(workdir, "dose_response.png"))
