"""End to end: the main job on the tiny config, then verify / rescore / regenerate."""

import json

import numpy as np
import pytest

from configs import main_table as main_table_config
from lla.replay import regenerate
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
  config, workdir, _ = finished
  result = regenerate.check(str(workdir / main_table.STUDY))
  assert result.problems == [] and result.provenance == []
  # The decoy-row records are produced by their own driver, not replay: listed, not redone.
  # Per seed and arm: decoy_structural, decoy_norm and 3 features x classifiers content probes.
  n_decoy = config.decoy.num_seeds * 2 * (2 + 3 * len(config.decoy.probe.classifiers))
  assert len(result.skipped) == n_decoy
  assert all(s.startswith("decoy/") and "runs in its own driver" in s for s in result.skipped)


# Decisions of the tiny main job: 3 fine-tuned models x 48 documents per defended capture,
# so that the floor (about 0.7 pp) allows PASS and FAIL. The decoy-row configurations have
# no undefended run of their family (the decoy experiment's positive control is its own
# leak injection), so the scorecard policy cannot decide them.
# Measured (envelope pp, floor 0.81 pp): projection -3.9; gaussian 1.5, topk 2.6, quantize
# 44, mixup 30, gradient_clip_noise 94, nopeek 96; decoy rows 40 (no mitigation), 0.3.
TINY_DECISIONS = {
    # PASS before the adaptive attacks (PROTOCOL 5a): projection_adaptive recovers the text.
    "projection_enabledTrue": "FAIL",
    "gaussian_sigma0.3": "FAIL", "topk_sparsity0.75": "FAIL", "quantize_bits2": "FAIL",
    "mixup_m2": "FAIL", "gradient_clip_noise_clip_norm0.01": "FAIL", "nopeek_alpha1.0": "FAIL",
    "decoy_rows/none": "INSUFFICIENT_EVIDENCE", "decoy_rows/mitigated": "INSUFFICIENT_EVIDENCE",
}


def test_tiny_gates_decide(finished):
  _, workdir, _ = finished
  card = json.loads((workdir / main_table.STUDY / rundir.SCORECARD_JSON).read_text())
  decisions = {g["config"]["defense_params"].get("label") or
               f"decoy_rows/{g['config']['defense_params']['mitigation']}": g["decision"]
               for g in card["gates"]}
  assert decisions == TINY_DECISIONS
  for gate in card["gates"]:
    assert gate["n_seeds"] == 3
    if gate["config"]["defense"] == "decoy_rows":
      assert any("no positive control" in r for r in gate["reasons"]), gate["reasons"]
      # Decoy frames are an observation kind of their own: only decoy attacks fit them.
      assert all(n.startswith("decoy_") for n in gate["fitting"]["fitting"]), gate["fitting"]
    else:
      assert gate["envelope"]["floor_pp"] < 1.0, gate["envelope"]
      # tiny skips the published attacks on defended captures: named, so no PASS.
      assert any(r.startswith("fitting attack(s) unmeasured: bisr") for r in gate["reasons"])
  projection, = [g for g in card["gates"] if g["config"]["defense"] == "projection"]
  assert projection["envelope"]["argmax"] == "projection_adaptive"
  # The policy's primary test is at k = 6; tiny has k = 2 only: not evaluated, and says why.
  (primary,) = card["contrasts"]["primary"]
  assert primary == {"evaluated": False, "reason": "no measured joint/activation records at "
                     "cut 6, public knowledge"}


def test_tiny_scorecard_carries_qualification_and_decoy_coverage(finished):
  _, workdir, _ = finished
  card = json.loads((workdir / main_table.STUDY / rundir.SCORECARD_JSON).read_text())
  quality = card["qualification"]
  # The tiny job runs no declared test (config.qualification): unmeasured, never assumed.
  assert quality["activation"]["reference_consistency"]["status"] == "unmeasured"
  assert quality["activation"]["reference_consistency"]["sources"] == ["not run"]
  assert quality["activation"]["real_model"]["status"] == "pass"
  # Each defended configuration: "pass" iff refitting on the defended calibration is at
  # least the unaware attack's excess, recomputed from the gate's pooled figures. Under
  # Gaussian noise, top-k and projection both sit near the baseline (their order is
  # floating-point noise across machines); quantisation helps and mixup hurts by margins
  # of ~14 and ~9 pp.
  adaptation = quality["activation_defense_aware"]["adaptation"]
  gates_by_label = {g["config"]["defense_params"].get("label", g["config"]["defense"]): g
                    for g in card["gates"]}
  statuses = {}
  for item in adaptation["evidence"]:
    label = item["detail"].split()[0]
    pooled = gates_by_label[label]["pooled"]
    aware = pooled["activation_defense_aware"]["excess_pp"]
    assert item["status"] == ("pass" if aware >= pooled["activation"]["excess_pp"]
                              else "partial"), item
    statuses[label] = item["status"]
  assert sorted(statuses) == ["gaussian_sigma0.3", "mixup_m2", "projection_enabledTrue",
                              "quantize_bits2", "topk_sparsity0.75"]
  assert statuses["quantize_bits2"] == "pass" and statuses["mixup_m2"] == "partial"
  assert adaptation["status"] == "partial"
  cells = {(c["family"], c["observation"]): c["status"] for c in card["coverage"]["cells"]
           if c["defense"] == "decoy_rows" and c["knowledge"] == "trained"}
  assert cells[("decoy_structural", "decoy_gradients")] == "covered"
  assert cells[("decoy_content", "decoy_forward+decoy_gradients")] == "covered"
  assert card["coverage"]["unplaced"] == []


def test_rerun_of_a_finished_study_only_renders(finished):
  config, workdir, report = finished
  before = {p: p.stat().st_mtime_ns for p in (workdir / main_table.STUDY).rglob("*") if p.is_file()}
  assert main_table.run(config, str(workdir)) == report
  after = {p: p.stat().st_mtime_ns for p in (workdir / main_table.STUDY).rglob("*") if p.is_file()}
  assert before == after


# --- A synthetic scored study beside it: every decision path with known answers --------
#
# Predictions hit exactly a chosen number of the 32 tokens of each of 64 documents
# (lla.scoring.synthetic), on 3 models at k = 6, public knowledge (the policy's primary
# setting). The study is scored by the main job's own scoring phase and rendered by its
# report, so the decisions below are the main job's, on inputs whose answers are known:
#   projection  0 hits under the defense, a strong undefended control  -> PASS
#   gaussian    20 of 32 hits under the defense                       -> FAIL
#   mixup       0 hits, but only 2 of the 3 models                    -> INSUFFICIENT_EVIDENCE
#   primary     joint 31 vs activation 28 (+-1 per document)          -> met (lower bound > 2 pp)

SYNTHETIC_DECISIONS = {"projection": "PASS", "gaussian": "FAIL",
                       "mixup": "INSUFFICIENT_EVIDENCE"}


def _synthetic_specs():
  from lla.attacks import registry  # pylint: disable=g-import-not-at-top
  from lla.scoring import gates  # pylint: disable=g-import-not-at-top
  from lla.scoring import synthetic as syn  # pylint: disable=g-import-not-at-top
  # A PASS needs every registered attack that fits the defended capture measured (PROTOCOL
  # section 5a): under the projection, each of them recovers nothing.
  others = [(m["name"], m["family"]) for m in gates.fitting_modules(
      registry.module_entries(), None, "public", "projection")
            if m["name"] not in ("activation", "joint")]
  specs = []
  for m in range(3):
    specs += [syn.Spec(name, family, 0, m, defense="projection") for name, family in others]
    specs += [syn.Spec("activation", "beam_inversion", 28, m, jitter=1),
              syn.Spec("joint", "beam_inversion", 31, m, jitter=1),
              syn.Spec("shuffled_gradients", "beam_inversion", 28, m, jitter=1),
              syn.Spec("activation", "beam_inversion", 0, m, defense="projection"),
              syn.Spec("joint", "beam_inversion", 0, m, defense="projection"),
              syn.Spec("activation", "beam_inversion", 20, m, defense="gaussian")]
    if m < 2:
      specs.append(syn.Spec("activation", "beam_inversion", 0, m, defense="mixup"))
  return specs


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
  from lla.scoring import policy as policy_lib  # pylint: disable=g-import-not-at-top
  from lla.scoring import synthetic as syn  # pylint: disable=g-import-not-at-top
  from lla.study import report as report_lib  # pylint: disable=g-import-not-at-top
  config = main_table_config.get_config("tiny")
  workdir = tmp_path_factory.mktemp("synthetic")
  syn.make_capture(str(workdir / "captures" / "cap"), syn.truth_tokens(docs=64))
  study = workdir / main_table.STUDY
  syn.make_run(str(study), str(workdir / "captures" / "cap"), _synthetic_specs(),
               policy_lib.load_policy(config.scoring.policy).sha256, finalize=False)
  card = main_table.score(config, study)
  rundir.finalize(str(study))
  return config, workdir, card, report_lib.render(config, workdir)


def test_synthetic_study_decisions(synthetic):
  _, _, card, _ = synthetic
  decisions = {g["config"]["defense"]: g["decision"] for g in card["gates"]}
  assert decisions == SYNTHETIC_DECISIONS
  reasons = {g["config"]["defense"]: g["reasons"] for g in card["gates"]}
  assert reasons["mixup"][0] == "2 independent seed(s), policy needs >= 3"
  assert reasons["gaussian"][0].startswith("envelope ") and "> 1 pp" in reasons["gaussian"][0]


def test_synthetic_primary_test_against_an_independent_count(synthetic):
  _, workdir, card, report = synthetic
  study = workdir / main_table.STUDY
  truth = rundir.load_truth(str(workdir / "captures" / "cap" / "truth.safetensors"))
  gains = []
  for m in range(3):
    hits = {a: (np.load(study / "predictions" / f"k6__public__none__m{m}__s0__{a}.npy")
                == truth).sum(axis=1) for a in ("joint", "activation")}
    gains.append(hits["joint"] - hits["activation"])
  expected = 100 * np.mean(gains) / truth.shape[1]
  (primary,) = card["contrasts"]["primary"]
  assert primary["evaluated"] and primary["passed"] is True
  assert primary["estimate"] == pytest.approx(expected, abs=1e-12)
  assert primary["lo"] > 2.0 and primary["lo"] < primary["estimate"] < primary["hi"]
  text = report.read_text()
  assert (f"| **primary**: joint − activation (k = 6, public knowledge) | synthetic | "
          f"{primary['estimate']:+.2f} | [{primary['lo']:+.2f}, {primary['hi']:+.2f}] (95%) | "
          "lower bound > +2.0 | yes |") in text
  assert "is met: " in text and "lies above +2.0 pp." in text
  assert "| secondary: joint − shuffled_gradients | synthetic |" in text


def test_synthetic_study_report_verifies_and_rescores(synthetic):
  _, workdir, card, report = synthetic
  study = str(workdir / main_table.STUDY)
  assert rundir.verify(study) == []
  stored = (workdir / main_table.STUDY / rundir.SCORECARD_JSON).read_bytes()
  assert scorecard.to_bytes(scorecard.build_from_inputs(
      study, json.loads(stored)["inputs"], None)) == stored
  text = report.read_text()
  for defense, decision in SYNTHETIC_DECISIONS.items():
    assert f"| {defense} | — | **{decision}** |" in text  # No declared strength.
  assert card["qualification"]["activation"]["real_model"]["status"] == "pass"
