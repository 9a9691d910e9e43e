r"""Recomputes every number of a run's scorecard from predictions + truth.

  python -m experiments.rescore --workdir=runs/k6_public --config=configs/scoring.py

Without a scorecard, scores the run with --config (coverage places each record through
the attack registry's module entries) and writes scorecard.json / scorecard.md. With one,
rebuilds it from its own recorded inputs and exits non-zero (listing differing JSON paths)
unless the bytes match; if records were added or retried since it was written (a later
replay extended the run), it is stale: it is rebuilt from the same inputs and rewritten.
A finished (sealed) run is reopened for the write and sealed again (lla.evidence.rundir).
"""

import os

from absl import app
from absl import flags
from ml_collections import config_flags

from lla.attacks import registry
from lla.evidence import files
from lla.evidence import rundir
from lla.scoring import policy
from lla.scoring import scorecard

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory.",
                               required=True)
_CONFIG = config_flags.DEFINE_config_file("config", "configs/scoring.py",
                                          "Scoring config.")


def _inputs_for(run: str, inputs: dict) -> dict:
  """The scorecard's inputs, with the registry's module entries where they lack a
  module that a record names (records added since)."""
  modules = inputs.get("modules") or []
  known = {m["name"] for m in modules}
  if not {r.attack for r in rundir.load_records(run)} <= known:
    extra = [m for m in registry.module_entries() if m["name"] not in known]
    inputs = dict(inputs, modules=modules + extra)
  return inputs


def main(argv):
  del argv
  run, cfg = _WORKDIR.value, _CONFIG.value
  path = os.path.join(run, rundir.SCORECARD_JSON)
  try:
    if not os.path.exists(path):
      with rundir.extending(run):
        scorecard.score_run(run, cfg)
      print(f"wrote {path}")
      return
    old = files.read_json(path)
    stale = rundir.written_since(run, rundir.SCORECARD_JSON)
    new = scorecard.build_from_inputs(run, _inputs_for(run, old["inputs"]) if stale
                                      else old["inputs"], policy.load_policy(cfg.policy))
    if stale:
      with rundir.extending(run):
        scorecard.write(run, new, overwrite=True)
      print(f"rescored {path}: {len(stale)} record/prediction file(s) written since it was "
            "(rebuilt from its own inputs)")
      return
  except (ValueError, FileNotFoundError, KeyError) as e:
    raise SystemExit(f"{run}: cannot re-score: {e}") from None
  with open(path, "rb") as f:
    if f.read() == scorecard.to_bytes(new):
      print(f"OK {path}: reproduced byte for byte")
      return
  for d in scorecard.diff(old, new) or ["bytes differ (formatting)"]:
    print(f"MISMATCH {d}")
  raise SystemExit(f"{path}: re-scoring does not reproduce the scorecard")


if __name__ == "__main__":
  app.run(main)
