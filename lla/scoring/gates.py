"""Pooled envelopes and the defense gate: PASS / FAIL / INSUFFICIENT_EVIDENCE.

PROTOCOL.md section 5. Records are grouped into configurations (defense,
defense_params, cut, knowledge, corpus); within a configuration an attack's
counts are pooled over seeds (n summed) and every seed's own envelope is
reported. A defended configuration PASSes only if its pooled envelope is
<= threshold, it has >= min_seeds independent seeds, the floor allows a PASS,
and a linked undefended reference of a family measured under the defense
clears the positive-control bar.
"""

import dataclasses
import json

from lla.scoring import metrics
from lla.scoring import policy as policy_lib
from lla.evidence.records import AttackRecord

PASS = "PASS"
FAIL = "FAIL"
INSUFFICIENT = "INSUFFICIENT_EVIDENCE"
CONFIG_FIELDS = ("defense", "defense_params", "cut", "knowledge", "corpus")


@dataclasses.dataclass(frozen=True)
class Scored:
  """A record and its counts; counts is None for a crashed or skipped module."""
  record: AttackRecord
  counts: metrics.Counts | None


def attack_key(r: AttackRecord) -> str:
  """Pooling key: the module, marked when scored on t >= 1 only."""
  return r.attack if r.scored_positions == "all" else f"{r.attack}[t>=1]"


def config_key(r: AttackRecord) -> str:
  return json.dumps({f: getattr(r, f) for f in CONFIG_FIELDS}, sort_keys=True)


def seed_key(r: AttackRecord, fields) -> str:
  return ",".join(f"{f}={getattr(r, f)}" for f in fields)


def pool(scored: list[Scored], z: float) -> dict[str, dict]:
  """Attack key -> `metrics.summarize` of counts summed over measured records."""
  sums = {}
  for s in scored:
    if s.counts is not None:
      k = attack_key(s.record)
      sums[k] = sums[k] + s.counts if k in sums else s.counts
  return {k: metrics.summarize(c, z) for k, c in sorted(sums.items())}


def decide(envelope_pp: float | None, floor_pp: float | None, n_seeds: int,
           positive_control: bool, pol: policy_lib.Policy,
           policy_flags=()) -> tuple[str, list[str]]:
  """The gate rule itself, on already computed quantities.

  Returns:
    (decision, reasons); reasons say what blocked a PASS or FAIL, or what the
    decision rests on.
  """
  thr = pol.threshold_pp
  if envelope_pp is None:
    return INSUFFICIENT, ["no measured attack under this defense"]
  blockers = []
  if n_seeds < pol.min_seeds:
    blockers.append(f"{n_seeds} independent seed(s), policy needs "
                    f">= {pol.min_seeds}")
  if not positive_control:
    blockers.append("no linked undefended reference of a measured attack "
                    f"family has excess > {pol.positive_control_pp:g} pp "
                    "(no positive control)")
  if floor_pp > thr:
    blockers.append(f"floor {floor_pp:.3f} pp > {thr:g} pp: the sample size "
                    "makes PASS impossible")
  if blockers:
    return INSUFFICIENT, blockers
  if envelope_pp > thr:
    return FAIL, [f"envelope {envelope_pp:.3f} pp > {thr:g} pp"]
  if policy_flags:
    return INSUFFICIENT, ["PASS withheld: " + f for f in policy_flags]
  return PASS, [f"envelope {envelope_pp:.3f} pp <= {thr:g} pp with "
                f"{n_seeds} seeds and a positive control"]


def reference_problems(ref: AttackRecord | None, rec: AttackRecord,
                       ref_name: str) -> list[str]:
  """Why `ref` cannot be the undefended reference of `rec` (empty: eligible)."""
  if ref is None:
    return [f"reference {ref_name!r} not found among the run's records"]
  out = []
  if ref.status != "ok":
    out.append(f"reference {ref.run_id!r} is unmeasured ({ref.status})")
  if ref.defense != "none":
    out.append(f"reference {ref.run_id!r} is defended ({ref.defense})")
  for f in ("family", "corpus", "cut", "knowledge"):
    if getattr(ref, f) != getattr(rec, f):
      out.append(f"reference {ref.run_id!r} {f} {getattr(ref, f)!r} != "
                 f"{getattr(rec, f)!r}")
  if ref.model_id != rec.model_id and ref.model_seed != rec.model_seed:
    out.append(f"reference {ref.run_id!r} is on another model "
               f"({ref.model_id}, seed {ref.model_seed})")
  return out


def _links(rec: AttackRecord, by_id: dict[str, AttackRecord],
           undefended: list[AttackRecord], pol: policy_lib.Policy) -> dict:
  """Resolves a defended record's reference: explicit, implicit or none.

  An explicit link that fails the checks is rejected without falling back to
  implicit matching: the run claimed that reference, and a silent substitute
  would hide the mismatch.
  """
  if rec.reference is not None:
    problems = reference_problems(by_id.get(rec.reference), rec, rec.reference)
    return {"run_id": rec.run_id, "kind": "explicit",
            "references": [] if problems else [rec.reference],
            "problems": problems}
  if not pol.implicit_matching:
    return {"run_id": rec.run_id, "kind": "none", "references": [],
            "problems": ["no explicit reference and implicit matching is off"]}
  cands = [u for u in undefended if not reference_problems(u, rec, u.run_id)]
  same_attack = [u for u in cands if u.attack == rec.attack]
  chosen = sorted(u.run_id for u in (same_attack or cands))
  return {"run_id": rec.run_id, "kind": "implicit (family match)",
          "references": chosen,
          "problems": [] if chosen else ["no eligible undefended reference"]}


def _controls(ref_ids, scored_by_id, families, pol) -> dict:
  """Family -> pooled reference excesses and whether it clears the bar."""
  out = {}
  for fam in sorted(families):
    refs = sorted({i for i in ref_ids
                   if scored_by_id[i].record.family == fam})
    rows = pool([scored_by_id[i] for i in refs], pol.wilson_z)
    best = max((r["excess_pp"] for r in rows.values()), default=None)
    out[fam] = {"references": refs,
                "excess_pp": {k: r["excess_pp"] for k, r in rows.items()},
                "max_excess_pp": best,
                "ok": best is not None and best > pol.positive_control_pp}
  return out


def gate(group: list[Scored], everything: list[Scored],
         pol: policy_lib.Policy, policy_flags=()) -> dict:
  """Gate of one defended configuration.

  Args:
    group: the configuration's records (all share CONFIG_FIELDS).
    everything: all records of the run, for reference resolution.
    pol: the policy applied.
    policy_flags: `policy.check` flags; they withhold a PASS.
  Returns:
    A JSON-ready dict: decision, reasons, pooled rows, envelope, floor,
    per-seed envelopes, links, positive controls, sensitivity.
  """
  scored_by_id = {s.record.run_id: s for s in everything}
  by_id = {i: s.record for i, s in scored_by_id.items()}
  undefended = [s.record for s in everything
                if s.record.defense == "none" and s.counts is not None]
  measured = [s for s in group if s.counts is not None]
  rows = pool(measured, pol.wilson_z)
  env = metrics.envelope(rows) if rows else None
  seeds = sorted({seed_key(s.record, pol.seed_fields) for s in measured})
  # A PASS rests on every measured attack, so the weakest-seeded one counts.
  seeds_per_attack = {
      k: len({seed_key(s.record, pol.seed_fields) for s in measured
              if attack_key(s.record) == k}) for k in rows}
  per_seed = []
  for sk in seeds:
    srows = pool([s for s in measured
                  if seed_key(s.record, pol.seed_fields) == sk], pol.wilson_z)
    e = metrics.envelope(srows)
    per_seed.append({"seed": sk, "envelope_pp": e["envelope_pp"],
                     "argmax": e["argmax"], "floor_pp": e["floor_pp"]})
  links = [_links(s.record, by_id, undefended, pol) for s in measured]
  ref_ids = sorted({i for l in links for i in l["references"]})
  families = {s.record.family for s in measured}
  controls = _controls(ref_ids, scored_by_id, families, pol)
  has_control = any(c["ok"] for c in controls.values())
  envelope_pp = env["envelope_pp"] if env else None
  floor = env["floor_pp"] if env else None
  n_seeds = min(seeds_per_attack.values(), default=0)
  decision, reasons = decide(envelope_pp, floor, n_seeds, has_control, pol,
                             policy_flags)
  unmeasured = [{"run_id": s.record.run_id, "status": s.record.status,
                 "error": s.record.error} for s in group if s.counts is None]
  if unmeasured:
    reasons.append(f"{len(unmeasured)} module run(s) unmeasured (crashed or "
                   "skipped): the envelope covers only the attacks run")
  sensitivity = _sensitivity(measured, undefended, scored_by_id, families,
                             envelope_pp, floor, n_seeds, decision, pol,
                             policy_flags)
  r0 = group[0].record
  return {
      "config": {f: getattr(r0, f) for f in CONFIG_FIELDS},
      "decision": decision, "reasons": reasons,
      "seeds": seeds, "seeds_per_attack": seeds_per_attack,
      "n_seeds": n_seeds,
      "pooled": rows, "envelope": env, "per_seed": per_seed,
      "unmeasured": unmeasured, "links": links,
      "positive_controls": controls, "sensitivity": sensitivity,
  }


def _sensitivity(measured, undefended, scored_by_id, families, envelope_pp,
                 floor, n_seeds, decision, pol, policy_flags) -> dict:
  """The decision under each eligible reference attack taken alone.

  Eligible: an undefended measured record that passes `reference_problems`
  for some measured defended record; candidates of one attack key are pooled
  over seeds, like the reference itself would be.
  """
  eligible = {}
  for u in undefended:
    if u.family in families and any(
        not reference_problems(u, s.record, u.run_id) for s in measured):
      eligible.setdefault(attack_key(u), []).append(u.run_id)
  alts = []
  for key, ids in sorted(eligible.items()):
    c = _controls(ids, scored_by_id, {scored_by_id[ids[0]].record.family},
                  pol)
    (fam, ctl), = c.items()
    d, _ = decide(envelope_pp, floor, n_seeds, ctl["ok"], pol, policy_flags)
    alts.append({"reference": key, "family": fam,
                 "excess_pp": ctl["max_excess_pp"], "decision": d})
  changed = sorted({a["reference"] for a in alts if a["decision"] != decision})
  if not alts:
    line = "no eligible undefended reference exists"
  elif changed:
    line = (f"decision {decision} changes under reference(s) "
            f"{', '.join(changed)}")
  else:
    line = f"decision {decision} is the same under all {len(alts)} eligible references"
  return {"alternatives": alts, "decision_changes": bool(changed),
          "line": line}
