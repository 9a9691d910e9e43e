"""Qualification evidence of the main job (PROTOCOL section 5: the qualification matrix).

How far each attack module itself is trusted, kept apart from its attack results. Three
sources, each item naming the test or the runs it rests on:

  tests       each module's `AttackSpec.checks`: tests of this repository that compare it
              with a reference implementation, brute force or known answers. The suite
              enforces them, so each is `pass` evidence of its kind.
  real model  the study's undefended runs on the real (fine-tuned) target: the setting
              where the module's pooled excess over the frequency baseline is largest;
              `pass` if that excess clears the policy's positive-control bar (the module
              finds a leak where one exists), `partial` if it ran but never did.
  adaptation  a defense-aware or adaptive module on each defended configuration it ran
              on: `pass` where its pooled excess is at least that of the defense-unaware
              attack it refines (`reference_attack`) on the same configuration,
              `partial` where it is below (the adaptation did not help there).
"""

from __future__ import annotations

from lla.scoring import policy as policy_lib
from lla.scoring import scorecard

_SETTING = ("cut", "knowledge", "corpus")


def from_checks(modules: list[dict]) -> list[dict]:
  """`pass` items for every (kind, test id, what it checks) of each module's checks."""
  return [{"module": m["name"], "kind": kind, "status": "pass", "evidence": test,
           "detail": detail} for m in modules for kind, test, detail in m.get("checks", ())]


def _runs(card: dict, config: dict, attack_key: str) -> list[str]:
  return sorted(r["run_id"] for r in card["rows"] if r["status"] == "ok" and
                all(r[f] == config[f] for f in ("defense", *_SETTING)) and
                (r["attack"] if r["scored_positions"] == "all"
                 else f"{r['attack']}[t>=1]") == attack_key)


def _where(config: dict) -> str:
  return f"k = {config['cut']}, {config['knowledge']}, {config['corpus']}"


def from_card(card: dict, modules: list[dict], pol: policy_lib.Policy) -> list[dict]:
  """Real-model and adaptation items from a scorecard of the study (see module doc)."""
  names = {m["name"]: m for m in modules}
  out, best = [], {}
  for group in card["undefended"]:
    for key, metrics in group["pooled"].items():
      module = key.split("[")[0]
      if module in names and (module not in best or
                              metrics["excess_pp"] > best[module][1]["excess_pp"]):
        best[module] = (group["config"], metrics, key)
  for module, (config, metrics, key) in sorted(best.items()):
    runs = _runs(card, config, key)
    cleared = metrics["excess_pp"] > pol.positive_control_pp
    out.append({"module": module, "kind": "real_model",
                "status": "pass" if cleared else "partial",
                "evidence": "runs " + ", ".join(runs),
                "detail": f"largest undefended excess {metrics['excess_pp']:+.2f} pp over the "
                          f"frequency baseline ({_where(config)}, {metrics['n']} tokens, "
                          f"{len(runs)} runs); positive-control bar "
                          f"{pol.positive_control_pp:g} pp"})
  for gate in card["gates"]:
    for key, metrics in sorted(gate["pooled"].items()):
      spec = names.get(key.split("[")[0])
      if spec is None or not (spec.get("defense_aware") or spec.get("adapts_to")):
        continue
      reference = gate["pooled"].get(spec.get("reference_attack") or "")
      config = gate["config"]
      if reference is None:
        status, versus = "partial", "its defense-unaware reference attack was not run here"
      else:
        status = "pass" if metrics["excess_pp"] >= reference["excess_pp"] else "partial"
        versus = (f"defense-unaware {spec['reference_attack']} "
                  f"{reference['excess_pp']:+.2f} pp")
      out.append({"module": spec["name"], "kind": "adaptation", "status": status,
                  "evidence": "runs " + ", ".join(_runs(card, config, key)),
                  "detail": f"{config['defense_params'].get('label', config['defense'])} "
                            f"({_where(config)}): excess {metrics['excess_pp']:+.2f} pp, "
                            f"{versus}"})
  return out


def evidence(run_dir: str, policy_name: str, modules: list[dict]) -> list[dict]:
  """Every qualification item for the modules of a study directory."""
  pol = policy_lib.load_policy(policy_name)
  card = scorecard.build(run_dir, pol, contrasts=False)
  return from_checks(modules) + from_card(card, modules, pol)
