"""End to end: the main job on the tiny config, then verify / rescore / regenerate."""

import json

import pytest

from configs import main_table as main_table_config
from lla.attacks import regenerate
from lla.evidence import rundir
from lla.scoring import scorecard
from lla.study import main_table

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def finished(tmp_path_factory, data_dir, monkeypatch_module):
  monkeypatch_module.setenv("LLA_DATA_DIR", str(data_dir))
  monkeypatch_module.setenv("LLA_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
  config = main_table_config.get_config("tiny")
  workdir = tmp_path_factory.mktemp("main")
  report = main_table.run(config, str(workdir))
  return config, workdir, report


@pytest.fixture(scope="module")
def monkeypatch_module():
  with pytest.MonkeyPatch.context() as mp:
    yield mp


def test_report_has_every_section(finished):
  _, _, report = finished
  text = report.read_text()
  for heading in ("Main table", "primary test", "Corpus study", "Defense verdicts",
                  "Exact-document against token recovery", "FLOPs and wall time",
                  "Decoy-row training split", "Coverage"):
    assert heading in text, heading
  assert (report.parent / "frontier.png").stat().st_size > 1000
  assert (report.parent / "recovery.png").stat().st_size > 1000


def test_study_verifies_and_rescores(finished):
  _, workdir, _ = finished
  study = str(workdir / main_table.STUDY)
  assert rundir.verify(study) == []
  stored = (workdir / main_table.STUDY / rundir.SCORECARD_JSON).read_bytes()
  card = scorecard.build_from_inputs(study, json.loads(stored)["inputs"], None)
  assert scorecard.to_bytes(card) == stored


def test_predictions_regenerate_bit_for_bit(finished):
  _, workdir, _ = finished
  assert regenerate.regenerate(str(workdir / main_table.STUDY)) == []


def test_gates_decide_every_defense_with_three_seeds(finished):
  _, workdir, _ = finished
  card = json.loads((workdir / main_table.STUDY / rundir.SCORECARD_JSON).read_text())
  assert card["gates"], "no defended configuration was gated"
  for gate in card["gates"]:
    assert gate["decision"] in ("PASS", "FAIL", "INSUFFICIENT_EVIDENCE")
    assert gate["n_seeds"] == 3


def test_rerun_of_a_finished_study_only_renders(finished):
  config, workdir, report = finished
  before = {p: p.stat().st_mtime_ns for p in (workdir / main_table.STUDY).rglob("*") if p.is_file()}
  assert main_table.run(config, str(workdir)) == report
  after = {p: p.stat().st_mtime_ns for p in (workdir / main_table.STUDY).rglob("*") if p.is_file()}
  assert before == after
