r"""Verifies every hash of a run directory and names what changed.

  python -m experiments.verify --workdir=runs/k6_public

Exits non-zero if any file changed, is missing or extra, the log chain is
broken or unsealed, a file differs from the sha256 the hash-chained log recorded
when it was written (so a prediction rewritten together with its record's hash
and the manifest is caught), an extended run changed between a seal and its
reopen, or a record's prediction, protocol, truth or capture hash does not match.
Each problem is one line naming the file (docs/run_format.md).
"""

from absl import app
from absl import flags

from lla.evidence import rundir

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory.",
                               required=True)
_CHECK_CAPTURE = flags.DEFINE_bool("check_capture", True,
                                   "Also verify each capture's manifest.")


def main(argv):
  del argv
  problems = rundir.verify(_WORKDIR.value, _CHECK_CAPTURE.value)
  for p in problems:
    print(f"FAIL {p}")
  if problems:
    raise SystemExit(f"{_WORKDIR.value}: {len(problems)} problem(s)")
  print(f"OK {_WORKDIR.value}: every hash verifies")


if __name__ == "__main__":
  app.run(main)
