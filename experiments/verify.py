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

A seal can also be signed with an SSH key (lla.evidence.signing; `ssh-keygen -Y`), so that
one published public key vouches for every run its holder seals:

  python -m experiments.verify --workdir=RUN --sign_with=~/.ssh/id_ed25519   # writes RUN.seal.sig
  python -m experiments.verify --workdir=RUN --signers=allowed_signers --signer=alice@lab

The signature lies beside the run (`--signature`, default `<workdir>.seal.sig`), so signing
changes no file of the run; it is written only for a run that verifies.
"""

import os
import re

from absl import flags

from experiments import cli
from lla.evidence import files
from lla.evidence import rundir
from lla.evidence import signing
from lla.scoring import scorecard

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory.",
                               required=True)
_CHECK_CAPTURE = flags.DEFINE_bool("check_capture", True,
                                   "Also verify each capture's manifest.")
_EXPECT = flags.DEFINE_string("expect", None, "The seal hash published for this run (64 hex "
                              "digits): the run must end with that seal.")
_SIGN_WITH = flags.DEFINE_string("sign_with", None, "An SSH private key: sign the run's seal "
                                 "with it (written to --signature) once the run verifies.")
_SIGNERS = flags.DEFINE_string("signers", None, "An allowed-signers file (ssh-keygen(1)): the "
                               "signature in --signature must be --signer's, listed there.")
_SIGNER = flags.DEFINE_string("signer", None, "The identity (principal) that must have signed.")
_SIGNATURE = flags.DEFINE_string("signature", None, "The seal's signature file (default "
                                 "<workdir>.seal.sig, beside the run).")


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
  if bool(_SIGNERS.value) != bool(_SIGNER.value):
    raise SystemExit("--signers and --signer go together: the allowed-signers file and the "
                     "identity that must have signed")
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
  card_path = os.path.join(run, rundir.SCORECARD_JSON)
  if os.path.exists(card_path):
    # Every hash holds, but the verdicts may be of an earlier state of the study (a later
    # replay resealed it): said, with how to rebuild them.
    changed = scorecard.stale(run, files.read_json(card_path))
    if changed:
      print(f"STALE {scorecard.stale_line(run, changed)}")
  problem = None if expected is None else _expect_problem(run, expected, anchor)
  if problem:
    raise SystemExit(problem)
  signature = _SIGNATURE.value or run.rstrip("/") + ".seal.sig"
  try:
    if _SIGN_WITH.value:
      signed = signing.sign(anchor["hash"], _SIGN_WITH.value)
      with open(signature, "wb") as f:
        f.write(signed)
      print(f"SIGNED seal {anchor['hash']} with {_SIGN_WITH.value}: {signature}")
    if _SIGNERS.value:
      problem = signing.check(anchor["hash"], signature, _SIGNERS.value, _SIGNER.value)
      if problem:
        raise SystemExit(problem)
      print(f"SIGNATURE {signature}: {_SIGNER.value}'s, as listed in {_SIGNERS.value}")
  except (signing.SigningError, OSError) as e:
    raise SystemExit(f"{run}: {e}") from None
  print(f"OK {run}: every hash verifies" + ("" if expected is None else
                                           ", and its seal is the one expected") +
        ("" if not _SIGNERS.value else ", and its seal is signed by the expected key"))


if __name__ == "__main__":
  cli.run(main)
