r"""Verifies every hash of a run directory and names what changed.

  python -m experiments.verify --workdir=runs/k6_public

Exits non-zero if any file changed, is missing or extra, the log chain is
broken or unsealed, a file differs from the sha256 the hash-chained log recorded
when it was written (so a prediction rewritten together with its record's hash
and the manifest is caught), an extended run changed between a seal and its
reopen, or a record's prediction, protocol, truth or capture hash does not match.
Each problem is one line naming the file (docs/run_format.md).

It prints the run's seal hash (`SEAL <sha256>`): the hash of the log's final seal entry,
which chains every entry before it and so every logged file's sha256. A run rewritten and
re-chained from scratch verifies on its own; published elsewhere, this hash is what it
cannot match. `--expect=HASH` exits non-zero (one line) unless the run's seal is HASH.
"""

import re

from absl import app
from absl import flags

from lla.evidence import rundir

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory.",
                               required=True)
_CHECK_CAPTURE = flags.DEFINE_bool("check_capture", True,
                                   "Also verify each capture's manifest.")
_EXPECT = flags.DEFINE_string("expect", None, "The seal hash published for this run (64 hex "
                              "digits): the run must end with that seal.")


def _expect_problem(run: str, expected: str, anchor: dict | None) -> str | None:
  """Why the run's seal is not `expected` (one line), or None."""
  if anchor is None:
    return f"{run}: not sealed, so it has no seal hash to compare with --expect"
  if anchor["hash"] == expected:
    return None
  earlier = [e for e in rundir.log(run).entries()
             if e["event"]["type"] == "seal" and e["hash"] == expected]
  if earlier:
    return (f"{run}: --expect={expected} is an earlier seal (log entry {earlier[0]['index']}); "
            f"the run was reopened and extended since, its seal is now {anchor['hash']}")
  return f"{run}: seal {anchor['hash']} differs from --expect={expected}"


def main(argv):
  del argv
  run = _WORKDIR.value
  expected = None if _EXPECT.value is None else _EXPECT.value.strip().lower()
  if expected is not None and not re.fullmatch(r"[0-9a-f]{64}", expected):
    raise SystemExit(f"--expect={_EXPECT.value!r}: not a sha256 (64 hex digits)")
  problems = rundir.verify(run, _CHECK_CAPTURE.value)
  for p in problems:
    print(f"FAIL {p}")
  if problems:
    raise SystemExit(f"{run}: {len(problems)} problem(s)")
  anchor = rundir.anchor(run)  # A run that verifies ends with a seal.
  print(f"SEAL {anchor['hash']} (log.jsonl entry {anchor['index']})")
  problem = None if expected is None else _expect_problem(run, expected, anchor)
  if problem:
    raise SystemExit(problem)
  print(f"OK {run}: every hash verifies" + ("" if expected is None else
                                           ", and its seal is the one expected"))


if __name__ == "__main__":
  app.run(main)
