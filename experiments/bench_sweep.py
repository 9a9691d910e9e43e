"""A sweep's wall time against the sum of its cells run one at a time (prints, writes JSON).

  python -m experiments.bench_sweep --config=configs/sweep.py:cpu --workdir=/tmp/bench_sweep
  python -m experiments.bench_sweep --config=configs/sweep.py:cpu --workdir=/tmp/bench_sweep \
      --backend=ray

Runs the whole sweep once (experiments.sweep in a fresh process and --workdir), then every
cell alone, each in a fresh process and --workdir (`--cells=<id>`), as one-cell jobs would
run. The persistent compilation cache is off in every run, so that an alone-run compiles
what it runs instead of loading what the sweep compiled. The ratio (sweep / sum of alone
runs) is what sharing buys: stages computed once per group, executables compiled once per
worker, one process start, and (ray) cells of different groups in parallel.
"""

import json
import os
import subprocess
import sys
import time

from absl import app, flags
from ml_collections import config_flags

from lla.sweep import cells as cells_lib
from lla.sweep import isoflop

_CONFIG = config_flags.DEFINE_config_file("config", "configs/sweep.py:cpu", "Sweep config.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Scratch directory (one sub-directory per run).",
                               required=True)
_BACKEND = flags.DEFINE_string("backend", "local", "Backend of the whole sweep.")


def _sweep(workdir: str, *extra: str) -> float:
  passthrough = [a for a in sys.argv[1:] if a.startswith("--config")]
  env = dict(os.environ, LLA_COMPILATION_CACHE_DIR="off")
  start = time.perf_counter()
  subprocess.run([sys.executable, "-m", "experiments.sweep", *passthrough,
                  f"--workdir={workdir}", *extra], check=True, env=env)
  return time.perf_counter() - start


def main(argv):
  del argv
  cells = cells_lib.expand(isoflop.resolve(_CONFIG.value))
  root = _WORKDIR.value
  sweep_s = _sweep(os.path.join(root, "sweep"), f"--backend={_BACKEND.value}")
  alone = {c.cell_id: _sweep(os.path.join(root, f"alone_{c.cell_id}"), f"--cells={c.cell_id}")
           for c in cells}
  total = sum(alone.values())
  result = {"config": _CONFIG.value.name, "backend": _BACKEND.value, "cells": len(cells),
            "groups": len(cells_lib.groups(cells)), "sweep_wall_s": sweep_s,
            "alone_wall_s": alone, "alone_sum_s": total, "ratio": sweep_s / total,
            "cpu_count": os.cpu_count()}
  with open(os.path.join(root, "bench_sweep.json"), "w") as f:
    json.dump(result, f, indent=2)
  print(f"{len(cells)} cells in {result['groups']} groups: sweep ({_BACKEND.value}) "
        f"{sweep_s:.1f} s, cells one at a time {total:.1f} s, ratio {sweep_s / total:.3f}")


if __name__ == "__main__":
  app.run(main)
