r"""Recomputes every number of a run's scorecard from predictions + truth.

  python -m experiments.rescore --workdir=runs/k6_public --config=configs/scoring.py

With an existing scorecard.json, rebuilds it from its own recorded inputs and
exits non-zero (listing differing JSON paths) unless the bytes match. Without
one, scores the run with --config and writes scorecard.json / scorecard.md.
"""

import os

from absl import app
from absl import flags
from ml_collections import config_flags

from lla.evidence import files
from lla.evidence import rundir
from lla.scoring import policy
from lla.scoring import scorecard

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory.",
                               required=True)
_CONFIG = config_flags.DEFINE_config_file("config", "configs/scoring.py",
                                          "Scoring config.")


def main(argv):
  del argv
  run, cfg = _WORKDIR.value, _CONFIG.value
  path = os.path.join(run, rundir.SCORECARD_JSON)
  try:
    if not os.path.exists(path):
      scorecard.score_run(run, cfg)
      print(f"wrote {path}")
      return
    old = files.read_json(path)
    new = scorecard.build_from_inputs(run, old["inputs"],
                                      policy.load_policy(cfg.policy))
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
