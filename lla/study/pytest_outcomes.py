"""A pytest plugin that writes each test's outcome as qualification evidence (JSON).

    LLA_TEST_OUTCOMES=outcomes.json python -m pytest -p lla.study.pytest_outcomes [TEST IDS]

writes, when the session ends, {"schema", "lla_version", "git_commit", "git_dirty",
"lla_source_sha256", "pytest_version", "exit_status", "wall_s", "tests": {test id:
{"outcome", "duration_s", "test_file_sha256", "report_sha256", "outcome_sha256"}},
"test_files": {path: its text}}. A test's outcome is "passed", "failed" (its call failed),
"error" (its setup or teardown failed), "skipped", "xfailed" or "xpassed".

What `outcome_sha256` proves, exactly: it is the sha256 of the claim (test id, outcome,
the sha256 of the failure report, the sha256 of the test file's text, lla version, git
commit, whether the checkout had uncommitted changes, and `lla_source_sha256`, the hash of
every source file of the lla package that ran). Anyone holding these can recompute it, so
it is no signature: it ties a recorded outcome to the exact test source (kept in the
document, `test_files`, so that it is recomputed from the study's own file) and to the
exact lla source it ran against, and once the document is logged in a study the log's hash
chain shows any later edit. That the test ran at all rests on who wrote the document (the
study records how: its own pytest run, or a carried file).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess
import time

ENV = "LLA_TEST_OUTCOMES"
SCHEMA = "lla.test_outcomes.v2"
# The fields of a document that say what ran the tests; each outcome's claim holds them.
IDENTITY = ("lla_version", "git_commit", "git_dirty", "lla_source_sha256")
UNKNOWN = "unknown"


def sha256_text(text: str) -> str:
  return hashlib.sha256(text.encode()).hexdigest()


def outcome_sha256(test_id: str, result: dict, identity: dict) -> str:
  """sha256 of the canonical JSON of what a recorded outcome claims (module doc)."""
  claim = {"test": test_id, "outcome": result["outcome"],
           "test_file_sha256": result["test_file_sha256"],
           "report_sha256": result["report_sha256"], **{f: identity[f] for f in IDENTITY}}
  return hashlib.sha256(json.dumps(claim, sort_keys=True, separators=(",", ":"))
                        .encode()).hexdigest()


def lla_source_sha256(package: str | os.PathLike | None = None) -> str:
  """sha256 of the lines "<path under the package> <sha256 of the file>" of every .py file
  of `package` (default: the imported lla package), sorted: the code the tests ran
  against, with or without git."""
  if package is None:
    import lla  # pylint: disable=g-import-not-at-top
    package = pathlib.Path(lla.__file__).resolve().parent
  package = pathlib.Path(package)
  lines = sorted(f"{p.relative_to(package).as_posix()} "
                 f"{hashlib.sha256(p.read_bytes()).hexdigest()}"
                 for p in package.rglob("*.py"))
  return sha256_text("\n".join(lines))


def git_state(root: str | os.PathLike) -> tuple[str, bool | None]:
  """(HEAD's commit or UNKNOWN, whether the checkout at `root` has uncommitted changes or
  untracked files, None when git cannot say)."""
  def git(*args):
    try:
      proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                            timeout=30)
    except (OSError, subprocess.SubprocessError):
      return None
    return proc.stdout if proc.returncode == 0 else None
  commit = (git("rev-parse", "HEAD") or "").strip() or UNKNOWN
  status = git("status", "--porcelain", "--untracked-files=normal")
  return commit, (None if status is None or commit == UNKNOWN else bool(status.strip()))


def identity(root: str | os.PathLike) -> dict:
  """The IDENTITY fields of this process and the checkout at `root`."""
  import lla  # pylint: disable=g-import-not-at-top
  commit, dirty = git_state(root)
  return {"lla_version": lla.__version__, "git_commit": commit, "git_dirty": dirty,
          "lla_source_sha256": lla_source_sha256()}


def file_of(test_id: str) -> str:
  return test_id.split("::")[0]


def read_test_file(root: str | os.PathLike, test_id: str) -> str | None:
  try:
    return (pathlib.Path(root) / file_of(test_id)).read_text()
  except (OSError, UnicodeDecodeError):
    return None


class _Collector:

  def __init__(self, path: str):
    self.path = path
    self.tests: dict[str, dict] = {}
    self.root = os.getcwd()
    self.started = time.time()

  def pytest_configure(self, config):
    self.root = str(config.rootpath)

  def pytest_runtest_logreport(self, report):
    entry = self.tests.setdefault(report.nodeid, {"outcome": "passed", "duration_s": 0.0,
                                                  "report": ""})
    entry["duration_s"] += float(report.duration)
    if report.failed:
      entry["outcome"] = "failed" if report.when == "call" else "error"
      entry["report"] += str(report.longrepr)
    elif report.skipped and entry["outcome"] == "passed":
      entry["outcome"] = "xfailed" if hasattr(report, "wasxfail") else "skipped"
    elif report.when == "call" and hasattr(report, "wasxfail"):
      entry["outcome"] = "xpassed"

  def pytest_sessionfinish(self, session, exitstatus):
    import pytest  # pylint: disable=g-import-not-at-top
    who = identity(self.root)
    tests, sources = {}, {}
    for test_id, entry in sorted(self.tests.items()):
      text = read_test_file(self.root, test_id)
      if text is not None:
        sources[file_of(test_id)] = text
      result = {"outcome": entry["outcome"], "duration_s": round(entry["duration_s"], 3),
                "test_file_sha256": None if text is None else sha256_text(text),
                "report_sha256": sha256_text(entry["report"])}
      result["outcome_sha256"] = outcome_sha256(test_id, result, who)
      tests[test_id] = result
    document = {"schema": SCHEMA, **who, "pytest_version": pytest.__version__,
                "exit_status": int(exitstatus),
                "wall_s": round(time.time() - self.started, 1), "tests": tests,
                "test_files": dict(sorted(sources.items()))}
    tmp = f"{self.path}.tmp"
    with open(tmp, "w") as f:
      json.dump(document, f, sort_keys=True, indent=1)
    os.replace(tmp, self.path)


def pytest_configure(config):
  path = os.environ.get(ENV)
  if path and not config.pluginmanager.has_plugin("lla_test_outcomes"):
    collector = _Collector(os.path.abspath(path))
    collector.pytest_configure(config)
    config.pluginmanager.register(collector, "lla_test_outcomes")
