"""A pytest plugin that writes each test's outcome as qualification evidence (JSON).

    LLA_TEST_OUTCOMES=outcomes.json python -m pytest -p lla.study.pytest_outcomes [TEST IDS]

writes, when the session ends, {"schema", "lla_version", "git_commit", "pytest_version",
"exit_status", "tests": {test id: {"outcome", "duration_s", "test_file_sha256",
"report_sha256", "outcome_sha256"}}}. A test's outcome is "passed", "failed" (its call
failed), "error" (its setup or teardown failed), "skipped", "xfailed" or "xpassed";
`outcome_sha256` hashes (test id, outcome, lla version, git commit, the sha256 of the test
file, the sha256 of the failure report) so that a recorded outcome names what ran
(`outcome_sha256`). lla.study.qualification runs the declared checks with it, or carries a
file it wrote into a study.
"""

from __future__ import annotations

import hashlib
import json
import os

ENV = "LLA_TEST_OUTCOMES"
SCHEMA = "lla.test_outcomes.v1"


def outcome_sha256(test_id: str, result: dict, lla_version: str, git_commit: str) -> str:
  """sha256 of the canonical JSON of what a recorded outcome claims."""
  claim = {"test": test_id, "outcome": result["outcome"], "lla_version": lla_version,
           "git_commit": git_commit, "test_file_sha256": result["test_file_sha256"],
           "report_sha256": result["report_sha256"]}
  return hashlib.sha256(json.dumps(claim, sort_keys=True, separators=(",", ":"))
                        .encode()).hexdigest()


def _file_sha256(root: str, test_id: str) -> str | None:
  path = os.path.join(root, test_id.split("::")[0])
  try:
    with open(path, "rb") as f:
      return hashlib.sha256(f.read()).hexdigest()
  except OSError:
    return None


class _Collector:

  def __init__(self, path: str):
    self.path = path
    self.tests: dict[str, dict] = {}
    self.root = os.getcwd()

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
    import lla  # pylint: disable=g-import-not-at-top
    from lla import provenance  # pylint: disable=g-import-not-at-top
    import pytest  # pylint: disable=g-import-not-at-top
    commit = provenance._git_commit() or "unknown"  # pylint: disable=protected-access
    tests = {}
    for test_id, entry in sorted(self.tests.items()):
      result = {"outcome": entry["outcome"], "duration_s": round(entry["duration_s"], 3),
                "test_file_sha256": _file_sha256(self.root, test_id),
                "report_sha256": hashlib.sha256(entry["report"].encode()).hexdigest()}
      result["outcome_sha256"] = outcome_sha256(test_id, result, lla.__version__, commit)
      tests[test_id] = result
    document = {"schema": SCHEMA, "lla_version": lla.__version__, "git_commit": commit,
                "pytest_version": pytest.__version__, "exit_status": int(exitstatus),
                "tests": tests}
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
