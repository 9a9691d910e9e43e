"""Decoy-row results as study records: the scorer recomputes the decoy experiment's numbers.

One seed of a tiny decoy-row split (synthetic tokens, 64 frames, short probes, no
calibration) is run with a study directory; its records must verify, be placed by
coverage in the decoy cells, and re-score to the experiment's own row agreement, probe
accuracies and baseline, from predictions and the capture's scored views alone.
"""

import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from configs import decoy_leak
from configs import scoring as scoring_config
from lla.attacks import registry
from lla.decoy import capture, modules
from lla.decoy import run as decoy_run
from lla.evidence import manifest, rundir
from lla.scoring import policy as policy_lib
from lla.scoring import scorecard


def _config():
  config = decoy_leak.get_config("tiny")
  config.protocol.steps = 64
  config.protocol.pool_size = 128
  config.data.synthetic_tokens = 6000
  config.train.chunk = 32
  config.eval.blocks = 8
  config.probe.steps = 20
  config.probe.classifiers = ("linear",)  # 3 arms: one compiled probe per feature width
  config.calibration.seeds = 0
  return config


@pytest.fixture(scope="module")
def decoy(tmp_path_factory):
  root = tmp_path_factory.mktemp("decoy")
  study = str(root / "study")
  pol = policy_lib.load_policy()
  rundir.create_study(study, {"G": {"policy": pol.policy_id, "policy_sha256": pol.sha256}})
  config = _config()
  policy, policy_sha = decoy_run.load_policy(config.policy)
  result = decoy_run.run_seed(config, 0, decoy_run.load_data(config), policy, policy_sha,
                              str(root / "decoy"), study)
  return root, study, config, result


def test_records_reproduce_the_decoy_numbers(decoy):
  root, study, config, result = decoy
  space = scorecard.threat_space_from_config(scoring_config.get_config().threat_space)
  card = scorecard.build(study, threat_space=space, modules=registry.module_entries())
  rows = {r["run_id"]: r["metrics"] for r in card["rows"]}
  assert len(rows) == 2 * 4
  for arm in ("none", "mitigated"):
    s = rows[f"decoy/{arm}/m0/decoy_structural"]
    assert s["token_recovery"] == result[arm]["structural"]["row_agreement"]
    assert (s["docs_exact"], s["docs"]) == (result[arm]["structural"]["frames_exact"], 64)
    assert s["baseline_p0"] == pytest.approx(48 / 80)
    content = result[arm]["content"]
    for key, arm_result in content["arms"].items():
      features, classifier = key.split("/")
      m = rows[f"decoy/{arm}/m0/{modules.content_name(features, classifier)}"]
      assert m["token_recovery"] == pytest.approx(arm_result["accuracy"], abs=1e-15)
      assert m["baseline_p0"] == pytest.approx(content["baseline"]["accuracy"], abs=1e-15)
      assert m["n"] == content["n_rows"] == 32 * 32
  # Without mitigation the structural attack is exact; with it, no better than the base rate.
  assert rows["decoy/none/m0/decoy_structural"]["token_recovery"] == 1.0
  assert rows["decoy/mitigated/m0/decoy_structural"]["token_recovery"] == pytest.approx(32 / 80)
  cells = {(c["family"], c["observation"]): c for c in card["coverage"]["cells"]
           if c["knowledge"] == "trained" and c["defense"] == "decoy_rows"}
  for family, observation in (("decoy_structural", "gradients"),
                              ("decoy_content", "gradients"), ("decoy_content", "activations"),
                              ("decoy_content", "activations+gradients")):
    assert cells[(family, observation)]["status"] == "partial"  # 1 seed of 3
  assert card["coverage"]["unplaced"] == []
  rundir.finalize(study)
  assert rundir.verify(study) == []


def test_resume_rewrites_nothing_and_missing_records_are_replayed(decoy):
  root, study, config, result = decoy
  rundir.reopen(study)
  name = "decoy__mitigated__m0__decoy_content_joined_linear"
  rundir.remove_file(study, f"records/{name}.json", "retry", previous_status="ok")
  rundir.remove_file(study, f"predictions/{name}.npy", "discard_orphan")
  policy, policy_sha = decoy_run.load_policy(config.policy)
  again = decoy_run.run_seed(config, 0, decoy_run.load_data(config), policy, policy_sha,
                             str(root / "decoy"), study)
  assert again == result
  rundir.finalize(study)
  assert rundir.verify(study) == []


def test_capture_write_refuses_to_overwrite_and_read_checks_values(decoy, tmp_path):
  root, _, _, _ = decoy
  directory = str(root / "decoy" / "seed_0" / "capture_none")
  messages, truth, metadata, _ = capture.read(directory)
  with pytest.raises(FileExistsError, match="refusing to overwrite"):
    capture.write(directory, messages["forward"], messages["gradient"], truth, metadata)
  copy = tmp_path / "cap"
  capture.write(str(copy), messages["forward"], messages["gradient"], truth, metadata)
  forward = load_file(str(copy / capture.MESSAGES))
  forward["forward"][3, 1, 2] = np.nan
  os.remove(copy / capture.MESSAGES)
  save_file(forward, str(copy / capture.MESSAGES))
  os.remove(copy / manifest.MANIFEST_NAME)
  manifest.write_manifest(str(copy))
  with pytest.raises(ValueError, match=r"forward contains NaN or Inf \(1 values\)"):
    capture.read(str(copy))
  truth_f = load_file(str(copy / capture.TRUTH))
  truth_f["input_tokens"] = truth_f["input_tokens"].astype(np.int64)
  os.remove(copy / capture.TRUTH)
  save_file(truth_f, str(copy / capture.TRUTH))
  with pytest.raises(ValueError, match="capture fails its manifest"):
    capture.read(str(copy))
