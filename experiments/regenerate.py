"""Recomputes a run's predictions from its pinned inputs and compares them bit for bit.

  python -m experiments.regenerate --workdir=RUN [--plugins=pkg.module,...] [--per_attack=N]

A run it cannot regenerate as stored (a missing or changed input, a module that now declares
a budget field the run's protocol lacks) is one line on stderr and exit status 1. Beside the
verdict it names every difference between the provenance the records carry
(jax / jaxlib / numpy / Python versions, XLA flags, numeric jax config, device kind and
count, commit) and this machine's: the usual cause of a mismatch on another machine.
"""

import sys

from absl import flags

from experiments import cli
from lla import provenance, runtime
from lla.attacks import registry
from lla.capture import store
from lla.model import checkpoint
from lla.replay import regenerate

_WORKDIR = flags.DEFINE_string("workdir", None, "Run (or study) directory.", required=True)
_PLUGINS = flags.DEFINE_string("plugins", "", "Modules that register the run's plugin attacks.")
_PER_ATTACK = flags.DEFINE_integer(
    "per_attack", None, "Spot check: regenerate only the first N measured records of each "
    "module (default: every record).", lower_bound=1)


def main(argv):
  del argv
  runtime.configure()
  with cli.one_line_errors(regenerate.RegenerationError, store.CaptureError,
                           checkpoint.CheckpointError, registry.PluginError, FileNotFoundError):
    registry.load_plugins(_PLUGINS.value)
    result = regenerate.check(_WORKDIR.value, per_attack=_PER_ATTACK.value)
  for problem in result.problems:
    print(f"MISMATCH {problem}")
  for skipped in result.skipped:
    print(f"SKIPPED {skipped}")
  for line in result.provenance:
    kind = "PROVENANCE" if provenance.numeric(line) else "PROVENANCE (checkout only)"
    print(f"{kind} {line}")
  what = ("every prediction" if _PER_ATTACK.value is None else
          f"{len(result.regenerated)} sampled prediction file(s)")
  verdict = (f"{what} regenerated bit for bit" if not result.problems else
             f"{len(result.problems)} prediction file(s) differ")
  where = (f"; {len(result.provenance)} provenance difference(s) listed above"
           if result.provenance else "; same provenance as recorded")
  if result.problems:
    print(f"FAIL {_WORKDIR.value}: {verdict}{where}")
    sys.exit(1)
  print(f"OK {_WORKDIR.value}: {verdict}{where}")


if __name__ == "__main__":
  cli.run(main)
