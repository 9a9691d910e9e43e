r"""Recomputes every number of a run's scorecard from the study alone.

  python -m experiments.rescore --workdir=runs/k6_public --config=configs/scoring.py
  python -m experiments.rescore --workdir=runs/k6_public --against=current [--plugins=pkg.mod]

Everything comes from the run directory: predictions, records, the ground truth of the
captures the records name, the study's threat space (inputs/threat_space.json, the attack
modules registered when the study was built or extended) and the tokenizer pinned for text
ROUGE-L (inputs/tokenizer.json). Today's attack registry is never read for a verdict, so
an attack registered since, or one unknown today, changes nothing.

Without a scorecard, scores the run with --config and writes scorecard.json / scorecard.md
(a run that records no threat space gets today's registry recorded first; text ROUGE-L
uses the tokenizer the study pins, and a study that pins none gets its token metrics and
its text metrics marked unavailable with the reason: nothing is read from $LLA_DATA_DIR,
whose GPT-2 tokenizer need not be the study's model's). With one, rebuilds it from its own
recorded inputs and exits non-zero (listing differing JSON paths) unless the bytes match;
if records were added or retried, or the threat space was rewritten, since it was written
(a later replay extended the run), it is stale: it is rebuilt from what the study holds now
and rewritten. A finished (sealed) run is reopened for the write and sealed again
(lla.evidence.rundir).

--against=current also scores the study with today's registry (the built-in attacks and
--plugins) in memory, writing nothing, and lists how its modules differ from the study's
and, gate by gate, which verdicts would change and why (e.g. a newly registered attack that
fits a defended capture withholds its PASS until it is measured on it). The exit status
is that of the reproduction.
"""

import os
import sys

from absl import flags
from ml_collections import config_flags

from experiments import cli

from lla.evidence import files
from lla.evidence import rundir
from lla.scoring import policy
from lla.scoring import scorecard
from lla.scoring import threat_space

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory.")
_CONFIG = config_flags.DEFINE_config_file("config", "configs/scoring.py",
                                          "Scoring config.")
_AGAINST = flags.DEFINE_string(
    "against", "", "'current': also say which verdicts today's attack registry would "
    "change, and why.")
_PLUGINS = flags.DEFINE_string(
    "plugins", "", "Modules that register attacks (pkg.module,...), loaded into today's "
    "registry (for --against=current, and for a run that records no threat space yet).")

_ERRORS = (ValueError, FileNotFoundError, KeyError)


def _registry():
  """Today's attack registry: imported only to compare with it, or to record it into a run
  that records no threat space (re-scoring a study never imports the attacks)."""
  from lla.attacks import registry  # pylint: disable=g-import-not-at-top
  return registry


def _record_if_absent(run: str, card_modules=None) -> None:
  """A run that records no threat space (made before runs recorded theirs) gets today's
  registry, merged over the modules its old scorecard listed."""
  if threat_space.read(run) is None:
    threat_space.record(run, threat_space.merge(card_modules or [],
                                                 _registry().module_entries()))


def _rebuild_stale(run: str, old: dict, pol) -> dict:
  inputs = old["inputs"]
  if inputs.get("modules_file") is None:
    # A scorecard that predates threat space files: from now on, the study's file.
    _record_if_absent(run, inputs.get("modules"))
    inputs = dict(inputs, modules=None, modules_file={"file": threat_space.FILE,
                                                       "sha256": None})
  sha = inputs.get("tokenizer_sha256")
  if sha is not None and scorecard.pinned_tokenizer(run) is None:
    scorecard.pin_tokenizer(run, scorecard.tokenizer_for(run, sha))
  return scorecard.build_from_inputs(run, inputs, pol, refresh=True)


def against_current(run: str, card: dict, pol) -> list[str]:
  """Lines saying how today's registry differs from the study's threat space and which
  verdicts it would change."""
  recorded = threat_space.read(run)
  study = recorded.modules if recorded else (card["inputs"].get("modules") or [])
  today = _registry().module_entries()
  comparison = threat_space.compare(study, today)
  where = (f"{threat_space.FILE} sha256 {recorded.sha256[:16]}..." if recorded
           else "the scorecard's inputs")
  lines = [f"threat space of the study: {len(study)} module(s) ({where}); today's registry: "
           f"{len(today)}"]
  by_name = {m["name"]: m for m in today}
  for name in comparison["added"]:
    source = (by_name[name].get("source") or {}).get("module")
    lines.append(f"  + {name}: registered today ({source}), not in the study's threat space")
  for name in comparison["removed"]:
    lines.append(f"  - {name}: in the study's threat space, not registered today")
  for name, fields in comparison["changed"].items():
    lines.append(f"  ~ {name}: entry changed ({', '.join(fields)})")
  alternative = scorecard.build(run, pol, None, today, None, (), contrasts=False)
  changes = threat_space.verdict_changes(card, alternative, comparison)
  for c in changes:
    if c["changed"]:
      lines.append(f"WOULD CHANGE gate {c['gate']}: {c['before']} -> {c['after']}: "
                   + "; ".join(c["why"]))
    elif c["why"]:
      lines.append(f"same verdict, gate {c['gate']}: {c['before']}: " + "; ".join(c["why"]))
  n = sum(c["changed"] for c in changes)
  lines.append(f"{n} of {len(changes)} gate verdict(s) would change under today's registry"
               + (" (the sealed scorecard is unchanged: rescore reads the study's threat "
                  "space)" if n else ""))
  return lines


def main(argv):
  if len(argv) > 1:
    raise SystemExit(f"error: unexpected argument(s): {' '.join(argv[1:])}")
  run, cfg, against = _WORKDIR.value, _CONFIG.value, _AGAINST.value
  if not run:
    raise SystemExit("error: --workdir is required (the run directory to re-score)")
  if against not in ("", "current"):
    raise SystemExit(f"error: --against={against}: the only comparison is 'current' (today's "
                     "attack registry)")
  if not os.path.isdir(run) or not os.path.exists(os.path.join(run, rundir.PROTOCOL)):
    raise SystemExit(f"error: {run}: not a run directory (no {rundir.PROTOCOL})")
  path = os.path.join(run, rundir.SCORECARD_JSON)
  try:
    if _PLUGINS.value:
      registry = _registry()
      try:
        registry.load_plugins(_PLUGINS.value)
      except registry.PluginError as e:
        raise ValueError(str(e)) from None
    pol = policy.load_policy(cfg.policy)
    if not os.path.exists(path):
      # From the study alone: its pinned tokenizer, or text metrics marked unavailable.
      with rundir.extending(run):
        _record_if_absent(run)
        card = scorecard.score_run(run, cfg, study_alone=True)
      print(f"wrote {path}")
    else:
      old = files.read_json(path)
      stale = scorecard.stale(run, old)
      if stale:
        with rundir.extending(run):
          card = _rebuild_stale(run, old, pol)
          scorecard.write(run, card, overwrite=True)
        print(f"rescored {path}: {len(stale)} file(s) written since it was "
              f"({', '.join(stale[:3])}{', ...' if len(stale) > 3 else ''}; rebuilt from what "
              "the study holds now)")
      else:
        card = scorecard.build_from_inputs(run, old["inputs"], pol)
        with open(path, "rb") as f:
          if f.read() != scorecard.to_bytes(card):
            for d in scorecard.diff(old, card) or ["bytes differ (formatting)"]:
              print(f"MISMATCH {d}")
            raise SystemExit(f"{path}: re-scoring does not reproduce the scorecard")
        print(f"OK {path}: reproduced byte for byte from the study alone")
    if against == "current":
      print("\n".join(against_current(run, card, pol)))
  except _ERRORS as e:
    message = e.args[0] if isinstance(e, KeyError) and e.args else e
    # One line (a missing data directory lists every place it looked, one per line).
    print(f"{run}: cannot re-score: {' '.join(str(message).split())}", file=sys.stderr)
    raise SystemExit(1) from None


if __name__ == "__main__":
  cli.run(main)
