"""Coverage of the declared threat space.

Cells are attack family x observation x knowledge x defense. A cell is
`covered` (measured on enough seeds, nothing in it failed to run), `partial`
(measured, but too few seeds or some module crashed or was skipped),
`unmeasured` (nothing ran, or everything that should have crashed or was
skipped: never counted as a failed attack) or `out of scope` (declared so,
with a reason). Whole threat classes outside the grid can be declared
unmeasured (PROTOCOL section 7) and are listed until measured.

Each cell also carries its tier, "passive" or "active" (a family is active when
any of its modules is: the server wrote the messages it returned), and the
counts are reported per tier as well, so the active tier is read on its own.
"""

import dataclasses

from lla.evidence.records import AttackRecord

COVERED, PARTIAL, UNMEASURED, OUT_OF_SCOPE = (
    "covered", "partial", "unmeasured", "out of scope")
AXES = ("family", "observation", "knowledge", "defense")

# PROTOCOL.md section 7: listed until measured.
PROTOCOL_DECLARED_UNMEASURED = (
    ("membership/property inference", "no module measures it"),
    ("response-side recovery", "no module measures it"),
    ("timing metadata", "no module measures it"),
    ("stateful remote state", "no module measures it"),
    ("accumulated history across steps", "no module measures it"),
    ("active perturbation by the cloud", "no module measures it"),
)


@dataclasses.dataclass(frozen=True)
class ThreatSpace:
  """The declared threat space.

  Attributes:
    families, observations, knowledge, defenses: the grid axes; an observation
      is a '+'-joined sorted set such as "activations+gradients".
    out_of_scope: rules {axis: value, ..., "reason": str}; an absent axis
      matches any value.
    declared_unmeasured: (threat class, reason) pairs outside the grid.
  """
  families: tuple[str, ...]
  observations: tuple[str, ...]
  knowledge: tuple[str, ...]
  defenses: tuple[str, ...]
  out_of_scope: tuple[dict, ...] = ()
  declared_unmeasured: tuple[tuple[str, str], ...] = (
      PROTOCOL_DECLARED_UNMEASURED)

  def __post_init__(self):
    for rule in self.out_of_scope:
      if "reason" not in rule or set(rule) - set(AXES) - {"reason"}:
        raise ValueError(f"out_of_scope rule {rule}: needs 'reason' and only "
                         f"the axes {AXES}")


def observation_of(module: dict) -> str:
  return "+".join(sorted(module["observations"]))


def report(records: list[AttackRecord], space: ThreatSpace,
           modules: list[dict], seed_fields=("model_seed",),
           min_seeds: int = 3) -> dict:
  """Classifies every cell of `space`.

  Args:
    records: all attack records (any status).
    space: the declared threat space.
    modules: registry entries {"name", "family", "observations": [...], "tier"
      (optional, default "passive")}.
    seed_fields: record fields whose distinct values count as seeds.
    min_seeds: seeds a cell needs to be `covered`.
  Returns:
    {"cells": [...], "counts": {status: n}, "tiers": {tier: {status: n}}, "in_scope",
     "unmeasured_share",
     "declared_unmeasured": [...], "unplaced": [...]}.
  """
  by_name = {m["name"]: m for m in modules}
  active = {m["family"] for m in modules if m.get("tier", "passive") == "active"}
  cells = {}
  unplaced = []
  for r in records:
    m = by_name.get(r.attack)
    if m is None:
      unplaced.append({"run_id": r.run_id, "reason":
                       f"module {r.attack!r} not in the registry list"})
      continue
    key = (m["family"], observation_of(m), r.knowledge, r.defense)
    cells.setdefault(key, []).append(r)
  out = []
  for key in [(f, o, k, d) for f in space.families for o in space.observations
              for k in space.knowledge for d in space.defenses]:
    status, reason = _classify(key, cells.pop(key, []), space, seed_fields,
                               min_seeds)
    out.append(dict(zip(AXES, key), tier="active" if key[0] in active else "passive",
                    status=status, reason=reason))
  for key, rs in sorted(cells.items()):
    unplaced += [{"run_id": r.run_id, "reason": f"cell {key} not in the "
                  "declared threat space"} for r in rs]
  counts = {s: sum(c["status"] == s for c in out)
            for s in (COVERED, PARTIAL, UNMEASURED, OUT_OF_SCOPE)}
  in_scope = len(out) - counts[OUT_OF_SCOPE]
  tiers = {t: {s: sum(c["status"] == s for c in out if c["tier"] == t)
               for s in (COVERED, PARTIAL, UNMEASURED, OUT_OF_SCOPE)}
           for t in sorted({c["tier"] for c in out})}
  return {
      "cells": out, "counts": counts, "tiers": tiers, "in_scope": in_scope,
      "unmeasured_share": counts[UNMEASURED] / in_scope if in_scope else 0.0,
      "declared_unmeasured": [{"class": c, "reason": why}
                              for c, why in space.declared_unmeasured],
      "unplaced": sorted(unplaced, key=lambda u: u["run_id"]),
  }


def _classify(key, recs, space, seed_fields, min_seeds) -> tuple[str, str]:
  cell = dict(zip(AXES, key))
  for rule in space.out_of_scope:
    if all(cell[a] == v for a, v in rule.items() if a != "reason"):
      return OUT_OF_SCOPE, rule["reason"]
  if not recs:
    return UNMEASURED, "no module was run"
  ok = [r for r in recs if r.status == "ok"]
  bad = sorted(f"{r.run_id} {r.status}: {r.error}" for r in recs
               if r.status != "ok")
  if not ok:
    return UNMEASURED, "every run unmeasured: " + "; ".join(bad)
  seeds = {tuple(getattr(r, f) for f in seed_fields) for r in ok}
  why = []
  if len(seeds) < min_seeds:
    why.append(f"{len(seeds)} seed(s) < {min_seeds}")
  if bad:
    why.append("unmeasured: " + "; ".join(bad))
  if why:
    return PARTIAL, "; ".join(why)
  return COVERED, f"{len(ok)} run(s) over {len(seeds)} seeds"
