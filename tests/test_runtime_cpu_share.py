"""CPU shares for processes that split one machine (lla.runtime.cpu_share, pin_to_cpu_share)
and the suite's use of them (tests/conftest.py pins each pytest-xdist worker).

The partition is checked against numpy's array_split; pinning runs in a child process that
first widens its affinity to every CPU of the machine, so that it sees the same CPUs
whether this test runs in a pinned xdist worker or alone."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lla import runtime

_TESTS = Path(__file__).resolve().parent

# The child: every CPU, then pinned (through the conftest's worker hook when it has a worker
# name), then a thread and an XLA computation started; prints each thread's affinity.
_CHILD = r"""
import json, os, sys, threading
sys.path.insert(0, sys.argv[1])
every = set(range(os.cpu_count()))
os.sched_setaffinity(0, every)
from lla import runtime
import conftest
before = set(os.listdir("/proc/self/task"))
if sys.argv[2] == "runtime":
  runtime.pin_to_cpu_share(int(sys.argv[3]), int(sys.argv[4]))
else:
  conftest._pin_xdist_worker()
import jax, jax.numpy as jnp
x = jnp.ones((512, 512))
(x @ x).block_until_ready()
seen = threading.Event()
thread = threading.Thread(target=seen.wait)
thread.start()
def allowed(tid):
  with open(f"/proc/self/task/{tid}/status") as f:
    line = next(l for l in f if l.startswith("Cpus_allowed_list"))
  out = set()
  for part in line.split(":")[1].strip().split(","):
    low, _, high = part.partition("-")
    out.update(range(int(low), int(high or low) + 1))
  return sorted(out)
later = sorted(set(os.listdir("/proc/self/task")) - before)
print(json.dumps({"every": sorted(every), "main": sorted(os.sched_getaffinity(0)),
                  "started_after": [allowed(tid) for tid in later]}))
seen.set()
thread.join()
"""


def _child(*args: str, env: dict | None = None) -> dict:
  environment = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
  environment.update(env or {})
  out = subprocess.run([sys.executable, "-c", _CHILD, str(_TESTS), *args], env=environment,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("num_cpus", [1, 2, 3, 7, 16])
@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_shares_are_numpys_array_split_of_the_sorted_cpus(num_cpus, count):
  rng = np.random.default_rng(num_cpus * 10 + count)
  cpus = sorted(rng.choice(64, size=num_cpus, replace=False).tolist())
  shuffled = list(rng.permutation(cpus))
  shares = [runtime.cpu_share(i, count, shuffled) for i in range(count)]
  if count > num_cpus:
    assert shares == [None] * count
    return
  expected = [part.tolist() for part in np.array_split(np.asarray(cpus), count)]
  assert shares == expected
  assert sorted(c for share in shares for c in share) == cpus  # disjoint, every CPU once


@pytest.mark.parametrize("index, count", [(-1, 2), (2, 2), (0, 0)])
def test_a_process_outside_the_count_is_refused(index, count):
  with pytest.raises(ValueError, match="is not one of"):
    runtime.cpu_share(index, count, [0, 1])


def test_pinning_holds_for_threads_started_afterwards_xlas_among_them():
  seen = _child("runtime", "1", "2")
  every = seen["every"]
  expected = np.array_split(np.asarray(every), 2)[1].tolist() if len(every) >= 2 else every
  assert seen["main"] == expected
  # XLA's pool and the Python thread, all started after the pin, inherit it.
  assert len(seen["started_after"]) >= 2
  assert all(allowed == expected for allowed in seen["started_after"]), seen


@pytest.mark.parametrize("worker, count", [("gw0", "2"), ("gw1", "2"), (None, None)])
def test_the_suite_pins_each_xdist_worker_to_its_share(worker, count):
  env = {"PYTEST_XDIST_WORKER": worker, "PYTEST_XDIST_WORKER_COUNT": count} if worker else {}
  seen = _child("conftest", env=env)
  every = seen["every"]
  if worker is None or len(every) < 2:  # not a worker, or no share to give: untouched
    assert seen["main"] == every
  else:
    assert seen["main"] == np.array_split(np.asarray(every), 2)[int(worker[2:])].tolist()
