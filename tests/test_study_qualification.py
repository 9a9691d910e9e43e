"""The qualification matrix is measured: a declared check's status is its test's recorded
outcome, logged in the study, and a check that did not run is `unmeasured`, never `pass`.

A throw-away git repository holds a passing, a failing and a parametrised test; modules
declare checks naming them and a test that does not exist. The study runs them (pytest in a
subprocess with lla's outcomes plugin) or carries a file such a run wrote, and each cell
is compared with what the test knows by construction: which test passes, which fails, the
sha256 of each test file and of its recorded claim, computed here by hand. A checkout with
uncommitted changes, one that no commit names and a forged claim are each caught. The
run-derived items carry the numbers of a synthetic study with known answers.
"""

import hashlib
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

import lla
from lla.attacks import registry
from lla.evidence import rundir
from lla.scoring import policy as policy_lib
from lla.scoring import qualification as matrix_lib
from lla.scoring import scorecard
from lla.scoring import synthetic as syn
from lla.study import pytest_outcomes
from lla.study import qualification

REPO = pathlib.Path(__file__).resolve().parent.parent
POL = policy_lib.load_policy()

FAKE = '''\
import pytest


def test_passes():
  assert 1 + 1 == 2


def test_fails():
  assert 1 + 1 == 3, "wrong on purpose"


@pytest.mark.parametrize("x", [1, 2])
def test_cases(x):
  assert x > 0
'''
FILE = "tests/test_fake_checks.py"
PASSES, FAILS, CASES = f"{FILE}::test_passes", f"{FILE}::test_fails", f"{FILE}::test_cases"
MISSING = f"{FILE}::test_never_written"
MODULES = [
    {"name": "good", "checks": [("synthetic", PASSES, "adds"),
                                ("reference_consistency", CASES, "both cases")]},
    {"name": "bad", "checks": [("synthetic", FAILS, "adds wrongly"),
                               ("reference_consistency", MISSING, "never written")]},
]


def test_every_declared_check_is_a_test_pytest_collects():
  """Each registered attack's check id is a node id `pytest --collect-only` lists (a
  parametrised test named without its case stands for its cases)."""
  checks = [(m["name"], kind, test) for m in registry.module_entries()
            for kind, test, _ in m["checks"]]
  assert checks, "no module declares a qualifying test"
  assert {kind for _, kind, _ in checks} <= set(matrix_lib.KINDS)
  paths = sorted({test.split("::")[0] for _, _, test in checks})
  proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                         "-p", "no:cacheprovider", *paths], cwd=REPO, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  collected = {line.strip() for line in proc.stdout.splitlines() if "::" in line}
  for name, _, test in checks:
    assert test in collected or any(c.startswith(test + "[") for c in collected), (name, test)


def git(root, *args) -> str:
  return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root,
                        check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture()
def fake_repo(tmp_path):
  root = tmp_path / "repo"
  (root / "tests").mkdir(parents=True)
  (root / FILE).write_text(FAKE)
  (root / ".gitignore").write_text("__pycache__/\n")
  git(root, "init", "-q")
  git(root, "add", ".")
  git(root, "commit", "-q", "-m", "fake checks")
  return root


def test_the_source_hash_covers_every_python_file_of_the_package(tmp_path):
  (tmp_path / "sub").mkdir()
  (tmp_path / "a.py").write_text("x = 1\n")
  (tmp_path / "sub" / "b.py").write_text("y = 2\n")
  (tmp_path / "notes.txt").write_text("not source")
  sha = lambda text: hashlib.sha256(text.encode()).hexdigest()
  expected = sha(f"a.py {sha('x = 1' + chr(10))}\nsub/b.py {sha('y = 2' + chr(10))}")
  assert pytest_outcomes.lla_source_sha256(tmp_path) == expected
  (tmp_path / "sub" / "b.py").write_text("y = 3\n")
  assert pytest_outcomes.lla_source_sha256(tmp_path) != expected


def claim_sha(test_id, outcome, file_bytes, report: str, commit: str, dirty: bool,
              source: str) -> str:
  """The recorded claim's hash, written out here (lla.study.pytest_outcomes); `source`:
  the lla source hash the document names (other engineers' edits may change lla/ while a
  test runs, so it is not recomputed here)."""
  claim = {"test": test_id, "outcome": outcome, "lla_version": lla.__version__,
           "git_commit": commit, "git_dirty": dirty, "lla_source_sha256": source,
           "test_file_sha256": hashlib.sha256(file_bytes).hexdigest(),
           "report_sha256": hashlib.sha256(report.encode()).hexdigest()}
  return hashlib.sha256(json.dumps(claim, sort_keys=True, separators=(",", ":"))
                        .encode()).hexdigest()


def by_check(items) -> dict:
  return {(i["module"], i["evidence"]): i for i in items}


def test_without_recorded_outcomes_every_check_is_unmeasured():
  items = qualification.from_checks(MODULES, None)
  assert [i["status"] for i in items] == ["unmeasured"] * 4
  assert {i["source"] for i in items} == {"not run"}
  q = matrix_lib.matrix(MODULES, items)
  assert q["good"]["synthetic"]["status"] == "unmeasured"
  assert matrix_lib.cell_text(q["good"]["synthetic"]) == "unmeasured (not run)"
  # And the real registry: no declared check is `pass` when nothing ran.
  modules = registry.module_entries()
  assert {i["status"] for i in qualification.from_checks(modules, None)} == {"unmeasured"}


def test_the_study_runs_the_checks_and_each_cell_is_its_outcome(fake_repo, tmp_path_factory):
  document = qualification.run_checks(qualification.check_ids(MODULES), root=fake_repo)
  tests = document["tests"]
  # Ran: the passing, the failing and both cases; the missing test has no outcome.
  assert sorted(tests) == sorted([PASSES, FAILS, f"{CASES}[1]", f"{CASES}[2]"])
  assert (tests[PASSES]["outcome"], tests[FAILS]["outcome"]) == ("passed", "failed")
  file_bytes = (fake_repo / FILE).read_bytes()
  commit = git(fake_repo, "rev-parse", "HEAD")
  assert (document["git_commit"], document["git_dirty"]) == (commit, False)
  assert document["test_files"] == {FILE: FAKE}  # kept, so the hashes recompute from it
  claim = claim_sha(PASSES, "passed", file_bytes, "", commit, False,
                    document["lla_source_sha256"])
  assert tests[PASSES]["outcome_sha256"] == claim
  assert "wrong on purpose" not in json.dumps(tests)  # the report is hashed, not stored
  study = str(tmp_path_factory.mktemp("study") / "study")
  rundir.create_study(study, {"G": {"policy": POL.policy_id, "policy_sha256": POL.sha256}})
  qualification.record_outcomes(study, qualification.check_outcomes(document, fake_repo),
                                "run by the study")
  recorded = qualification.recorded_outcomes(study)
  assert rundir.logged_files(study)[qualification.OUTCOMES_FILE][0] == hashlib.sha256(
      (pathlib.Path(study) / qualification.OUTCOMES_FILE).read_bytes()).hexdigest()
  items = by_check(qualification.from_checks(MODULES, recorded))
  assert items[("good", PASSES)]["status"] == "pass"
  assert items[("good", PASSES)]["outcome_sha256"] == claim
  assert items[("good", PASSES)]["source"] == f"pytest outcome in {qualification.OUTCOMES_FILE}"
  assert items[("good", CASES)]["status"] == "pass"  # every case passed
  assert items[("bad", FAILS)]["status"] == "fail"
  assert items[("bad", MISSING)]["status"] == "unmeasured"
  assert items[("bad", MISSING)]["source"] == "not run"
  q = matrix_lib.matrix(MODULES, list(items.values()))
  assert (q["good"]["synthetic"]["status"], q["good"]["reference_consistency"]["status"],
          q["bad"]["synthetic"]["status"], q["bad"]["reference_consistency"]["status"]) == (
              "pass", "pass", "fail", "unmeasured")
  assert q["good"]["synthetic"]["sources"] == [f"pytest outcome in {qualification.OUTCOMES_FILE}"]
  # A changed outcomes file is not the study's evidence.
  path = pathlib.Path(study) / qualification.OUTCOMES_FILE
  path.write_text(path.read_text().replace('"failed"', '"passed"'))
  with pytest.raises(ValueError, match="not the file the study's log recorded"):
    qualification.recorded_outcomes(study)


def test_outcomes_are_carried_only_when_they_are_what_they_claim(fake_repo, tmp_path):
  # A pytest run made outside the study, with the plugin, as a user (or CI) would.
  out = tmp_path / "outcomes.json"
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "lla.study.pytest_outcomes",
       "-p", "no:cacheprovider", f"--rootdir={fake_repo}", PASSES, FAILS],
      cwd=fake_repo, capture_output=True, text=True, timeout=300,
      env=dict(os.environ, **{pytest_outcomes.ENV: str(out)}))
  assert proc.returncode == 1, proc.stdout[-2000:]  # one test fails on purpose
  study = str(tmp_path / "study")
  rundir.create_study(study, {"G": {"policy": POL.policy_id, "policy_sha256": POL.sha256}})
  qualification.carry_outcomes(study, str(out), root=fake_repo)
  items = by_check(qualification.from_checks(MODULES, qualification.recorded_outcomes(study)))
  assert (items[("good", PASSES)]["status"], items[("bad", FAILS)]["status"],
          items[("good", CASES)]["status"]) == ("pass", "fail", "unmeasured")
  document = json.loads(out.read_text())
  # A claim edited after the run: refused.
  forged = json.loads(out.read_text())
  forged["tests"][FAILS]["outcome"] = "passed"
  with pytest.raises(ValueError, match="does not hash what it claims"):
    qualification.check_outcomes(forged, fake_repo)
  # The test's source edited in the document: its hash no longer recomputes.
  forged = json.loads(out.read_text())
  forged["test_files"][FILE] = FAKE.replace("1 + 1 == 3", "1 + 1 == 2")
  with pytest.raises(ValueError, match="does not hash to test_file_sha256"):
    qualification.check_outcomes(forged, fake_repo)
  # Another lla version or lla source, hashes made consistent: refused.
  for field in ("lla_version", "lla_source_sha256"):
    other = dict(document, **{field: "other"})
    other["tests"] = {t: dict(r, outcome_sha256=pytest_outcomes.outcome_sha256(t, r, other))
                      for t, r in document["tests"].items()}
    with pytest.raises(ValueError, match=field):
      qualification.check_outcomes(other, fake_repo)
  # The test file changed since it ran: its outcomes are dropped (unmeasured).
  (fake_repo / FILE).write_text(FAKE + "\n# edited\n")
  kept = qualification.check_outcomes(document, fake_repo)
  assert kept["tests"] == {}
  items = by_check(qualification.from_checks(MODULES, kept))
  assert items[("good", PASSES)]["status"] == "unmeasured"


def test_a_dirty_checkout_passes_nothing_and_no_commit_matches_nothing(fake_repo, tmp_path):
  (fake_repo / "notes.txt").write_text("uncommitted")  # an untracked file: a dirty tree
  document = qualification.run_checks([PASSES], root=fake_repo)
  commit = git(fake_repo, "rev-parse", "HEAD")
  assert document["git_dirty"] is True
  assert document["tests"][PASSES]["outcome_sha256"] == claim_sha(
      PASSES, "passed", FAKE.encode(), "", commit, True, document["lla_source_sha256"])
  items = by_check(qualification.from_checks(
      MODULES, qualification.check_outcomes(document, fake_repo)))
  assert items[("good", PASSES)]["status"] == "partial"  # passed, but not at a commit
  assert items[("good", PASSES)]["source"] == (
      f"pytest outcome in {qualification.OUTCOMES_FILE} (uncommitted changes)")
  assert "with uncommitted changes" in items[("good", PASSES)]["detail"]
  # The same document claiming a clean tree no longer hashes to its claims.
  with pytest.raises(ValueError, match="does not hash what it claims"):
    qualification.check_outcomes(dict(document, git_dirty=False), fake_repo)
  # A directory that no commit names runs nothing, says why in every cell, and its
  # "unknown" commit matches nothing, "unknown" included.
  plain = tmp_path / "plain"
  (plain / "tests").mkdir(parents=True)
  (plain / FILE).write_text(FAKE)
  document = qualification.run_checks([PASSES], root=plain)
  assert (document["git_commit"], document["tests"]) == ("unknown", {})
  item = by_check(qualification.from_checks(MODULES, document))[("good", PASSES)]
  assert item["status"] == "unmeasured" and "not a git checkout" in item["detail"]
  with pytest.raises(ValueError, match="made at commit 'unknown'"):
    qualification.check_outcomes(document, plain)


def test_the_job_runs_the_checks_of_the_attacks_it_measured(fake_repo, tmp_path):
  """run_and_record, as the main job calls it: only measured modules' checks run."""
  cap, run = str(tmp_path / "cap"), str(tmp_path / "run")
  syn.make_capture(cap, syn.truth_tokens(docs=8))
  syn.make_run(run, cap, [syn.Spec("good", "beam_inversion", 3, 0)], POL.sha256)
  document = qualification.run_and_record(run, MODULES, root=fake_repo)
  assert document["modules"] == ["good"]  # `bad` was not measured: its test did not run
  assert sorted(document["tests"]) == sorted([PASSES, f"{CASES}[1]", f"{CASES}[2]"])
  assert document["wall_s"] > 0
  items = by_check(qualification.from_checks(MODULES, qualification.recorded_outcomes(run)))
  assert (items[("good", PASSES)]["status"], items[("bad", FAILS)]["status"]) == (
      "pass", "unmeasured")
  assert rundir.verify(run) == []
  # Asked for a subset that excludes `good`: nothing runs.
  assert qualification.run_and_record(run, MODULES, root=fake_repo, only=("bad",))[
      "not_run"] == "no declared check names a test of this checkout"


def niceness_while_it_runs(pid: int) -> int | None:
  """The process's niceness once it has set its own (polled: it does so on starting, its
  pytest session then runs for a second or more), or None if it ended first."""
  seen, deadline = None, time.time() + 30
  while time.time() < deadline and seen != 19:
    try:
      seen = os.getpriority(os.PRIO_PROCESS, pid)
    except ProcessLookupError:
      return None
    time.sleep(0.005)
  return seen


def test_a_run_started_before_the_phases_records_only_the_measured_modules(fake_repo,
                                                                          tmp_path):
  """The main job's path: every module's checks start in the background at the lowest
  CPU priority before anything is measured; scoring keeps the measured modules' outcomes
  (their hashes still recompute) and records how and how long they ran."""
  cap, run = str(tmp_path / "cap"), str(tmp_path / "run")
  syn.make_capture(cap, syn.truth_tokens(docs=8))
  started = qualification.start_checks(MODULES, root=fake_repo)
  assert niceness_while_it_runs(started._process.pid) == 19
  assert sorted(started.test_ids) == sorted([PASSES, FAILS, CASES])  # MISSING: no test
  syn.make_run(run, cap, [syn.Spec("good", "beam_inversion", 3, 0)], POL.sha256)
  document = qualification.run_and_record(run, MODULES, root=fake_repo, started=started)
  assert document["modules"] == ["good"]
  assert sorted(document["tests"]) == sorted([PASSES, f"{CASES}[1]", f"{CASES}[2]"])
  assert document["test_files"] == {FILE: FAKE}
  assert 0 < document["wall_s"] <= started.finished - started.started + 0.1
  recorded = qualification.recorded_outcomes(run)  # its hashes recomputed from its text
  assert recorded["recorded"].endswith("started before its phases")
  items = by_check(qualification.from_checks(MODULES, recorded))
  assert (items[("good", PASSES)]["status"], items[("bad", FAILS)]["status"]) == (
      "pass", "unmeasured")
  assert rundir.verify(run) == []


def test_a_started_run_that_lacks_a_measured_check_is_replaced(fake_repo, tmp_path):
  cap, run = str(tmp_path / "cap"), str(tmp_path / "run")
  syn.make_capture(cap, syn.truth_tokens(docs=8))
  syn.make_run(run, cap, [syn.Spec("good", "beam_inversion", 3, 0)], POL.sha256)
  started = qualification.start_checks([m for m in MODULES if m["name"] == "bad"],
                                       root=fake_repo)
  assert started.test_ids == (FAILS,)
  document = qualification.run_and_record(run, MODULES, root=fake_repo, started=started)
  assert started._process.returncode is not None  # stopped
  assert sorted(document["tests"]) == sorted([PASSES, f"{CASES}[1]", f"{CASES}[2]"])
  assert qualification.recorded_outcomes(run)["recorded"] == (
      "run by the study (python -m pytest TEST_IDS)")
  # Past its limit (counted from its start) a run is stopped and says so.
  late = qualification.start_checks(MODULES, root=fake_repo)
  document = qualification.run_and_record(run, MODULES, root=fake_repo, started=late,
                                          timeout_s=0.0)
  assert document["tests"] == {} and document["not_run"] == (
      "the tests ran past the limit of 0 s")
  assert late._process.returncode is not None


def test_restricting_outcomes_keeps_a_parametrised_tests_cases_and_their_files():
  document = {"tests": {PASSES: {"outcome": "passed"}, f"{CASES}[1]": {"outcome": "passed"},
                        "tests/other.py::test_x": {"outcome": "failed"}},
              "test_files": {FILE: FAKE, "tests/other.py": "x"}, "git_commit": "c"}
  kept = qualification.restricted(document, [CASES])
  assert kept["tests"] == {f"{CASES}[1]": {"outcome": "passed"}}
  assert kept["test_files"] == {FILE: FAKE} and kept["git_commit"] == "c"
  assert qualification.restricted(document, [f"{FILE}::test_cas"])["tests"] == {}


@pytest.fixture(scope="module")
def card(tmp_path_factory):
  root = tmp_path_factory.mktemp("qual")
  syn.make_capture(str(root / "cap"), syn.truth_tokens(docs=64))
  specs = []
  for m in range(3):
    specs += [syn.Spec("activation", "beam_inversion", 30, m),
              syn.Spec("gradient_only", "gradient_heuristic", 1, m),
              syn.Spec("activation", "beam_inversion", 4, m, defense="mixup"),
              syn.Spec("activation_defense_aware", "beam_inversion", 6, m, defense="mixup"),
              syn.Spec("activation", "beam_inversion", 8, m, defense="gaussian"),
              syn.Spec("activation_defense_aware", "beam_inversion", 7, m, defense="gaussian"),
              syn.Spec("activation", "beam_inversion", 5, m, defense="topk"),
              syn.Spec("activation_defense_aware", "beam_inversion", 5, m, defense="topk")]
  syn.make_run(str(root / "run"), str(root / "cap"), specs, POL.sha256)
  return scorecard.build(str(root / "run"), POL, modules=registry.module_entries(),
                         contrasts=False)


def test_run_derived_items_carry_the_studys_numbers(card):
  modules = registry.module_entries()
  items = qualification.from_card(card, modules, POL)
  real = {i["module"]: i for i in items if i["kind"] == "real_model"}
  (undefended,) = card["undefended"]
  act, grad = undefended["pooled"]["activation"], undefended["pooled"]["gradient_only"]
  # 30 of 32 tokens per document clears the 1 pp bar; 1 of 32 is below the ~5% baseline.
  assert act["excess_pp"] > POL.positive_control_pp > grad["excess_pp"]
  assert (real["activation"]["status"], real["gradient_only"]["status"]) == ("pass", "partial")
  assert {i["source"] for i in items} == {qualification.SOURCE_RUNS}
  assert f"{act['excess_pp']:+.2f} pp" in real["activation"]["detail"]
  assert real["activation"]["evidence"] == "runs " + ", ".join(
      f"k6/public/none/m{m}/s0/activation" for m in range(3))
  adaptation = {i["detail"].split()[0]: i for i in items if i["kind"] == "adaptation"}
  # Defense-aware beats the unaware attack under mixup (6 > 4 hits), not under gaussian
  # (7 < 8), and a tie under topk (5 = 5, the same predictions) is no pass either.
  assert (adaptation["mixup"]["status"], adaptation["gaussian"]["status"],
          adaptation["topk"]["status"]) == ("pass", "partial", "partial")
  assert "a tie: not shown to help" in adaptation["topk"]["detail"]
  assert set(i["module"] for i in adaptation.values()) == {"activation_defense_aware"}


def test_the_matrix_marks_unrun_checks_unmeasured_beside_measured_runs(card):
  modules = registry.module_entries()
  items = qualification.from_checks(modules, None) + qualification.from_card(card, modules, POL)
  q = matrix_lib.matrix(modules, items)
  # Nothing ran the declared tests: their cells say so, whatever the runs show.
  assert q["activation"]["reference_consistency"]["status"] == "unmeasured"
  assert q["activation"]["reference_consistency"]["sources"] == ["not run"]
  assert q["decoy_structural"]["synthetic"]["status"] == "unmeasured"
  assert q["activation"]["real_model"]["status"] == "pass"
  assert q["activation"]["real_model"]["sources"] == [qualification.SOURCE_RUNS]
  assert q["activation_defense_aware"]["adaptation"]["status"] == "partial"  # worst of two
  assert q["gradient_only"]["real_model"]["status"] == "partial"
  assert q["ridge"]["real_model"]["status"] == matrix_lib.NOT_QUALIFIED
  text = scorecard.markdown({**card, "qualification": q})
  assert "| activation | passive | unmeasured (not run) |" in text


def test_the_main_job_starts_the_checks_of_the_modules_it_plans():
  """A job whose phases measure ridge and the decoy split's modules plans exactly those
  (listed here by hand); one whose named modules it does not plan starts nothing, where an
  empty selection used to start every registered module's checks."""
  from configs import main_table as main_table_config  # pylint: disable=g-import-not-at-top
  from lla.study import main_table  # pylint: disable=g-import-not-at-top
  config = main_table_config.get_config("tiny")
  for field in ("secondary_attacks", "defenses"):
    config[field] = ()
  config.attacks, config.published.attacks, config.corpus_study.corpora = ("ridge",), (), ()
  config.decoy.probe.classifiers = ("linear",)
  assert main_table.planned_modules(config) == [
      "decoy_content_forward_linear", "decoy_content_gradient_linear",
      "decoy_content_joined_linear", "decoy_norm", "decoy_structural", "ridge"]
  config.qualification.modules = ("sipit",)
  assert main_table.start_checks(config) is None
