"""A study's threat space: the attack modules registered when it was built, as evidence.

    RUN/inputs/threat_space.json   {"schema": "lla.threat_space.v1", "modules": [entry, ...]}

Each entry is a module entry of the attack registry (lla.attacks.registry.module_entry:
name, family, observations, knowledge, tier, role, adapts_to, defense_aware, threat model,
checks, ...) with `source`: the module that registered it and the sha256 of that module's
source file. The file is written through the run's logged writer (rundir.save_file, event
`threat_space`), so the hash-chained log and the manifest cover it like any other input.

Whoever creates or extends a study records the registry it ran with (`record`, called by
lla.replay.driver.record_threat_space: every replay into a run, each sweep cell, the main
job and the active tier before they score). Recording merges: today's entries replace
those of the same name, and an entry no longer registered stays, so a record's attack is
always placed and a study's threat space never loses a module it once held. Scoring reads
this file and the records, never the live registry (lla.scoring imports nothing from
lla.attacks), so `rescore` reproduces sealed verdicts from the study alone; `compare` and
`verdict_changes` say what today's registry would change (`rescore --against=current`).

Not to be confused with the declared coverage grid (configs/scoring.py `threat_space`:
families x observations x knowledge x defenses), which the scorecard embeds in its inputs.
"""

from __future__ import annotations

import dataclasses
import json
import os

from lla.evidence import files
from lla.evidence import rundir

FILE = f"{rundir.INPUTS}/threat_space.json"
SCHEMA = "lla.threat_space.v1"
EVENT = "threat_space"


@dataclasses.dataclass(frozen=True)
class Recorded:
  """The threat space file of a study: its module entries and the file's sha256."""
  modules: list[dict]
  sha256: str


def normalize(entries) -> list[dict]:
  """Entries as their JSON round trip (tuples become lists), sorted by name; names must be
  unique."""
  out = json.loads(files.canonical_json(list(entries)))
  names = [m.get("name") for m in out if isinstance(m, dict)]
  if len(names) != len(out) or not all(isinstance(n, str) and n for n in names):
    raise ValueError("threat space: every module entry needs a non-empty 'name'")
  dupes = sorted({n for n in names if names.count(n) > 1})
  if dupes:
    raise ValueError(f"threat space: module(s) listed twice: {', '.join(dupes)}")
  return sorted(out, key=lambda m: m["name"])


def merge(old: list[dict], new: list[dict]) -> list[dict]:
  """`new`'s entries, plus those of `old` whose name `new` lacks (sorted by name)."""
  by_name = {m["name"]: m for m in normalize(old)}
  by_name.update({m["name"]: m for m in normalize(new)})
  return [by_name[n] for n in sorted(by_name)]


def to_bytes(modules: list[dict]) -> bytes:
  return files.canonical_json({"schema": SCHEMA, "modules": normalize(modules)})


def record(run_dir: str, entries) -> bool:
  """Merges `entries` (the registry's module entries) into the study's threat space file
  and writes it (logged) if that changes it; returns whether it wrote.

  The run must be writable (not sealed: lla.evidence.rundir.extending reopens one).
  """
  existing = read(run_dir)
  data = to_bytes(merge(existing.modules if existing else [], list(entries)))
  sha = files.sha256_bytes(data)
  if existing is not None and sha == existing.sha256:
    logged = rundir.logged_files(run_dir).get(FILE)
    if logged is not None and logged[0] == sha:
      return False
    # Written but never logged (a writer stopped between the two): written again, logged.
  rundir.save_file(run_dir, FILE, data, EVENT, overwrite=True)
  return True


def read(run_dir: str) -> Recorded | None:
  """The study's threat space, or None if it records none (a run made before studies
  recorded theirs).

  Raises:
    ValueError naming the file when it is not a threat space file.
  """
  path = os.path.join(run_dir, FILE)
  if not os.path.exists(path):
    return None
  with open(path, "rb") as f:
    data = f.read()
  try:
    doc = json.loads(data.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{path}: not valid JSON ({e})") from None
  if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(
      doc.get("modules"), list):
    raise ValueError(f"{path}: not a threat space file (schema {SCHEMA!r} with a 'modules' "
                     "list)")
  try:
    modules = normalize(doc["modules"])
  except ValueError as e:
    raise ValueError(f"{path}: {e}") from None
  return Recorded(modules, files.sha256_bytes(data))


def compare(study: list[dict], today: list[dict]) -> dict:
  """How today's module entries differ from a study's: names added today, names the study
  holds that are not registered today, and names whose entry changed (listing the fields
  that differ; "source" alone means the module's code changed)."""
  old = {m["name"]: m for m in normalize(study)}
  new = {m["name"]: m for m in normalize(today)}
  changed = {}
  for name in sorted(set(old) & set(new)):
    fields = sorted(k for k in set(old[name]) | set(new[name])
                    if old[name].get(k) != new[name].get(k))
    if fields:
      changed[name] = fields
  return {"added": sorted(set(new) - set(old)), "removed": sorted(set(old) - set(new)),
          "changed": changed}


def gate_name(gate: dict) -> str:
  """A gate's configuration in one line: 'projection {enabled: True} (cut 6, public,
  wikitext-2)'."""
  c = gate["config"]
  params = c.get("defense_params") or {}
  label = params.get("label") or (
      f"{c['defense']} " + json.dumps(params, sort_keys=True) if params else c["defense"])
  return f"{label} (cut {c['cut']}, {c['knowledge']}, {c['corpus']})"


def _config_key(gate: dict) -> str:
  return json.dumps(gate["config"], sort_keys=True)


def verdict_changes(sealed: dict, today: dict, comparison: dict | None = None) -> list[dict]:
  """Gate by gate, how the decisions of scorecard `today` (the same study scored with
  today's registry) differ from those of `sealed`, and why.

  Returns:
    One item per gate: {"gate", "config", "before", "after", "changed", "fitting_added",
    "fitting_removed", "why"}, `why` naming the attacks (e.g. "fits and is not measured on
    it: probe (registered today, not in the study's threat space)").
  """
  comparison = comparison or {"added": [], "removed": [], "changed": {}}
  after = {_config_key(g): g for g in today["gates"]}
  out = []
  for g in sealed["gates"]:
    h = after.get(_config_key(g))
    if h is None:
      continue
    old_fit = set((g.get("fitting") or {}).get("fitting") or [])
    new_fit = set((h.get("fitting") or {}).get("fitting") or [])
    unmeasured = (h.get("fitting") or {}).get("unmeasured") or {}
    why = []
    for name in sorted(new_fit - old_fit):
      where = ("registered today, not in the study's threat space"
               if name in comparison["added"] else
               f"its entry changed today ({', '.join(comparison['changed'].get(name, []))})")
      state = (f"is not measured on it ({unmeasured[name]})" if name in unmeasured
               else "is measured on it")
      why.append(f"{name} fits and {state} ({where})")
    for name in sorted(old_fit - new_fit):
      where = ("not registered today" if name in comparison["removed"] else
               f"its entry changed today ({', '.join(comparison['changed'].get(name, []))})")
      why.append(f"{name} no longer fits ({where})")
    before_reasons, after_reasons = set(g["reasons"]), set(h["reasons"])
    if g["decision"] != h["decision"]:
      why += [f"reason added: {r}" for r in h["reasons"] if r not in before_reasons]
      why += [f"reason gone: {r}" for r in g["reasons"] if r not in after_reasons]
    out.append({"gate": gate_name(g), "config": g["config"], "before": g["decision"],
                "after": h["decision"], "changed": g["decision"] != h["decision"],
                "fitting_added": sorted(new_fit - old_fit),
                "fitting_removed": sorted(old_fit - new_fit), "why": why})
  return out
