"""Pooled envelopes and the defense gate: PASS / FAIL / INSUFFICIENT_EVIDENCE.

PROTOCOL.md sections 5 and 5a. Records are grouped into configurations (defense,
defense_params, cut, knowledge, corpus); within a configuration an attack's
counts are pooled over seeds (n summed) and every seed's own envelope is
reported. A defended configuration PASSes only if its pooled envelope is
<= threshold, it has >= min_seeds independent seeds, the floor allows a PASS,
a linked undefended reference of a family measured under the defense clears
the positive-control bar, and the envelope covers the strongest fitting attack:
on each capture of the configuration, every registered attack (the scorecard's
module entries) whose observations, knowledge and threat model fit that capture
was measured on it, and at least one of them adapts to the defense's mechanism.
Observations are taken per capture (the configuration's key does not hold O): an
inference capture beside training captures leaves the gradient-reading attacks
required on the training ones. A fitting attack not run or crashed,
or a mechanism no registered attack adapts to, withholds the PASS (the
decision is INSUFFICIENT_EVIDENCE, naming them); a FAIL set by the attacks that
were measured stands, since a missing attack can only raise the envelope.
"""

import dataclasses
import json
import os

from lla.evidence import files
from lla.evidence import rundir
from lla.scoring import metrics
from lla.scoring import policy as policy_lib
from lla.evidence.records import AttackRecord

PASS = "PASS"
FAIL = "FAIL"
INSUFFICIENT = "INSUFFICIENT_EVIDENCE"
CONFIG_FIELDS = ("defense", "defense_params", "cut", "knowledge", "corpus")
# The observation kinds a capture's O may hold (lla.attacks.registry.OBSERVATIONS, listed
# here because scoring imports nothing of the attacks): h and g of a split LLM; the frames
# and returned gradient rows of the decoy-row split (lla.decoy).
OBSERVATIONS = ("activations", "gradients", "decoy_forward", "decoy_gradients")
NO_ADAPTIVE = "no adaptive attack for this mechanism"


@dataclasses.dataclass(frozen=True)
class Scored:
  """A record and its counts; counts is None for a crashed or skipped module."""
  record: AttackRecord
  counts: metrics.Counts | None


def attack_key(r: AttackRecord) -> str:
  """Pooling key: the module, marked when it is blind at a position its peers are scored
  on ("t>=1"); after a public BOS every attack is scored on the same positions."""
  return key_of(r.attack, r.scored_positions)


def key_of(attack: str, scored_positions: str) -> str:
  return f"{attack}[t>=1]" if scored_positions == "t>=1" else attack


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


def observations(run_dir: str, group: list[Scored]) -> dict[str, frozenset[str] | None]:
  """What each capture of `group` holds, from its records' protocol tuples (O): capture
  (the records' capture_sha256) -> observations, None where a protocol does not say (then
  every observation is assumed, the conservative choice: more attacks fit).

  Observations are taken per capture (PROTOCOL section 5a): an inference capture in a
  configuration does not remove the gradient-reading attacks from the training captures
  beside it. Records of one capture that name different protocols get the union (more
  attacks fit)."""
  held: dict[str, frozenset[str] | None] = {}
  for s in sorted(group, key=lambda s: (s.record.capture_sha256, s.record.e_hash)):
    cap = s.record.capture_sha256
    these = _protocol_observations(run_dir, s.record.e_hash)
    if cap in held and held[cap] is None:
      continue
    held[cap] = None if these is None else (these | held.get(cap, frozenset()))
  return held


def _protocol_observations(run_dir: str, e_hash: str) -> frozenset[str] | None:
  path = (os.path.join(run_dir, rundir.PROTOCOLS, f"{e_hash}.json")
          if rundir.is_study(run_dir) else os.path.join(run_dir, rundir.PROTOCOL))
  o = files.read_json(path).get("O") if os.path.exists(path) else None
  if not isinstance(o, dict):
    return None
  return frozenset(k for k in OBSERVATIONS if o.get(k))


def _defense_aware_fits(m: dict, defense: str) -> bool | None:
  """Whether defense-aware baseline `m` fits a capture defended by `defense`: True where
  the defense transforms the forward message, False where it does not, None where the
  study does not say (the entry holds no defense facts, or none for this defense: a
  plugin defense not registered when the threat space was written). The facts come from
  the study's threat space (the entry's `defenses`, lla.attacks.registry.defense_facts),
  never from the live defense registry."""
  facts = m.get("defenses")
  if not isinstance(facts, dict) or defense not in facts:
    return None
  return facts[defense] == "activations"


def unknown_defense(modules: list[dict], observed, knowledge: str, defense: str) -> list[str]:
  """The defense-aware entries that would fit the capture but whose entry does not say
  whether `defense` transforms the forward message: `fitting_modules` keeps them (a
  requirement is never dropped for want of a fact) and the gate withholds PASS."""
  return sorted(m["name"] for m in fitting_modules(modules, observed, knowledge, defense)
                if m.get("defense_aware") and _defense_aware_fits(m, defense) is None)


def fitting_modules(modules: list[dict], observed, knowledge: str,
                    defense: str) -> list[dict]:
  """The module entries whose declared needs and threat model fit a capture
  (PROTOCOL section 5a; the registry's `fits` on entries): observations held,
  knowledge allowed, adaptive ones only on the mechanisms they adapt to,
  defense-aware baselines only where the defense transforms the forward
  message (and, where the study does not say whether it does, kept: see
  `unknown_defense`), passive tier; negative controls are not attacks."""
  observed = frozenset(OBSERVATIONS if observed is None else observed)
  out = []
  for m in modules:
    needs = m.get("requires", m.get("observations", ()))
    adapts = m.get("adapts_to") or ()
    if (m.get("role", "attack") == "negative_control"
        or m.get("tier", "passive") != "passive"
        or not set(needs) <= observed
        or knowledge not in m.get("knowledge", ("public", "trained"))
        or (adapts and defense not in adapts)
        or (m.get("defense_aware") and _defense_aware_fits(m, defense) is False)):
      continue
    out.append(m)
  return out


def stale(record: AttackRecord, entry: dict) -> str | None:
  """Why `record` is not a measurement of the attack the study's threat space lists
  (None: it is): made by another revision, or by other code (both code identities known
  and different; a record without one, made before records held it, is judged by its
  revision alone)."""
  revision = entry.get("revision", 1)
  if record.attack_revision != revision:
    return (f"revision {record.attack_revision} recorded, the study's threat space lists "
            f"revision {revision}")
  listed = (entry.get("source") or {}).get("sha256")
  if record.attack_code_sha256 and listed and record.attack_code_sha256 != listed:
    return (f"made by code {record.attack_code_sha256[:12]}, the study's threat space "
            f"lists code {listed[:12]}")
  return None


def _per_capture(group: list[Scored], observed) -> dict[str, frozenset[str] | None]:
  """Capture -> its observations: `observed` is a mapping by capture (`observations`), or
  one set (or None) that every capture of the group holds."""
  caps = sorted({s.record.capture_sha256 for s in group})
  if isinstance(observed, dict):
    return {c: observed.get(c) for c in caps}
  return {c: observed for c in caps}


def coverage_flags(group: list[Scored], modules: list[dict] | None,
                   observed) -> tuple[list[str], dict]:
  """Why the envelope of a defended group does not yet cover the strongest
  fitting attack (each withholds a PASS), and the JSON detail.

  Per capture (PROTOCOL section 5a): every attack that fits a capture's observations must
  be measured on that capture; an attack fitting none of them is not required."""
  r0 = group[0].record
  if modules is None:
    return (["no attack registry given: the attacks that fit this capture "
             "are unknown (PROTOCOL section 5a)"],
            {"fitting": None, "unmeasured": None, "adaptive": None})
  by_capture = _per_capture(group, observed)
  fits_on = {}  # name -> captures it fits
  no_adaptive = []
  unknown = set()
  for cap, obs in by_capture.items():
    fitting = fitting_modules(modules, obs, r0.knowledge, r0.defense)
    unknown.update(unknown_defense(modules, obs, r0.knowledge, r0.defense))
    for m in fitting:
      fits_on.setdefault(m["name"], []).append(cap)
    if not any(m.get("adapts_to") for m in fitting):
      no_adaptive.append(cap)
  adaptive = sorted({m["name"] for m in modules if m["name"] in fits_on
                     and m.get("adapts_to")})
  entries = {m["name"]: m for m in modules}
  measured, ran = set(), {}
  # A measured record counts only at the revision and code the study lists; one of
  # another is unmeasured, named with why (a PASS never rests on a superseded attack).
  for s in sorted(group, key=lambda s: s.counts is None):
    key = (s.record.attack, s.record.capture_sha256)
    why = stale(s.record, entries[s.record.attack]) if (
        s.counts is not None and s.record.attack in entries) else None
    if s.counts is not None and why is None:
      measured.add(key)
      ran.pop(key, None)
    elif key not in measured:
      ran.setdefault(key, why or s.record.status)
  seeds = {}  # capture -> the model seeds of its records (how a reason names it)
  for s in group:
    seeds.setdefault(s.record.capture_sha256, set()).add(s.record.model_seed)
  unmeasured = {}
  for name, caps in sorted(fits_on.items()):
    missing = [c for c in caps if (name, c) not in measured]
    if not missing:
      continue
    text = " / ".join(sorted({ran.get((name, c), "not run") for c in missing}))
    if len(missing) < len(caps):
      where = sorted({m for c in missing for m in seeds[c]})
      text += (f" on {len(missing)} of {len(caps)} captures it fits: model_seed "
               + ", ".join(str(m) for m in where))
    unmeasured[name] = text
  flags = []
  if unknown:
    flags.append(f"defense {r0.defense!r} is unknown to the study's threat space: whether "
                 "it transforms the forward message is not recorded, so the defense-aware "
                 f"baseline(s) {', '.join(sorted(unknown))} stay required")
  if unmeasured:
    flags.append("fitting attack(s) unmeasured: " + ", ".join(
        f"{n} ({why})" for n, why in sorted(unmeasured.items())))
  if no_adaptive:
    flags.append(f"{NO_ADAPTIVE} ({r0.defense})")
  kinds = {}  # observation set -> captures holding it
  for c, o in by_capture.items():
    kinds.setdefault(None if o is None else tuple(sorted(o)), []).append(c)
  observed = [{"observations": None if o is None else list(o), "captures": len(cs),
               "fitting": sorted(n for n, on in fits_on.items() if cs[0] in on)}
              for o, cs in sorted(kinds.items(), key=lambda kv: (kv[0] is None, kv[0] or ()))]
  return flags, {"fitting": sorted(fits_on), "unmeasured": unmeasured,
                 "adaptive": adaptive, "observed": observed,
                 "unknown_defense": sorted(unknown)}


def gate(group: list[Scored], everything: list[Scored],
         pol: policy_lib.Policy, policy_flags=(), modules: list[dict] | None = None,
         observed=None) -> dict:
  """Gate of one defended configuration.

  Args:
    group: the configuration's records (all share CONFIG_FIELDS).
    everything: all records of the run, for reference resolution.
    pol: the policy applied.
    policy_flags: `policy.check` flags; they withhold a PASS.
    modules: the registered attacks' module entries (lla.attacks.registry
      `module_entries`); None withholds every PASS (nothing says which attacks
      fit).
    observed: the observations of each of the group's captures (`observations`: capture
      sha256 -> set or None), or one set every capture holds; None assumes all of them.
  Returns:
    A JSON-ready dict: decision, reasons, pooled rows, envelope (its argmax the
    attack that set it), floor, per-seed envelopes, fitting attacks, links,
    positive controls, sensitivity.
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
  fit_flags, fit = coverage_flags(group, modules, observed)
  withheld = list(policy_flags) + fit_flags
  decision, reasons = decide(envelope_pp, floor, n_seeds, has_control, pol,
                             withheld)
  reasons += [f for f in fit_flags if f"PASS withheld: {f}" not in reasons]
  if env is not None:
    reasons.append(f"envelope set by {env['argmax']}")
  unmeasured = [{"run_id": s.record.run_id, "status": s.record.status,
                 "error": s.record.error} for s in group if s.counts is None]
  if unmeasured:
    reasons.append(f"{len(unmeasured)} module run(s) unmeasured (crashed or "
                   "skipped): the envelope covers only the attacks run")
  sensitivity = _sensitivity(measured, undefended, scored_by_id, families,
                             envelope_pp, floor, n_seeds, decision, pol,
                             withheld)
  r0 = group[0].record
  return {
      "config": {f: getattr(r0, f) for f in CONFIG_FIELDS},
      "decision": decision, "reasons": reasons,
      "seeds": seeds, "seeds_per_attack": seeds_per_attack,
      "n_seeds": n_seeds,
      "pooled": rows, "envelope": env, "per_seed": per_seed,
      "unmeasured": unmeasured, "fitting": fit, "links": links,
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
