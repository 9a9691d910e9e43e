"""Processes that share one persistent compilation cache (lla.runtime.configure): a second
process loads every executable the first compiled and compiles none itself, counted both by
JAX's monitoring events (lla.runtime.compile_since) and by the cache directory's files; a
process started with `runtime.worker_environment()` (a sweep's workers) configures its
parent's directory."""

import json
import os
from pathlib import Path
import subprocess
import sys

import jax
import numpy as np

from lla import runtime
from lla.sweep import backends

REPO = Path(__file__).resolve().parent.parent
# A small program compiled in a fresh process: [3, 4] -> tanh(x x^T) summed, with its
# compile counts since the process configured the cache from $LLA_COMPILATION_CACHE_DIR.
_WORKER = """
import json
import jax
import jax.numpy as jnp
import numpy as np
from lla import runtime

directory = runtime.configure()
before = runtime.compile_totals()
x = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
value = jax.jit(lambda a: jnp.tanh(a @ a.T).sum())(x)
print(json.dumps({"directory": str(directory), "value": float(value),
                  **runtime.compile_since(before)}))
"""


def _worker(env: dict) -> dict:
  done = subprocess.run([sys.executable, "-c", _WORKER], cwd=REPO, capture_output=True,
                        text=True, timeout=300,
                        env={**os.environ, "JAX_PLATFORMS": "cpu", **env})
  assert done.returncode == 0, done.stderr[-2000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


def _entries(directory: Path) -> set[str]:
  return {p.name for p in directory.glob("*-cache")}  # JAX's lru_cache names them so


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
  cache = tmp_path / "xla"
  first = _worker({runtime.ENV_VAR: str(cache)})
  written = _entries(cache)
  second = _worker({runtime.ENV_VAR: str(cache)})

  x = np.arange(12, dtype=np.float64).reshape(3, 4) / 10
  for run in (first, second):
    assert run["directory"] == str(cache)
    np.testing.assert_allclose(run["value"], np.tanh(x @ x.T).sum(), rtol=1e-6)
  # The first compiles every executable and stores each (no floor on compile time or size).
  assert first["executables"] >= 1
  assert first["cache_hits"] == 0 and first["compiled"] == first["executables"]
  assert first["cache_writes"] == first["executables"] == len(written)
  # The second builds the same executables, every one loaded from the cache: no compile,
  # nothing new on disk.
  assert second["executables"] == first["executables"]
  assert second["cache_hits"] == second["executables"] and second["compiled"] == 0
  assert second["cache_writes"] == 0 and _entries(cache) == written


def test_a_worker_started_with_the_worker_environment_shares_the_parents_cache(tmp_path):
  # The suite's process has its own cache (tests/conftest.py); the worker is pointed at it
  # through the environment alone, and asked to compile nothing there.
  probe = ("from lla import runtime; import jax; runtime.configure(); "
           "print(jax.config.jax_compilation_cache_dir)")
  done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                        text=True, timeout=300,
                        env={**os.environ, "JAX_PLATFORMS": "cpu",
                             runtime.ENV_VAR: str(tmp_path / "elsewhere"),
                             **runtime.worker_environment()})
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.strip().splitlines()[-1] == jax.config.jax_compilation_cache_dir


def test_a_sweeps_remote_workers_are_given_the_drivers_cache():
  # Ray's actors start with this environment; submitit's jobs get worker_environment().
  assert backends._forwarded_env()[runtime.ENV_VAR] == jax.config.jax_compilation_cache_dir
