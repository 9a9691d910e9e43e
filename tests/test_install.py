"""The install: lock files that PyPI alone can satisfy, import names of lla's own, and a
runtime that never imports torch.

* No pin of a requirements*.txt carries a local version label (`2.13.0+cpu`): PyPI has
  no such release, so `pip install --isolated -r FILE` would fail on a user's machine.
* The runtime lock pins every dependency pyproject.toml declares and no torch; the test
  lock adds every package of the `test` extra.
* No top-level import name of lla's distribution belongs to another installed
  distribution (Hugging Face's `kernels`, which transformers requires, was one), and no
  regular package at the repository root, which is on sys.path whenever a binary or the
  suite runs from there, has another distribution's import name: it would shadow it.
* CI runs the README's test command, on ../shared/data.
* Importing every module of lla and the main job's binaries in a fresh interpreter leaves
  torch out of sys.modules: the runtime lock has no torch.
"""

import importlib.metadata
import importlib.util
import json
import os
import pathlib
import pkgutil
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parents[1]
LOCKS = sorted(ROOT.glob("requirements*.txt"))


def pins(path: pathlib.Path) -> dict[str, Requirement]:
  """The requirements of a pip requirements file, `-r` includes followed, by canonical name."""
  found = {}
  for line in path.read_text().splitlines():
    line = line.split("#", 1)[0].strip()
    if not line:
      continue
    if line.startswith("-r "):
      found.update(pins(path.parent / line[3:].strip()))
      continue
    if line.startswith("-"):
      raise ValueError(f"{path.name}: option {line!r}: a lock file names only pins and -r")
    requirement = Requirement(line)
    found[canonicalize_name(requirement.name)] = requirement
  return found


def pinned_version(requirement: Requirement) -> Version:
  (spec,) = requirement.specifier  # a lock pins each package to one version
  assert spec.operator == "==", f"{requirement} is not an exact pin"
  return Version(spec.version)


def test_the_two_lock_files_exist():
  assert [p.name for p in LOCKS] == ["requirements-cpu.txt", "requirements-test.txt"]


@pytest.mark.parametrize("path", LOCKS, ids=lambda p: p.name)
def test_no_pin_carries_a_local_version_label(path):
  labelled = [str(r) for r in pins(path).values() if pinned_version(r).local is not None]
  assert not labelled, f"{path.name}: local version labels are not on PyPI: {labelled}"


def test_the_runtime_lock_pins_the_dependencies_and_no_torch():
  pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  runtime = pins(ROOT / "requirements-cpu.txt")
  test = pins(ROOT / "requirements-test.txt")
  for extra, locked in (("dependencies", runtime), ("test", test)):
    declared = (pyproject["dependencies"] if extra == "dependencies"
                else pyproject["optional-dependencies"]["test"])
    for line in declared:
      requirement = Requirement(line)
      name = canonicalize_name(requirement.name)
      assert name in locked, f"{extra}: {requirement} is not in the lock"
      assert requirement.specifier.contains(pinned_version(locked[name])), (
          f"{extra}: the lock's {locked[name]} is outside {requirement}")
  assert not {"torch", "pytest", "ray", "submitit", "gguf"} & set(runtime)
  assert set(runtime) < set(test)


def test_ci_runs_the_readmes_test_command_on_the_shared_data():
  readme = [l.strip() for l in (ROOT / "README.md").read_text().splitlines()
            if l.startswith("    ") and "pip install -r requirements-" in l]
  assert len(readme) == 2, readme  # the two commands for a fresh machine
  job, tests = readme
  assert "requirements-cpu.txt" in job and "experiments.main_table" in job
  assert "requirements-test.txt" in tests and "pytest" in tests
  ci = (ROOT / ".ci" / "run").read_text().splitlines()
  assert tests in ci, "CI does not run the README's test command"
  assert ci[ci.index(tests) - 1] == "export LLA_DATA_DIR=../shared/data"


def lla_top_level_names() -> set[str]:
  return set(importlib.metadata.distribution("lla").read_text("top_level.txt").split())


def test_lla_provides_the_kernels_under_its_own_name():
  import lla_kernels.vocab_topk  # pylint: disable=import-outside-toplevel
  assert lla_top_level_names() == {"lla", "lla_kernels"}
  assert pathlib.Path(lla_kernels.vocab_topk.__file__).parent == ROOT / "kernels"


def other_owners() -> dict[str, list[str]]:
  """Top-level import name -> the installed distributions other than lla that provide it."""
  owners = {name: sorted({d for d in dists if canonicalize_name(d) != "lla"})
            for name, dists in importlib.metadata.packages_distributions().items()}
  return {name: dists for name, dists in owners.items() if dists}


def test_no_top_level_name_of_lla_belongs_to_another_distribution():
  names = lla_top_level_names()
  assert names  # (an empty set would pass whatever lla installs)
  shared = {name: other_owners()[name] for name in names if name in other_owners()}
  assert not shared, f"import names shared with other distributions: {shared}"


def test_no_root_folder_shadows_another_distribution():
  owners = other_owners()
  regular = [p.parent.name for p in ROOT.glob("*/__init__.py")]
  assert "experiments" in regular  # (the binaries run as `python -m experiments.X`)
  shadowing = {name: owners[name] for name in regular if name in owners}
  assert not shadowing, f"root folders shadow these distributions' packages: {shadowing}"
  # What an import of `kernels` finds from the root, as every binary runs: another
  # distribution's package, or the bare folder as a namespace, never lla's as a package.
  found = subprocess.run(
      [sys.executable, "-c", "import importlib.util as u; s = u.find_spec('kernels'); "
       "print(s.origin if s else None)"],
      cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
  assert found in ("None", "") or not found.startswith(str(ROOT)), found


# The main job's binary and the data fetch it runs first, as the README's first command does.
BINARIES = ["experiments.main_table", "experiments.fetch_data"]

_IMPORT = """
import importlib, json, sys
for name in sys.argv[1:]:
  importlib.import_module(name)
print(json.dumps(sorted(sys.modules)))
"""


def modules_after_importing(names: list[str]) -> set[str]:
  """sys.modules of a fresh interpreter, run from the root, once it has imported `names`."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", _IMPORT, *names], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return set(json.loads(proc.stdout.splitlines()[-1]))


def test_the_runtime_never_imports_torch():
  # torch is installed here (the test lock), so an import anywhere would put it in sys.modules.
  assert importlib.util.find_spec("torch") is not None, "the test install has torch"
  import lla, lla_kernels  # pylint: disable=import-outside-toplevel,multiple-imports
  names = [m.name for p in (lla, lla_kernels)
           for m in pkgutil.walk_packages(p.__path__, p.__name__ + ".")] + BINARIES
  assert {"lla.attacks.candidates", "lla.study.main_table", "lla_kernels.vocab_topk"} < set(names)
  loaded = modules_after_importing(names)
  assert set(names) <= loaded
  importers = sorted(m for m in loaded if m == "torch" or m.startswith("torch."))
  assert not importers, f"importing lla loaded {importers[:5]}"
  # The same harness sees torch once a module imports it (the benchmark binaries do).
  assert "torch" in modules_after_importing(["torch"])
