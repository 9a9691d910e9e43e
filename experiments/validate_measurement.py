r"""Validates the measurement: known answers, recomputation, faults, metamorphic.

  python -m experiments.validate_measurement --workdir=/tmp/validation

Prints one row per case (case, kind, expected, got, pass), writes
validation.json to --workdir if given, and exits non-zero on any failure.
"""

import os

from absl import app
from absl import flags

from lla.evidence import files
from lla.scoring import validation

_WORKDIR = flags.DEFINE_string("workdir", None,
                               "Where to write validation.json (optional).")


def main(argv):
  del argv
  results = validation.run_cases()
  print(validation.table(results))
  if _WORKDIR.value:
    os.makedirs(_WORKDIR.value, exist_ok=True)
    files.atomic_write_json(
        os.path.join(_WORKDIR.value, "validation.json"),
        [{k: repr(v) if k in ("expected", "got") else v
          for k, v in r.items()} for r in results], overwrite=True)
  failed = [r["case"] for r in results if not r["pass"]]
  if failed:
    raise SystemExit(f"{len(failed)} validation case(s) failed: {failed}")


if __name__ == "__main__":
  app.run(main)
