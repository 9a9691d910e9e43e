"""Scorecard JSON/Markdown, coverage, qualification and policy checks."""

import datetime
import json
import os

import pytest

from configs import scoring as scoring_config
from lla.evidence import rundir
from lla.scoring import coverage
from lla.scoring import policy as policy_lib
from lla.scoring import qualification
from lla.scoring import scorecard
from lla.scoring import synthetic as syn
from lla.scoring import validation

POL = policy_lib.load_policy()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("sc"))
  syn.make_capture(os.path.join(d, "cap"), syn.truth_tokens(docs=64))
  specs = [syn.Spec(s.attack, s.family, s.correct_per_doc, s.model_seed,
                    defense=s.defense, jitter=2)
           for s in validation.standard_specs()]
  syn.make_run(os.path.join(d, "run"), os.path.join(d, "cap"), specs,
               POL.sha256, finalize=False)
  return os.path.join(d, "run")


def test_score_run_writes_reproducible_card(run):
  cfg = scoring_config.get_config()
  card = scorecard.score_run(run, cfg, modules=validation.MODULES,
                             qualification_evidence=[])
  rundir.finalize(run)
  assert rundir.verify(run) == []
  with open(os.path.join(run, "scorecard.json"), "rb") as f:
    raw = f.read()
  again = scorecard.build_from_inputs(run, json.loads(raw)["inputs"], POL)
  assert scorecard.to_bytes(again) == raw
  assert raw == json.dumps(card, sort_keys=True, separators=(",", ":"),
                           ensure_ascii=False).encode() + b"\n"
  assert card["schema"] == "lla.scorecard.v1"
  assert b"T00:00:00" not in raw  # the synthetic run's log time never leaks
  with pytest.raises(ValueError, match="run is sealed"):
    scorecard.score_run(run, cfg)
  with open(os.path.join(run, "scorecard.json"), "rb") as f:
    assert f.read() == raw  # refused before the card was touched
  assert rundir.verify(run) == []


def test_rows_match_direct_counts(run):
  card = scorecard.build(run, POL)
  truth = rundir.load_truth(os.path.join(run, "../cap/truth.safetensors"))
  for row in card["rows"]:
    rec = next(r for r in rundir.load_records(run) if r.run_id == row["run_id"])
    pred = rundir.load_predictions(rundir.resolve(run, rec.prediction_file))
    assert row["metrics"]["hits"] == int((pred == truth).sum())
    assert row["metrics"]["docs_exact"] == int((pred == truth).all(1).sum())
    assert row["metrics"]["baseline_p0"] == float((truth == 0).mean())


def test_markdown_leads_with_unmeasured_share(run):
  card = scorecard.build(run, POL, validation.SPACE, validation.MODULES)
  md = scorecard.markdown(card)
  first = md.splitlines()[2]
  assert first.startswith("**Unmeasured share of the declared threat space: "
                          "0/4 in-scope cells (0.0%)**")
  assert "| mixup | 6 | public | synthetic | **PASS** |" in md


def test_coverage_cells():
  space = coverage.ThreatSpace(
      ("f",), ("activations", "gradients"), ("public",), ("none", "d"),
      out_of_scope=({"observation": "gradients", "defense": "d",
                     "reason": "not applicable"},),
      declared_unmeasured=(("timing metadata", "no module"),))
  modules = [{"name": "a", "family": "f", "observations": ["activations"]},
             {"name": "g", "family": "f", "observations": ["gradients"]}]

  class R:  # Only the fields coverage reads.
    def __init__(self, attack, status, defense, seed):
      self.run_id, self.attack, self.status = f"{attack}{defense}{seed}", attack, status
      self.defense, self.knowledge, self.model_seed = defense, "public", seed
      self.error = None if status == "ok" else "boom"
  recs = ([R("a", "ok", "none", s) for s in range(3)] +
          [R("a", "ok", "d", 0), R("a", "crashed", "d", 1)] +
          [R("g", "crashed", "none", 0), R("zzz", "ok", "none", 0)])
  rep = coverage.report(recs, space, modules)
  status = {(c["observation"], c["defense"]): c["status"] for c in rep["cells"]}
  assert status == {("activations", "none"): "covered",
                    ("activations", "d"): "partial",
                    ("gradients", "none"): "unmeasured",
                    ("gradients", "d"): "out of scope"}
  assert rep["unmeasured_share"] == pytest.approx(1 / 3)
  assert rep["unplaced"][0]["run_id"] == "zzznone0"
  assert rep["declared_unmeasured"] == [{"class": "timing metadata",
                                         "reason": "no module"}]
  assert len(coverage.PROTOCOL_DECLARED_UNMEASURED) == 6


def test_qualification_matrix():
  mods = [{"name": "joint", "capabilities": ["kv_cache", "beam"]},
          {"name": "bisr"}]
  ev = [{"module": "joint", "kind": "reference_consistency", "status": "pass",
         "evidence": "tests/test_attacks.py::test_ref", "capability": "beam"},
        {"module": "joint", "kind": "reference_consistency", "status": "partial",
         "evidence": "run:k6/public/seed0/joint"}]
  q = qualification.matrix(mods, ev)
  assert q["joint"]["reference_consistency"]["status"] == "partial"
  assert q["joint"]["real_model"]["status"] == "not qualified"
  assert q["joint"]["untested_capabilities"] == ["kv_cache"]
  assert q["bisr"]["untested_capabilities"] == []
  with pytest.raises(ValueError, match="unknown module 'x'"):
    qualification.matrix(mods, [dict(ev[0], module="x")])


def test_policy_file_and_checks(tmp_path):
  assert POL.policy_id == "scorecard-policy.v3"
  assert (POL.threshold_pp, POL.wilson_z, POL.min_seeds) == (1.0, 2.5392, 3)
  assert POL.bootstrap["replicates"] == 100000 and POL.bootstrap["seed"] == 93281
  day = POL.created
  assert policy_lib.check(POL, POL.sha256, day) == []
  flags = policy_lib.check(POL, "0" * 64, day - datetime.timedelta(days=1))
  assert len(flags) == 2 and "after the run started" in flags[1]
  bad = tmp_path / "scorecard-policy.v3.json"
  bad.write_text("{}")
  with pytest.raises(ValueError, match="lacks fields"):
    policy_lib.load_policy(str(bad))
