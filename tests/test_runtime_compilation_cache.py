"""The persistent compilation cache the suite runs under (tests/conftest.py): on for this
process before any test compiled, and an executable it loads is the one XLA compiled: the
same outputs, FLOP count and memory analysis, checked against a hand count."""

import collections
from pathlib import Path

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np

M, K, N = 48, 96, 160


def _tanh_matmul_sum(x, w):
  """[M, K] x [K, N] -> scalar."""
  return jnp.tanh(x @ w).sum()


def _compile_with_events(x, w):
  events = collections.Counter()

  def count(event, **kwargs):
    del kwargs
    events[event] += 1

  jax.monitoring.register_event_listener(count)
  try:
    # A new closure each time: JAX's in-memory caches key on the function, so only the
    # cache on disk, keyed on the computation, can answer.
    compiled = jax.jit(lambda a, b: _tanh_matmul_sum(a, b)).lower(x, w).compile()
  finally:
    jax.monitoring.unregister_event_listener(count)
  return compiled, events


def test_the_suite_compiles_into_a_cache_of_its_own_and_loads_the_same_executable():
  directory = jax.config.jax_compilation_cache_dir
  assert directory and Path(directory).name.startswith("lla-test-xla-"), directory
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((K, N)) / np.sqrt(K), jnp.float32)

  before = set(Path(directory).iterdir())
  first, first_events = _compile_with_events(x, w)
  second, second_events = _compile_with_events(x, w)
  assert first_events["/jax/compilation_cache/cache_hits"] == 0
  assert second_events["/jax/compilation_cache/cache_hits"] == 1
  assert len(set(Path(directory).iterdir()) - before) >= 1  # what the first one wrote

  expected = np.tanh(np.asarray(x, np.float64) @ np.asarray(w, np.float64)).sum()
  for compiled in (first, second):
    np.testing.assert_allclose(float(compiled(x, w)), expected, rtol=1e-4)
  assert float(first(x, w)) == float(second(x, w))
  # The matmul's multiply-adds are a lower bound XLA's count must meet; the loaded
  # executable reports the compiled one's count, not none.
  flops = [c.cost_analysis()["flops"] for c in (first, second)]
  assert flops[0] == flops[1] >= 2 * M * K * N
  memory = [c.memory_analysis() for c in (first, second)]
  assert memory[0].output_size_in_bytes == memory[1].output_size_in_bytes == 4
  assert memory[0].argument_size_in_bytes == memory[1].argument_size_in_bytes == 4 * (
      M * K + K * N)
