"""Decoy-row results as study records: the scorer recomputes the decoy experiment's numbers.

One capture of a tiny decoy-row split (synthetic tokens, 64 frames, no mitigation, short
linear probes) is analysed with its predictions kept and written into a study; the records
must verify, be placed by coverage in the decoy cells, and re-score to the experiment's own
row agreement, probe accuracies and baseline, from predictions and the capture's scored
views alone. (The main job's use of it, both arms and three seeds, is tests/test_e2e_*.)
"""

import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from configs import decoy_leak
from configs import scoring as scoring_config
from lla.attacks import registry
from lla.decoy import capture, modules
from lla.decoy import records as decoy_records
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
  return config


@pytest.fixture(scope="module")
def decoy(tmp_path_factory):
  root = tmp_path_factory.mktemp("decoy")
  study = str(root / "study")
  pol = policy_lib.load_policy()
  rundir.create_study(study, {"G": {"policy": pol.policy_id, "policy_sha256": pol.sha256}})
  config = _config()
  policy, policy_sha = decoy_run.load_policy(config.policy)
  directory = str(root / "decoy" / "capture_none")
  decoy_run.train_and_capture(config, 0, "none", decoy_run.load_data(config), policy_sha,
                              directory)
  predictions = {}
  result = decoy_run.analyse(directory, config, policy, 0, calibrate_it=False,
                             predictions=predictions)
  written = decoy_records.write(study, directory, config, 0, "none", predictions, 1.0)
  return root, study, config, result, written, predictions


@pytest.mark.slow
def test_records_reproduce_the_decoy_numbers(decoy):
  _, study, config, result, written, _ = decoy
  assert sorted(r.attack for r in written) == sorted(decoy_records.names(config))
  space = scorecard.threat_space_from_config(scoring_config.get_config().threat_space)
  card = scorecard.build(study, threat_space=space, modules=registry.module_entries())
  rows = {r["run_id"]: r["metrics"] for r in card["rows"]}
  assert len(rows) == 5
  for attack, key in (("decoy_structural", "structural"), ("decoy_norm", "norm")):
    s = rows[f"decoy/none/m0/{attack}"]
    assert s["token_recovery"] == result[key]["row_agreement"] == 1.0
    assert (s["docs_exact"], s["docs"]) == (result[key]["frames_exact"], 64)
    assert s["baseline_p0"] == pytest.approx(48 / 80)
  content = result["content"]
  for key, arm_result in content["arms"].items():
    m = rows[f"decoy/none/m0/{modules.content_name(*key.split('/'))}"]
    assert m["token_recovery"] == pytest.approx(arm_result["accuracy"], abs=1e-15)
    assert m["baseline_p0"] == pytest.approx(content["baseline"]["accuracy"], abs=1e-15)
    assert m["n"] == content["n_rows"] == 32 * 32
  cells = {(c["family"], c["observation"]): c["status"] for c in card["coverage"]["cells"]
           if c["knowledge"] == "trained" and c["defense"] == "decoy_rows"
           and c["family"].startswith("decoy_")}
  # Decoy frames are an observation kind of their own: the split LLM's h and g are out of
  # scope under the decoy-row split.
  out = "out of scope"
  assert cells == {("decoy_structural", "decoy_gradients"): "partial",  # 1 seed of 3
                   ("decoy_structural", "decoy_forward"): "unmeasured",
                   ("decoy_structural", "decoy_forward+decoy_gradients"): "unmeasured",
                   ("decoy_content", "decoy_gradients"): "partial",
                   ("decoy_content", "decoy_forward"): "partial",
                   ("decoy_content", "decoy_forward+decoy_gradients"): "partial",
                   **{(f, o): out for f in ("decoy_structural", "decoy_content")
                      for o in ("activations", "gradients", "activations+gradients")}}
  assert card["coverage"]["unplaced"] == []
  rundir.finalize(study)
  assert rundir.verify(study) == []


@pytest.mark.slow
def test_decoy_gate_requires_the_decoy_attacks_only_and_the_table_names_the_arm(decoy):
  """The decoy capture's O holds decoy frames, which no generic attack reads: the gate's
  fitting set is the decoy modules (every registered one, the unrun mlp probes named as
  not run), and the verdict table names the arm."""
  from lla.study import report  # pylint: disable=g-import-not-at-top
  _, study, config, _, _, _ = decoy
  card = scorecard.build(study, modules=registry.module_entries(), contrasts=False)
  gate, = card["gates"]
  assert gate["config"]["defense"] == "decoy_rows"
  decoy_modules = ["decoy_structural", "decoy_norm"] + [
      f"decoy_content_{f}_{c}" for f in ("gradient", "forward", "joined")
      for c in ("linear", "mlp")]
  assert gate["fitting"]["fitting"] == sorted(decoy_modules)
  assert gate["fitting"]["adaptive"] == ["decoy_norm"]
  assert gate["fitting"]["observed"] == [{"observations": ["decoy_forward", "decoy_gradients"],
                                          "captures": 1, "fitting": sorted(decoy_modules)}]
  unrun = [f"decoy_content_{f}_mlp" for f in ("forward", "gradient", "joined")]
  assert gate["fitting"]["unmeasured"] == {n: "not run" for n in unrun}
  assert ("fitting attack(s) unmeasured: "
          + ", ".join(f"{n} (not run)" for n in unrun)) in gate["reasons"]
  assert not any("activation" in r or "joint" in r for r in gate["reasons"])
  row, = [l for l in report.defense_table(report._defense_points(card, {}))
          if l.startswith("| decoy_rows")]
  assert row.startswith("| decoy_rows (arm: none) | none | **INSUFFICIENT_EVIDENCE** |")
  mitigated = decoy_records.defense_params(config, "mitigated")
  assert report.defense_label("decoy_rows", mitigated) == (
      "decoy_rows (arm: mitigated)",
      f"clip {config.mitigation.grad_clip:g}, noise {config.mitigation.grad_noise:g}")


@pytest.mark.slow
def test_writing_again_reuses_the_records(decoy):
  _, study, config, _, written, predictions = decoy
  rundir.reopen(study)
  before = rundir.logged_files(study)
  again = decoy_records.write(study, str(decoy[0] / "decoy" / "capture_none"), config, 0,
                              "none", predictions, 1.0)
  assert again == written and rundir.logged_files(study) == before
  rundir.finalize(study)


@pytest.mark.slow
def test_capture_write_refuses_to_overwrite_and_read_checks_values(decoy, tmp_path):
  root = decoy[0]
  directory = str(root / "decoy" / "capture_none")
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
  wrong = dict(truth, input_tokens=truth["input_tokens"].astype(np.int64))
  with pytest.raises(ValueError, match=r"input_tokens must be int32 \[64, 80\]"):
    capture.write(str(tmp_path / "cap2"), messages["forward"], messages["gradient"], wrong,
                  metadata)
  assert not (tmp_path / "cap2").exists()


class Crash(Exception):
  """The injected failure between a decoy write and its log entry (or the next write)."""


def _crash_on_append(monkeypatch, event_type: str) -> None:
  """The first log append of `event_type` raises: its file is written, not logged."""
  from lla.evidence import hashlog  # pylint: disable=g-import-not-at-top
  original, fired = hashlog.HashLog.append, []

  def append(self, event, time=None):
    if event.get("type") == event_type and not fired:
      fired.append(event["file"])
      raise Crash(event["file"])
    return original(self, event, time=time)

  monkeypatch.setattr(hashlog.HashLog, "append", append)
  return fired


def _crash_before_record(monkeypatch) -> list:
  """The first record is never written: its predictions are written and logged."""
  fired = []

  def save_record(run_dir, name, record):
    fired.append(f"{rundir.PREDICTIONS}/{name}.npy")
    raise Crash(name)

  monkeypatch.setattr(rundir, "save_record", save_record)
  return fired


@pytest.mark.parametrize("point", ["predictions_unlogged", "record_not_written",
                                   "record_unlogged"])
@pytest.mark.slow
def test_a_crash_at_each_decoy_write_point_resumes_to_a_verifying_study(decoy, tmp_path,
                                                                        monkeypatch, point):
  """The state after the crash, then a resume (the same write again) that reproduces the
  uninterrupted records' predictions and leaves a study that verifies: a file written but
  not logged is discarded (logged) and written again, never reused silently, and logged
  predictions without their record no longer make the resume fail (FileExistsError)."""
  root, _, config, _, written, predictions = decoy
  directory = str(root / "decoy" / "capture_none")
  study = str(tmp_path / "study")
  pol = policy_lib.load_policy()
  rundir.create_study(study, {"G": {"policy": pol.policy_id, "policy_sha256": pol.sha256}})
  if point == "record_not_written":
    fired = _crash_before_record(monkeypatch)
  else:
    fired = _crash_on_append(monkeypatch, point.split("_")[0])
  with pytest.raises(Crash):
    decoy_records.write(study, directory, config, 0, "none", predictions, 1.0)
  monkeypatch.undo()
  (left,) = fired
  logged = rundir.logged_files(study)
  # The state the crash left: the file is there, and logged only where it was logged first.
  assert os.path.exists(os.path.join(study, left))
  assert (left in logged) == (point == "record_not_written")
  assert decoy_records.missing(study, config, 0, "none") == decoy_records.names(config)
  again = decoy_records.write(study, directory, config, 0, "none", predictions, 1.0)
  assert [r.prediction_sha256 for r in again] == [r.prediction_sha256 for r in written]
  assert decoy_records.missing(study, config, 0, "none") == []
  events = [e["event"] for e in rundir.log(study).entries()]
  removed = [e["type"] for e in events if e.get("file") == left and e["type"] in rundir.REMOVALS]
  # Predictions without a logged record are an orphan; a record the log lacks, unlogged.
  assert removed == ["discard_unlogged" if point == "record_unlogged" else "discard_orphan"]
  rundir.finalize(study)
  assert rundir.verify(study) == []
