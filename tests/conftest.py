"""Shared pytest fixtures."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

import lla  # noqa: F401  malloc tuned before the tests allocate (lla/allocator.py)

_REPO_ROOT = Path(__file__).resolve().parent.parent


def pytest_configure(config):
  """A worker is pinned to its share of the CPUs (`_pin_xdist_worker`), and every XLA
  executable this process compiles is cached on disk for the rest of the run, both set
  before any test module is imported (JAX decides at its first compilation whether a cache
  is used). Tests build the same computations under new closures (each main-job fixture's
  models, a regeneration after its job, a module recompiling what the mapping limit
  dropped), which JAX's in-memory caches miss and this one, keyed by the computation, loads
  instead: 128 s of XLA's compiling saved in a run of the whole suite, of 1,959 s
  (docs/benchmarks.md section 13). One directory per process: JAX writes an entry in
  place, unsafe for two writers (pytest-xdist's workers). A loaded executable is the
  compiled one, its FLOP and memory analyses included
  (tests/test_runtime_compilation_cache.py)."""
  from lla import runtime

  _tune_xdist_workers_malloc(config)
  _pin_xdist_worker()
  directory = tempfile.mkdtemp(prefix="lla-test-xla-")
  config.add_cleanup(lambda: shutil.rmtree(directory, ignore_errors=True))
  runtime.configure(directory)


def _tune_xdist_workers_malloc(config) -> None:
  """pytest-xdist's workers run execnet's threads before they import lla, so glibc gives
  those threads arenas of their own, which XLA:CPU's threads then share and where every
  block over 64 MiB is mapped afresh (lla/allocator.py): the e2e main job faulted 68 M
  pages in a worker against 5.3 M alone. The controller, which starts the workers after
  this hook, hands them glibc's arena limit in their environment. Without workers (no
  `-n`, or `-n 0`) the environment is left alone: the tests' own process started without
  the limit, and the binaries it starts must run as it does (a regenerated record would
  otherwise name the difference, tests/test_attacks_replay.py)."""
  from lla import allocator

  if "PYTEST_XDIST_WORKER" not in os.environ and getattr(config.option, "numprocesses", None):
    os.environ.update(allocator.environment_for_workers())


def _pin_xdist_worker() -> None:
  """A pytest-xdist worker runs on its own share of the CPUs (`-n 2` on two cores: one core
  each), set before its first computation; why, in lla.runtime. What a test starts
  (binaries, Ray nodes, jax.distributed processes) inherits the share."""
  from lla import runtime

  worker = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ...
  if worker:
    runtime.pin_to_cpu_share(int(worker.removeprefix("gw")),
                             int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))


@pytest.fixture(autouse=True, scope="module")
def _executables_within_the_mapping_limit():
  """Each module starts with room for its executables: JAX keeps every compiled executable
  for the life of the process, and the whole suite in one process would otherwise cross
  the kernel's limit on memory mappings, where XLA:CPU dies compiling (lla.runtime)."""
  from lla import runtime

  runtime.release_compiled_when_crowded()


@pytest.fixture(scope="session")
def data_dir() -> Path:
  """The data directory: $LLA_DATA_DIR, else the repository's sibling `../shared/data`.

  Missing data is an error, not a skip: a green run must have seen the data.
  """
  from_env = os.environ.get("LLA_DATA_DIR")
  path = Path(from_env) if from_env else _REPO_ROOT.parent / "shared" / "data"
  if not path.is_dir():
    pytest.fail(
        f"Test data not found at {path} (from "
        f"{'$LLA_DATA_DIR' if from_env else 'the default <repo>/../shared/data'}). "
        "Set LLA_DATA_DIR to a directory holding wikitext-2/ and gpt2-tokenizer/.",
        pytrace=False,
    )
  return path
