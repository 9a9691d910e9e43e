"""Qualification evidence of the main job (PROTOCOL section 5: the qualification matrix).

How far each attack module itself is trusted, kept apart from its attack results. Each
item names its status, the test or runs it rests on and where its evidence comes from
(`source`); nothing is `pass` without a run:

  tests       each module's `AttackSpec.checks` (kind, test id, what it checks): tests of
              this repository that compare it with a reference implementation, brute
              force or known answers. A check's status is its test's recorded outcome
              (passed -> `pass`, failed or errored -> `fail`), read from the outcomes file
              the study logs (OUTCOMES_FILE, written by the pytest plugin
              lla.study.pytest_outcomes): either the study ran the tests of the attacks it
              measured itself (`run_and_record`, `python -m pytest TEST_IDS` in a
              subprocess; the main job does by default), or a file such a run wrote
              elsewhere, on the same lla source and commit, was carried into it
              (`carry_outcomes`). The file keeps each test's source, and its hashes are
              recomputed from it whenever it is read (lla.study.pytest_outcomes says what
              they prove). A passed test on a checkout with uncommitted changes is
              `partial` (the commit does not name the code that passed). A check with no
              recorded outcome (not run, skipped, its test file changed since it ran, its
              attack not measured in the study) is `unmeasured`, never `pass`.
  real model  the study's undefended runs on the real (fine-tuned) target: the setting
              where the module's pooled excess over the frequency baseline is largest;
              `pass` if that excess clears the policy's positive-control bar (the module
              finds a leak where one exists), `partial` if it ran but never did.
  adaptation  a defense-aware or adaptive module on each defended configuration it ran
              on: `pass` where its pooled excess is strictly above that of the
              defense-unaware attack it refines (`reference_attack`) on the same
              configuration, `partial` where it is not (a tie included: the adaptation
              is not shown to help there).
"""

from __future__ import annotations

import ast
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import lla
from lla.evidence import files, rundir
from lla.scoring import gates
from lla.scoring import policy as policy_lib
from lla.scoring import scorecard
from lla.study import pytest_outcomes

OUTCOMES_FILE = f"{rundir.INPUTS}/qualification_outcomes.json"
# A test's outcome -> the status of the checks that name it (any other: unmeasured).
STATUS_OF_OUTCOME = {"passed": "pass", "failed": "fail", "error": "fail"}
SOURCE_RUNS = "study runs"
NOT_RUN = "not run"
DIRTY = "uncommitted changes"


def repository_root() -> pathlib.Path:
  """The checkout lla runs from (the directory holding tests/)."""
  return pathlib.Path(lla.__file__).resolve().parent.parent


def check_ids(modules: list[dict]) -> list[str]:
  """Every test id the modules' declared checks name, sorted."""
  return sorted({test for m in modules for _, test, _ in m.get("checks", ())})


def measured_modules(study: str, modules: list[dict]) -> list[dict]:
  """The modules with a measured record in the study: the attacks it ran."""
  ran = {r.attack for r in rundir.load_records(study) if r.status == "ok"}
  return [m for m in modules if m["name"] in ran]


def _defined(root: pathlib.Path, test_id: str) -> bool:
  path, _, function = test_id.partition("::")
  source = root / path
  if not function or not source.is_file():
    return False
  try:
    tree = ast.parse(source.read_text(), str(source))
  except SyntaxError:
    return False
  return function.partition("[")[0] in {n.name for n in ast.walk(tree)
                                        if isinstance(n, ast.FunctionDef)}


def _not_run(who: dict, why: str) -> dict:
  return {"schema": pytest_outcomes.SCHEMA, **who, "pytest_version": None,
          "exit_status": None, "wall_s": 0.0, "tests": {}, "test_files": {},
          "not_run": why}


def runnable_ids(root: pathlib.Path, test_ids: list[str]) -> list[str]:
  """The ids that name a test function of a file that exists under `root`: an id pytest
  cannot find stops its whole session, so only these are passed (the others have no
  outcome)."""
  return [t for t in test_ids if _defined(root, t)]


# `python -c` of a background run: the lowest CPU priority, and SIGTERM when the thread that
# started it ends (Linux's PR_SET_PDEATHSIG; its first argument is that process's pid, to
# catch a parent that died before the signal was set), then pytest on the other arguments.
# (Popen's preexec_fn would do it before exec, but forks a multithreaded JAX process.)
_BACKGROUND = """\
import ctypes, os, signal, sys
os.nice(19)
parent = int(sys.argv.pop(1))
if sys.platform.startswith("linux"):
  ctypes.CDLL(None).prctl(1, signal.SIGTERM)
  if os.getppid() != parent:
    sys.exit("the process that started these tests has ended")
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""


class ChecksRun:
  """`python -m pytest TEST_IDS` in a subprocess, in `root` (default this checkout), with
  the outcomes plugin: started when made, its outcomes document read by `outcomes`.

  background=True runs it at the lowest CPU priority (nice 19), stopped when the thread
  that started it ends: the main job starts it before its phases, so that the tests take the
  cycles the phases leave idle (a compile runs on one core) instead of 3-4 minutes at its
  end, and collects it when it scores.
  """

  def __init__(self, test_ids: list[str], root: str | os.PathLike | None = None,
               background: bool = False):
    self.root = pathlib.Path(root or repository_root())
    self.started = time.time()
    self._who = pytest_outcomes.identity(self.root)
    self.test_ids = tuple(runnable_ids(self.root, test_ids))
    self.not_run = None
    if self._who["git_commit"] == pytest_outcomes.UNKNOWN:
      self.not_run = f"{self.root} is not a git checkout: no commit names the tests' code"
    elif not self.test_ids:  # (pytest without ids would run every test under root)
      self.not_run = "no declared check names a test of this checkout"
    self._process = self.finished = None
    if self.not_run is None:
      self._directory = tempfile.mkdtemp(prefix="lla-checks-")
      self._path = os.path.join(self._directory, "outcomes.json")
      env = dict(os.environ, **{pytest_outcomes.ENV: self._path})
      pytest = ["-q", "-p", "lla.study.pytest_outcomes", "-p", "no:cacheprovider",
                f"--rootdir={self.root}", *self.test_ids]
      start = (["-c", _BACKGROUND, str(os.getpid())] if background else ["-m", "pytest"])
      self._process = subprocess.Popen(
          [sys.executable, *start, *pytest], cwd=self.root, env=env,
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      # Drains the pipe (a full one would stall pytest) and notes when the run ended.
      self._output = ""
      self._watcher = threading.Thread(target=self._watch, daemon=True)
      self._watcher.start()

  def _watch(self) -> None:
    self._output = self._process.communicate()[0]
    self.finished = time.time()

  def covers(self, test_ids: list[str], root: str | os.PathLike | None = None) -> bool:
    """Whether this run, in `root` (default this checkout), holds every runnable one of
    `test_ids`."""
    return (self.not_run is None and pathlib.Path(root or repository_root()) == self.root
            and set(runnable_ids(self.root, test_ids)) <= set(self.test_ids))

  def outcomes(self, timeout_s: float | None = None) -> dict:
    """Waits for the run (at most `timeout_s` from its start) and returns the document it
    wrote; past the limit it is killed and the document says so."""
    if self._process is None:
      return _not_run(self._who, self.not_run)
    left = None if timeout_s is None else max(0.0, timeout_s - (time.time() - self.started))
    self._watcher.join(left)
    if self._watcher.is_alive():
      self.cancel()
      return _not_run(self._who, f"the tests ran past the limit of {timeout_s:.0f} s")
    try:
      if not os.path.exists(self._path):
        raise RuntimeError(f"pytest wrote no outcomes (exit {self._process.returncode}): "
                           f"{self._output[-2000:]}")
      return files.read_json(self._path)
    finally:
      shutil.rmtree(self._directory, ignore_errors=True)

  def cancel(self) -> None:
    """Stops the run (if it is still running) and removes its files."""
    if self._process is not None:
      self._process.kill()
      self._watcher.join()
      shutil.rmtree(self._directory, ignore_errors=True)


def run_checks(test_ids: list[str], root: str | os.PathLike | None = None,
               timeout_s: float | None = None) -> dict:
  """Runs the named tests (`ChecksRun`) and returns the outcomes document they wrote. A
  test that could not be collected has no outcome (its checks stay unmeasured); a checkout
  that no commit names runs nothing (the document says why)."""
  return ChecksRun(test_ids, root).outcomes(timeout_s)


def restricted(document: dict, test_ids: list[str]) -> dict:
  """`document` with only the outcomes of `test_ids` (a parametrised test's id stands for
  its cases) and their test files; every kept outcome's hash still recomputes, since a
  claim names its own test alone."""
  wanted = set(test_ids)
  kept = {t: r for t, r in document.get("tests", {}).items()
          if t in wanted or t.partition("[")[0] in wanted}
  sources = {pytest_outcomes.file_of(t) for t in kept}
  return {**document, "tests": kept,
          "test_files": {p: s for p, s in document.get("test_files", {}).items()
                         if p in sources}}


def verify_document(document: dict, where: str = "outcomes") -> None:
  """Recomputes every hash of an outcomes document from the document alone: each test
  file's sha256 from the text it keeps, each outcome's claim.

  Raises:
    ValueError (one line): another schema, or a hash that does not match what it claims.
  """
  if document.get("schema") != pytest_outcomes.SCHEMA:
    raise ValueError(f"{where}: schema {document.get('schema')!r}, expected "
                     f"{pytest_outcomes.SCHEMA!r}")
  sources = document.get("test_files", {})
  for test_id, result in sorted(document.get("tests", {}).items()):
    text = sources.get(pytest_outcomes.file_of(test_id))
    if text is None or pytest_outcomes.sha256_text(text) != result["test_file_sha256"]:
      raise ValueError(f"{where}: {test_id}: its test file's text is missing or does not "
                       "hash to test_file_sha256")
    if result.get("outcome_sha256") != pytest_outcomes.outcome_sha256(test_id, result,
                                                                      document):
      raise ValueError(f"{where}: {test_id}: outcome_sha256 does not hash what it claims")


def check_outcomes(document: dict, root: str | os.PathLike | None = None,
                   where: str = "outcomes") -> dict:
  """`document` (lla.study.pytest_outcomes) with its claims checked against this process
  and the checkout at `root`: `verify_document`, then the same lla version and source and
  a known, equal commit ("unknown" matches nothing); a test whose file has changed since
  it ran (its text differs from the file in `root` now) is dropped.

  Raises:
    ValueError (one line): any of the above differs.
  """
  verify_document(document, where)
  root = pathlib.Path(root or repository_root())
  here = pytest_outcomes.identity(root)
  for field in ("lla_version", "lla_source_sha256"):
    if document.get(field) != here[field]:
      raise ValueError(f"{where}: made under {field} {document.get(field)!r}, this is "
                       f"{here[field]!r}: outcomes of other code qualify nothing here")
  made, now = document.get("git_commit"), here["git_commit"]
  if pytest_outcomes.UNKNOWN in (made, now) or made != now:
    raise ValueError(f"{where}: made at commit {made!r}, this checkout is at {now!r}: "
                     "outcomes qualify only the commit that names them")
  kept = {t: r for t, r in sorted(document.get("tests", {}).items())
          if document["test_files"].get(pytest_outcomes.file_of(t)) ==
          pytest_outcomes.read_test_file(root, t)}  # else changed since: not evidence here
  return {**document, "tests": kept,
          "test_files": {p: s for p, s in document.get("test_files", {}).items()
                         if any(pytest_outcomes.file_of(t) == p for t in kept)}}


def record_outcomes(study: str, document: dict, how: str) -> str:
  """Logs the outcomes document as the study's OUTCOMES_FILE (replacing an earlier one);
  `how` says where it came from ("run by the study" or the carried file). Returns its
  sha256."""
  data = files.canonical_json({**document, "recorded": how})
  logged = rundir.logged_files(study).get(OUTCOMES_FILE)
  if logged is not None and logged[0] == files.sha256_bytes(data):
    return logged[0]
  with rundir.extending(study):
    return rundir.save_file(study, OUTCOMES_FILE, data, "qualification_outcomes",
                            overwrite=True)


def start_checks(modules: list[dict], root=None) -> ChecksRun:
  """Starts the declared checks of every module in `modules` in the background
  (`ChecksRun`), before it is known which the study will measure; `run_and_record` keeps
  the outcomes of the measured ones. The caller chooses the modules (the main job: those it
  plans to measure, `lla.study.main_table.start_checks`)."""
  return ChecksRun(check_ids(modules), root, background=True)


def run_and_record(study: str, modules: list[dict], root=None,
                   timeout_s: float | None = None, only=(),
                   started: ChecksRun | None = None) -> dict:
  """Runs the declared checks of the modules the study measured (`measured_modules`; of
  those named in `only`, when given) and logs the outcomes in the study, with the modules
  whose checks ran and the seconds the run took (`wall_s`).

  started: a run of `start_checks` in the same checkout; its outcomes of those checks are
  kept (the rest dropped) when it holds all of them, else it is stopped and they run now.
  `timeout_s` counts from the run's start either way.
  """
  chosen = [m for m in measured_modules(study, modules) if not only or m["name"] in only]
  wanted = check_ids(chosen)
  how = "run by the study (python -m pytest TEST_IDS)"
  if started is not None and started.covers(wanted, root):
    run, how = started, how + ", started before its phases"
  else:
    if started is not None:
      started.cancel()
    run = ChecksRun(wanted, root)
  document = restricted(run.outcomes(timeout_s), wanted)
  # The study's own run: its hashes are checked, not its identity against this process's
  # (which a checkout edited while the tests ran would fail; `git_dirty` records that).
  verify_document(document, "the study's pytest run")
  document = {**document, "modules": sorted(m["name"] for m in chosen),
              "wall_s": round((run.finished or time.time()) - run.started, 1)}
  record_outcomes(study, document, how)
  return document


def carry_outcomes(study: str, path: str, root=None) -> dict:
  """Carries an outcomes file written elsewhere (LLA_TEST_OUTCOMES=path python -m pytest
  -p lla.study.pytest_outcomes ...) into the study, after `check_outcomes`."""
  document = check_outcomes(files.read_json(path), root, path)
  record_outcomes(study, document, f"carried from a pytest run ({os.path.basename(path)})")
  return document


def recorded_outcomes(study: str) -> dict | None:
  """The outcomes document the study logs, or None; refused if it differs from its log
  entry or its hashes do not recompute from its own text (`verify_document`)."""
  path = os.path.join(study, OUTCOMES_FILE)
  if not os.path.exists(path):
    return None
  logged = rundir.logged_files(study).get(OUTCOMES_FILE)
  if logged is None or logged[0] != files.sha256_file(path):
    raise ValueError(f"{path}: not the file the study's log recorded; run verify")
  document = files.read_json(path)
  verify_document(document, path)
  return document


def _outcome(outcomes: dict, test_id: str) -> tuple[str | None, list[dict]]:
  """(the test's outcome or None, its results): a test id that names a parametrised test
  without its case stands for every case (failed if any failed, passed if all passed)."""
  tests = outcomes.get("tests", {})
  if test_id in tests:
    return tests[test_id]["outcome"], [dict(tests[test_id], test=test_id)]
  cases = [dict(r, test=t) for t, r in sorted(tests.items()) if t.startswith(test_id + "[")]
  if not cases:
    return None, []
  got = {c["outcome"] for c in cases}
  for outcome in ("error", "failed"):
    if outcome in got:
      return outcome, cases
  return ("passed" if got == {"passed"} else sorted(got - {"passed"})[0]), cases


def _why_unmeasured(outcomes: dict | None, outcome: str | None) -> str:
  if outcomes is None:
    return "the study records no test outcomes"
  if outcomes.get("not_run"):
    return f"not run: {outcomes['not_run']}"
  if outcome is None:
    return ("no outcome of this test in the study's record (its attack not measured in "
            "the study, or not among the modules whose checks ran)")
  return f"the test was {outcome}"


def from_checks(modules: list[dict], outcomes: dict | None = None) -> list[dict]:
  """An item for every (kind, test id, what it checks) of each module's checks, its status
  from the test's recorded outcome in `outcomes` (the study's OUTCOMES_FILE); without a
  recorded outcome, `unmeasured`; a pass on a checkout with uncommitted changes (or where
  git could not say), `partial`."""
  out = []
  for m in modules:
    for kind, test, detail in m.get("checks", ()):
      outcome, results = (None, []) if outcomes is None else _outcome(outcomes, test)
      item = {"module": m["name"], "kind": kind, "evidence": test, "detail": detail}
      if outcome is None or outcome not in STATUS_OF_OUTCOME:
        out.append({**item, "status": "unmeasured", "source": NOT_RUN,
                    "detail": f"{detail} ({_why_unmeasured(outcomes, outcome)})"})
        continue
      status, source = STATUS_OF_OUTCOME[outcome], f"pytest outcome in {OUTCOMES_FILE}"
      tree = f"commit {outcomes['git_commit'][:12]}"
      if outcomes.get("git_dirty") is not False:
        source += f" ({DIRTY})"
        tree += (" with uncommitted changes" if outcomes.get("git_dirty") else
                 ", git could not say whether the checkout was clean")
        status = "partial" if status == "pass" else status
      out.append({**item, "status": status, "source": source,
                  "detail": f"{detail} (pytest: {outcome}, lla {outcomes['lla_version']}, "
                            f"{tree}, lla source "
                            f"{outcomes['lla_source_sha256'][:12]})",
                  "outcome": outcome,
                  "outcome_sha256": hashlib.sha256("".join(
                      r["outcome_sha256"] for r in results).encode()).hexdigest()
                  if len(results) > 1 else results[0]["outcome_sha256"]})
  return out


_SETTING = ("cut", "knowledge", "corpus")


def _runs(card: dict, config: dict, attack_key: str) -> list[str]:
  return sorted(r["run_id"] for r in card["rows"] if r["status"] == "ok" and
                all(r[f] == config[f] for f in ("defense", *_SETTING)) and
                gates.key_of(r["attack"], r["scored_positions"]) == attack_key)


def _where(config: dict) -> str:
  return f"k = {config['cut']}, {config['knowledge']}, {config['corpus']}"


def from_card(card: dict, modules: list[dict], pol: policy_lib.Policy) -> list[dict]:
  """Real-model and adaptation items from a scorecard of the study (see module doc)."""
  names = {m["name"]: m for m in modules}
  out, best = [], {}
  for group in card["undefended"]:
    for key, metrics in group["pooled"].items():
      module = key.split("[")[0]
      if module in names and (module not in best or
                              metrics["excess_pp"] > best[module][1]["excess_pp"]):
        best[module] = (group["config"], metrics, key)
  for module, (config, metrics, key) in sorted(best.items()):
    runs = _runs(card, config, key)
    cleared = metrics["excess_pp"] > pol.positive_control_pp
    out.append({"module": module, "kind": "real_model", "source": SOURCE_RUNS,
                "status": "pass" if cleared else "partial",
                "evidence": "runs " + ", ".join(runs),
                "detail": f"largest undefended excess {metrics['excess_pp']:+.2f} pp over the "
                          f"frequency baseline ({_where(config)}, {metrics['n']} tokens, "
                          f"{len(runs)} runs); positive-control bar "
                          f"{pol.positive_control_pp:g} pp"})
  for gate in card["gates"]:
    for key, metrics in sorted(gate["pooled"].items()):
      spec = names.get(key.split("[")[0])
      if spec is None or not (spec.get("defense_aware") or spec.get("adapts_to")):
        continue
      reference = gate["pooled"].get(spec.get("reference_attack") or "")
      config = gate["config"]
      if reference is None:
        status, versus = "partial", "its defense-unaware reference attack was not run here"
      else:
        # Strictly above: a tie (both at the same bound, e.g. both recovering everything or
        # nothing) does not show that the adaptation helps.
        status = "pass" if metrics["excess_pp"] > reference["excess_pp"] else "partial"
        versus = (f"defense-unaware {spec['reference_attack']} "
                  f"{reference['excess_pp']:+.2f} pp"
                  + (" (a tie: not shown to help)"
                     if metrics["excess_pp"] == reference["excess_pp"] else ""))
      out.append({"module": spec["name"], "kind": "adaptation", "status": status,
                  "source": SOURCE_RUNS,
                  "evidence": "runs " + ", ".join(_runs(card, config, key)),
                  "detail": f"{config['defense_params'].get('label', config['defense'])} "
                            f"({_where(config)}): excess {metrics['excess_pp']:+.2f} pp, "
                            f"{versus}"})
  return out


def evidence(run_dir: str, policy_name: str, modules: list[dict]) -> list[dict]:
  """Every qualification item for the modules of a study directory: the checks' recorded
  outcomes (OUTCOMES_FILE; none recorded: every check unmeasured) and the run-derived
  items."""
  pol = policy_lib.load_policy(policy_name)
  card = scorecard.build(run_dir, pol, modules=modules, contrasts=False)
  return from_checks(modules, recorded_outcomes(run_dir)) + from_card(card, modules, pol)
