"""Compiled executables are dropped before they exhaust the process's memory mappings
(lla.runtime.release_compiled_when_crowded): measured on this process's /proc/self/maps."""

import jax
import jax.numpy as jnp

from lla import runtime
from lla.attacks import workspace

SHAPES = 60


def held_mappings() -> int:
  with open("/proc/self/maps") as f:
    return len(f.readlines())


@jax.jit
def _through_jit(x):
  return jnp.sin(x) * 2.0 + 1.0


@jax.jit
def _through_workspace(x):
  return jnp.cos(x) - 3.0


def _compile_many():
  """SHAPES executables in JAX's cache and SHAPES in lla's (workspace.compiled)."""
  for n in range(1, SHAPES + 1):
    _through_jit(jnp.ones(n)).block_until_ready()
    executable, _, _, _ = workspace.compiled(_through_workspace, jnp.ones(n))
    executable(jnp.ones(n)).block_until_ready()


def test_crowded_process_drops_every_cached_executable_and_their_mappings():
  runtime.release_compiled_when_crowded(fraction=0.0)  # start from empty caches
  before = held_mappings()
  _compile_many()
  grown = held_mappings() - before
  # Each XLA:CPU executable maps its code and data (three or more mappings).
  assert grown >= 3 * 2 * SHAPES, grown
  assert _through_jit._cache_size() == SHAPES
  held, limit = runtime.memory_mappings()
  assert abs(held - held_mappings()) <= 2 and limit > 0

  assert runtime.release_compiled_when_crowded(fraction=0.0)
  assert _through_jit._cache_size() == 0
  assert not any(key[0] is _through_workspace for key in workspace._EXECUTABLES)
  assert held_mappings() - before < 0.1 * grown


def test_uncrowded_process_keeps_its_executables():
  _compile_many()
  held = held_mappings()
  assert not runtime.release_compiled_when_crowded(fraction=1.0)
  assert _through_jit._cache_size() == SHAPES
  assert sum(key[0] is _through_workspace for key in workspace._EXECUTABLES) == SHAPES
  assert held_mappings() == held


def test_held_arrays_counts_the_live_arrays_bytes_by_shape():
  every = 10**6  # groups listed: all of them (other tests' arrays may still be alive)
  before = runtime.held_arrays(largest=every)
  big = jnp.zeros((301, 701), jnp.float32)       # 843,604 bytes
  pair = [jnp.ones((5, 3), jnp.int8) for _ in range(2)]  # 15 bytes each
  held = runtime.held_arrays(largest=every)
  assert held["count"] == before["count"] + 3
  assert abs((held["mb"] - before["mb"]) * 2**20 - (301 * 701 * 4 + 2 * 15)) < 1e-3
  assert "float32[301,701] x 1: 0.8 MB" in held["largest"]
  assert "int8[5,3] x 2: 0.0 MB" in held["largest"]
  sizes = [float(line.split(": ")[1].split()[0]) for line in held["largest"]]
  assert sizes == sorted(sizes, reverse=True)
  del big, pair
  assert runtime.held_arrays(largest=every)["count"] == before["count"]
