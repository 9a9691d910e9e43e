"""Recomputes a run's predictions from its pinned inputs and compares them bit for bit.

  python -m experiments.regenerate --workdir=RUN [--plugins=pkg.module,...]
"""

import sys

from absl import app, flags

from lla import runtime
from lla.attacks import regenerate, registry

_WORKDIR = flags.DEFINE_string("workdir", None, "Run (or study) directory.", required=True)
_PLUGINS = flags.DEFINE_string("plugins", "", "Modules that register the run's plugin attacks.")


def main(argv):
  del argv
  runtime.configure()
  registry.load_plugins(_PLUGINS.value)
  problems = regenerate.regenerate(_WORKDIR.value)
  for problem in problems:
    print(f"MISMATCH {problem}")
  if problems:
    sys.exit(1)
  print(f"OK {_WORKDIR.value}: every prediction regenerated bit for bit")


if __name__ == "__main__":
  app.run(main)
