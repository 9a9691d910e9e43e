"""Qualification matrix: how far each attack module itself is trusted.

Kept apart from attack results: qualification never enters a gate. Each module
gets, per kind, a status, the evidence (a test id or a run id) it rests on and
where that evidence comes from (`source`: a recorded test outcome, the study's
runs, or "not run"); capabilities a module declares but no evidence exercises
are listed as untested. A declared check that did not run is `unmeasured`: a
cell is `pass` only when every item in it passed.
"""

KINDS = ("reference_consistency", "adaptation", "real_model", "synthetic")
KIND_TITLES = {
    "reference_consistency": "token-for-token agreement with a reference",
    "adaptation": "adapted to the defense it is run against",
    "real_model": "qualified on a real model",
    "synthetic": "qualified on synthetic known-answer data",
}
STATUSES = ("pass", "partial", "fail", "unmeasured")
# A cell's status is the first of these its items hold (the worst).
PRECEDENCE = ("fail", "partial", "unmeasured", "pass")
NOT_QUALIFIED = "not qualified"


def matrix(modules: list[dict], evidence: list[dict]) -> dict:
  """Builds the per-module qualification matrix.

  Args:
    modules: registry entries {"name", "capabilities": [...] (optional), "tier"
      (optional, default "passive")}.
    evidence: items {"module", "kind" in KINDS, "status" in STATUSES,
      "evidence": test id or run id, "source" (optional: where the status
      comes from), "capability" (optional), "detail" (optional), and for a
      test's recorded outcome "outcome" and "outcome_sha256"}.
  Returns:
    module name -> {kind: {"status", "sources": [...], "evidence": [...]},
    "tier", "untested_capabilities": [...]}; a kind's status is its worst
    evidence ("fail" < "partial" < "unmeasured" < "pass"), or "not qualified"
    without evidence; `sources` lists where its items' statuses come from.
  """
  names = [m["name"] for m in modules]
  if len(set(names)) != len(names):
    raise ValueError(f"duplicate module names in {names}")
  out = {}
  for m in modules:
    out[m["name"]] = {k: {"status": NOT_QUALIFIED, "sources": [], "evidence": []}
                      for k in KINDS}
    out[m["name"]]["tier"] = m.get("tier", "passive")
  tested = {n: set() for n in names}
  for i, e in enumerate(evidence):
    where = f"qualification evidence #{i} ({e.get('evidence')!r})"
    if e.get("module") not in out:
      raise ValueError(f"{where}: unknown module {e.get('module')!r}")
    if e.get("kind") not in KINDS or e.get("status") not in STATUSES:
      raise ValueError(f"{where}: kind must be in {KINDS} and status in "
                       f"{STATUSES}, got {e.get('kind')!r}/{e.get('status')!r}")
    if not e.get("evidence"):
      raise ValueError(f"{where}: names no test id or run")
    cell = out[e["module"]][e["kind"]]
    cell["evidence"].append({k: e[k] for k in (
        "evidence", "status", "source", "detail", "capability", "outcome",
        "outcome_sha256") if k in e})
    cell["evidence"].sort(key=lambda x: x["evidence"])
    present = {x["status"] for x in cell["evidence"]}
    cell["status"] = next(s for s in PRECEDENCE if s in present)
    cell["sources"] = sorted({x["source"] for x in cell["evidence"]
                              if x.get("source")})
    if "capability" in e:
      tested[e["module"]].add(e["capability"])
  for m in modules:
    caps = m.get("capabilities", [])
    out[m["name"]]["untested_capabilities"] = sorted(
        set(caps) - tested[m["name"]])
  return out


def cell_text(cell: dict) -> str:
  """A matrix cell for a table: its status and where its evidence comes from."""
  sources = cell.get("sources") or []
  return cell["status"] + (f" ({'; '.join(sources)})" if sources else "")
