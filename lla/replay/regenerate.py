"""Regenerate a run's predictions from its pinned inputs and compare them bit for bit.

For every measured record: the capture it names (hash-checked), the attacker's weights
loaded from the source pinned in `inputs/<e_hash>.json` (hash-checked), the pinned
calibration tokens, the budget of its protocol tuple and its seed. PROTOCOL section 3:
the same capture, E and seeds give identical predictions, on the same software stack and
device kind: every difference between a record's provenance (lla.provenance) and this
process's, and between the attack revision that made it and the registered one
(AttackSpec.revision), is named beside the verdict. Records made outside replay (modules
that run in their own driver, such as the decoy-row experiment) are listed as not
regenerated here.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import ml_collections
import numpy as np

from lla.attacks import budget as budget_lib
from lla import provenance as provenance_lib
from lla.attacks import registry
from lla.replay import driver as replay
from lla.attacks.workspace import Workspace
from lla.capture import store
from lla.defenses import aware
from lla.evidence import files, records, rundir
from lla.model.loading import load_model


class RegenerationError(ValueError):
  """The run cannot be regenerated as stored: an input changed, or today's module declares
  what the run's protocol does not hold."""


def _protocol(run_dir: str, e_hash: str) -> dict:
  if rundir.is_study(run_dir):
    return files.read_json(os.path.join(run_dir, rundir.PROTOCOLS, f"{e_hash}.json"))
  return files.read_json(os.path.join(run_dir, rundir.PROTOCOL))


def _workspace(run_dir: str, record, e: dict, memory_budget_bytes: int) -> Workspace:
  inputs = files.read_json(os.path.join(run_dir, replay.INPUTS, f"{record.e_hash}.json"))
  model = load_model(ml_collections.ConfigDict(inputs["attacker_source"]))
  if model.model_id != inputs["attacker_params_sha256"]:
    raise RegenerationError(f"{inputs['attacker_source']}: attacker weights hash {model.model_id[:12]}... "
                     f"differ from the pinned {inputs['attacker_params_sha256'][:12]}...")
  calibration = files.load_token_matrix(
      os.path.join(run_dir, records.inside("calibration_file", inputs["calibration_file"])),
      "calibration tokens")
  if files.sha256_bytes(np.ascontiguousarray(calibration, np.int32).tobytes()) != \
      inputs["calibration_sha256"]:
    raise RegenerationError(f"{inputs['calibration_file']}: calibration tokens changed")
  capture = store.load_capture(rundir.resolve(run_dir, record.capture_dir))
  if capture.manifest_sha256 != record.capture_sha256:
    raise RegenerationError(f"{record.capture_dir}: capture differs from the one record "
                     f"{record.run_id!r} was made from")
  mimic = inputs.get("calibration_defense")
  ws = Workspace(capture.activations, capture.gradients, model.params, model.cfg,
                 int(e["T"]["cut"]), calibration,
                 ridge_alpha=float(e["B"]["fields"]["ridge_alpha"]),
                 memory_budget_bytes=memory_budget_bytes, mesh=None,
                 calibration_transform=None if mimic is None
                 else aware.calibration_transform(**mimic),
                 batch_docs=replay.batch_docs(capture.metadata),
                 defense={"name": e["T"]["defense"], "params": dict(e["T"]["defense_params"] or {})},
                 capture_files=store.attack_files(capture),
                 capture_info=store.attack_metadata(capture),
                 known_prefix=replay.known_prefix(capture.metadata),
                 knowledge=e["K"]["weights"])
  return ws


@dataclasses.dataclass(frozen=True)
class Regeneration:
  """problems: predictions that differ (empty: bit for bit); regenerated: the run_ids
  recomputed; skipped: 'run_id: why' of measured records not regenerated here (a sample
  leaves the rest out without listing them); provenance: 'field: recorded X, now Y' for
  every difference between the records' provenance and this process's, and each attack
  whose records were made by another revision of it."""
  problems: list[str]
  regenerated: list[str]
  skipped: list[str]
  provenance: list[str]


def check(run_dir: str, memory_budget_bytes: int = 1 << 30,
          per_attack: int | None = None) -> Regeneration:
  """Recomputes measured records' predictions and compares them bit for bit.

  Args:
    run_dir: a run or study directory.
    memory_budget_bytes: the attacks' working-set budget (as at replay).
    per_attack: regenerate only the first `per_attack` measured records of each module,
      in the order they were logged (a spot check costing a fraction of the run); None
      regenerates every one.
  """
  if per_attack is not None and per_attack < 1:
    raise ValueError(f"per_attack {per_attack}: expected at least 1 record per module")
  # Keyed by capture too: one protocol tuple may be replayed on several captures of it.
  problems, regenerated, skipped, workspaces, differences = [], [], [], {}, {}
  taken = {}
  now = provenance_lib.current()
  for record in rundir.load_records(run_dir):
    if record.status != "ok":
      continue
    taken[record.attack] = taken.get(record.attack, 0) + 1
    if per_attack is not None and taken[record.attack] > per_attack:
      continue
    if record.attack not in registry.names():
      skipped.append(f"{record.run_id}: module {record.attack!r} is not a replay attack "
                     "(it runs in its own driver)")
      continue
    for line in provenance_lib.differences(record.provenance, now):
      differences.setdefault(line, record.run_id)
    e = _protocol(run_dir, record.e_hash)
    attack = registry.get(record.attack)
    if record.attack_revision != attack.spec.revision:
      differences.setdefault(f"{record.attack} revision: recorded {record.attack_revision}, "
                             f"now {attack.spec.revision}", record.run_id)
    missing = sorted(set(attack.spec.budget_fields) - set(e["B"]["fields"]))
    if missing:
      raise RegenerationError(
          f"record {record.run_id!r}: module {record.attack!r} now declares budget "
          f"field(s) {', '.join(missing)} that its protocol {record.e_hash[:12]} does not "
          "hold (the run predates them): regenerate it with the lla version that made it")
    key = (record.e_hash, record.capture_sha256)
    if key not in workspaces:
      workspaces[key] = _workspace(run_dir, record, e, memory_budget_bytes)
    view = budget_lib.View(e["B"]["fields"], attack.spec.budget_fields, record.attack)
    ws = workspaces[key]
    with ws.attack_scope(record.attack):
      result = attack(ws, view, jax.random.key(record.seed))
    stored = rundir.load_predictions(rundir.resolve(run_dir, record.prediction_file))
    regenerated.append(record.run_id)
    if not np.array_equal(result.predictions, stored):
      differ = int((result.predictions != stored).sum())
      problems.append(f"{record.prediction_file}: regenerated predictions differ in {differ} "
                      f"of {stored.size} tokens (record {record.run_id!r})")
  return Regeneration(problems, regenerated, skipped,
                      [f"{line} (first in record {run_id!r})"
                       for line, run_id in sorted(differences.items())])


def regenerate(run_dir: str, memory_budget_bytes: int = 1 << 30) -> list[str]:
  """Recomputes every measured record's predictions; returns mismatches (empty if all equal)."""
  return check(run_dir, memory_budget_bytes).problems
