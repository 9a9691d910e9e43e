"""Shared pytest fixtures."""

import os
from pathlib import Path

import pytest

import lla  # noqa: F401  malloc tuned before the tests allocate (lla/allocator.py)

_REPO_ROOT = Path(__file__).resolve().parent.parent


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
        f"Test data not found at {path} (from {'$LLA_DATA_DIR' if from_env else 'the default <repo>/../shared/data'}). "
        "Set LLA_DATA_DIR to a directory holding wikitext-2/ and gpt2-tokenizer/.",
        pytrace=False,
    )
  return path
