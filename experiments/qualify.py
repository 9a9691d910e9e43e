r"""Runs the qualification checks of the attacks a study measured and logs their outcomes.

  python -m experiments.qualify --workdir=RUN/study

For any study with a threat space (a replay run, the main job's study): the declared checks
(`AttackSpec.checks`) of every module with a measured record in it run in a pytest
subprocess on this checkout, and their outcomes are logged in the study as
inputs/qualification_outcomes.json (lla.study.qualification; docs/run_format.md), the
study resealed. It prints one line per check: module, kind, status and test. The main job
does the same when it scores (config.qualification), and its scorecard carries the matrix.
"""

import os

from absl import flags

from experiments import cli
from lla.evidence import rundir
from lla.scoring import threat_space
from lla.study import qualification

_WORKDIR = flags.DEFINE_string("workdir", None, "The study (run directory).", required=True)
_MODULES = flags.DEFINE_list("modules", [], "Only these modules' checks (default: every "
                             "module the study measured).")
_TIMEOUT = flags.DEFINE_float("timeout_minutes", 30.0, "The pytest run's wall-clock limit; "
                              "past it every check is unmeasured.", lower_bound=0.1)


def main(argv):
  del argv
  study = _WORKDIR.value
  if not os.path.exists(os.path.join(study, rundir.LOG)):
    raise SystemExit(f"error: {study}: not a run directory (no {rundir.LOG})")
  with cli.one_line_errors(ValueError, RuntimeError):
    recorded = threat_space.read(study)
    if recorded is None:
      raise ValueError(f"{study}: records no threat space ({threat_space.FILE}), so no "
                       "module declares checks here")
    document = qualification.run_and_record(study, recorded.modules,
                                            timeout_s=60.0 * _TIMEOUT.value,
                                            only=tuple(_MODULES.value))
  if document.get("not_run"):
    print(f"not run: {document['not_run']}")
  for item in qualification.from_checks(recorded.modules, document):
    if item["module"] in document.get("modules", ()):
      print(f"{item['module']} {item['kind']} {item['status']} {item['evidence']}")
  print(f"{len(document['tests'])} test(s) in {document['wall_s']:.0f} s, logged in "
        f"{os.path.join(study, qualification.OUTCOMES_FILE)}")


if __name__ == "__main__":
  cli.run(main)
