"""Decoy-row results as attack records of a study (docs/run_format.md, "Decoy-row records").

Each (seed, mitigation arm) capture gives one record per module of lla.decoy.modules:
  decoy_structural   predictions [S, M] int32, 1 = "real row", against the capture's
                     `structural` view (the true row mask). Token recovery is the row
                     agreement, exact-document recovery the fraction of frames whose
                     mask is exact, and the baseline token 0 ("every row is a decoy", the
                     majority class) makes p0 the decoy share of the rows.
  decoy_norm         the same, for the rows of largest returned-gradient norm.
  decoy_content_*    predictions [S_test, R] int32, each held-out frame's real rows in
                     wire order, against the capture's `content` view (their label
                     tokens): token recovery is the probe's accuracy, exact-document
                     recovery the frames (32-token blocks) recovered whole, and the
                     baseline token the training half's most frequent token (the
                     constant predictor the decoy gate compares with).
So the scorer's numbers are the decoy experiment's own (row agreement, probe accuracy,
baseline accuracy), recomputed from predictions and truth alone. Records name the defense
`decoy_rows` (parameters: the arm), knowledge `trained` (the cloud holds no client weights
beyond the public initialisation), the decoy seed as model_seed, and no reference: the
decoy experiment's positive control is its own leak-injection calibration.
"""

from __future__ import annotations

import os
import time

from lla import provenance
from lla.decoy import capture, modules
from lla.evidence import rundir
from lla.evidence.records import AttackRecord

DEFENSE = "decoy_rows"


def run_id(seed: int, arm: str, attack: str) -> str:
  return f"decoy/{arm}/m{seed}/{attack}"


def file_name(seed: int, arm: str, attack: str) -> str:
  return run_id(seed, arm, attack).replace("/", "__")


def names(config) -> list[str]:
  """The modules recorded for each capture under `config` (its probe's classifiers)."""
  return [modules.STRUCTURAL, modules.NORM] + [
      modules.content_name(f, c) for f in modules.FEATURE_OBSERVATIONS
      for c in config.probe.classifiers]


def missing(study: str, config, seed: int, arm: str) -> list[str]:
  """Modules of (seed, arm) whose record the study's log does not hold yet (a record file
  written but never logged is not there: `write` discards it and writes it again)."""
  logged = rundir.logged_files(study)
  return [a for a in names(config)
          if f"{rundir.RECORDS}/{file_name(seed, arm, a)}.json" not in logged]


def defense_params(config, arm: str) -> dict:
  p = config.protocol
  params = {"mitigation": arm, "n_real": p.n_real, "n_decoy": p.n_decoy, "width": p.width,
            "pool_size": p.pool_size}
  if arm == "mitigated":
    params.update(grad_clip=config.mitigation.grad_clip, grad_noise=config.mitigation.grad_noise)
  return params


def write(study: str, directory: str, config, seed: int, arm: str, predictions: dict,
          wall_s: float) -> list[AttackRecord]:
  """Writes the predictions and records of one capture's attacks into `study` (skipping
  those already there); returns every record of the capture.

  Resumable at every write: a record is reused only where the log holds it and its
  predictions (lla.evidence.rundir.finished_record); a record or predictions left by an
  interruption between a write and its log entry are discarded (logged) and written again.

  Args:
    directory: the capture (lla.decoy.capture, with its scored views).
    predictions: lla.decoy.run.analyse's: "structural" and "norm" ([S, M] int32 row
      masks), "content" ({"<features>/<classifier>": [S_test, R] int32 predicted tokens})
      and "content_baseline" (the training half's most frequent token).
  """
  _, _, metadata, sha = capture.read(directory)
  for view in capture.VIEWS:
    if not os.path.exists(os.path.join(directory, capture.view_file(view))):
      raise ValueError(f"{directory}: capture has no scored view {view!r} (made by an older "
                       "version); use a fresh --workdir")
  e_hash = rundir.add_protocol(study, metadata["protocol"])
  if e_hash != metadata["e_hash"]:
    raise ValueError(f"{directory}: metadata e_hash does not hash its protocol tuple")
  capture_rel = os.path.relpath(directory, study)
  common = dict(
      status="ok", error=None, e_hash=e_hash, capture_dir=capture_rel, capture_sha256=sha,
      scored_positions="all", model_id=metadata["model_id"], model_seed=int(seed),
      cut=int(config.model.cut), knowledge="trained", corpus=str(config.data.source),
      defense=DEFENSE, defense_params=defense_params(config, arm), reference=None,
      seed=int(seed), flops=None, flops_source=None, flops_analytic=None,
      compile_s=None, stages={}, provenance=provenance.current())
  jobs = [(modules.STRUCTURAL, modules.STRUCTURAL_FAMILY, predictions["structural"], 0,
           "structural", {}),
          (modules.NORM, modules.STRUCTURAL_FAMILY, predictions["norm"], 0, "structural",
           {"n_real": int(config.protocol.n_real)})]
  probe = {k: config.probe[k] for k in ("steps", "batch", "lr", "max_classes", "mlp_hidden")}
  for arm_key, tokens in sorted(predictions["content"].items()):
    features, classifier = arm_key.split("/")
    jobs.append((modules.content_name(features, classifier), modules.CONTENT_FAMILY,
                 tokens, predictions["content_baseline"], "content",
                 {**probe, "label": config.probe.label}))
  out = []
  for attack, family, predicted, baseline, view, budget in jobs:
    name = file_name(seed, arm, attack)
    finished = rundir.finished_record(study, name)
    if finished is not None:
      out.append(finished)
      continue
    start = time.perf_counter()
    rel, pred_sha = rundir.save_predictions(study, name, predicted)
    record = AttackRecord(
        run_id=run_id(seed, arm, attack), attack=attack, family=family,
        truth_file=os.path.join(capture_rel, capture.view_file(view)),
        prediction_file=rel, prediction_sha256=pred_sha, baseline_token=int(baseline),
        budget=budget, wall_s=wall_s + time.perf_counter() - start,
        details={"scored_view": view,
                 "wall_s": "the analysis of the whole capture (all its modules)"}, **common)
    rundir.save_record(study, name, record)
    out.append(record)
  return out
