"""The sweep's study directory: the driver's writes, and which cells are finished.

    WORKDIR/study/  protocol.json  protocols/<e_hash>.json  inputs/  log.jsonl
                    predictions/<cell_id>__<attack>.npy  records/<cell_id>__<attack>.json
                    cells/<cell_id>.json     (written last: the cell is finished)

Only the driver writes here, holding the study's lock from its first check to the seal. A
cell's predictions and records are written create-if-absent (a second write of the same
file raises), then its cell file, which lists their hashes; each write is logged after it.
`cells/` is one of the logged directories (lla.evidence.rundir.LOGGED_DIRS): verify checks
every cell file against the log, and finalize discards one the log does not hold. On
resume a cell is skipped once its cell file is in the log with its bytes, its config
hashes to its id and every file it lists has the listed hash; a cell without a logged
cell file (the driver stopped mid-cell, or between writing the cell file and logging it)
has its files removed, logged, and runs again.
"""

from __future__ import annotations

import os

from lla.attacks import registry
from lla.replay import driver as replay
from lla.evidence import files, rundir
from lla.evidence.records import AttackRecord
from lla.scoring.policy import load_policy
from lla.sweep import cells as cells_lib

CELLS = rundir.CELLS
SCHEMA = "lla.sweep_cell.v1"


class StudyError(ValueError):
  """A study directory that cannot be resumed safely; names the file."""


def open_study(study: str, policy: str, name: str) -> None:
  """Creates the study directory (a lla.evidence study) unless it exists."""
  if rundir.started(study):  # a create interrupted before its log entry: redone
    if not rundir.is_study(study):
      raise StudyError(f"{study}: a run directory, not a study: use a new --workdir")
    os.makedirs(os.path.join(study, CELLS), exist_ok=True)
    return
  loaded = load_policy(policy)
  rundir.create_study(study, {"G": {"policy": loaded.policy_id, "policy_sha256": loaded.sha256},
                              "sweep": name})
  replay.record_threat_space(study)
  os.makedirs(os.path.join(study, CELLS), exist_ok=True)


def cell_path(study: str, cell_id: str) -> str:
  return os.path.join(study, CELLS, f"{cell_id}.json")


def finished(study: str, cell: cells_lib.Cell) -> dict | None:
  """The cell file of a finished cell, verified, or None.

  Raises:
    StudyError: the cell file, or a file it lists, changed since it was written, or one of
      its records was made by another revision of its attack than the registered one
      (never resumed over).
  """
  path = cell_path(study, cell.cell_id)
  if not os.path.exists(path):
    return None
  logged = rundir.logged_files(study).get(f"{CELLS}/{cell.cell_id}.json")
  if logged is None:
    return None  # Written, never logged: `discard_orphans` removes it and the cell reruns.
  if logged[0] != files.sha256_file(path):
    raise StudyError(f"{path}: differs from the sha256 the study's log recorded (line "
                     f"{logged[1]}); refusing to resume over it: run verify")
  stored = files.read_json(path)
  if cells_lib.cell_id(stored["config"]) != cell.cell_id or stored["config"] != cell.config:
    raise StudyError(f"{path}: its config does not hash to {cell.cell_id}; refusing to resume")
  for entry in stored["attacks"]:
    for rel, sha in ((entry["record"], entry["record_sha256"]),
                     (entry["predictions"], entry["prediction_sha256"])):
      if rel is None:
        continue
      full = os.path.join(study, rel)
      if not os.path.exists(full) or files.sha256_file(full) != sha:
        raise StudyError(f"{full}: missing or changed since {path} was written; refusing to "
                         "resume over it")
    if entry["record"] is not None:
      record = AttackRecord.load(os.path.join(study, entry["record"]))
      if record.attack in registry.names():
        revision = registry.get(record.attack).spec.revision
        if record.attack_revision != revision:
          raise StudyError(f"{path}: {record.attack} ran at revision {record.attack_revision}, "
                           f"the registered one is revision {revision}; refusing to resume "
                           "over it")
  return stored


def discard_orphans(study: str, cell: cells_lib.Cell) -> None:
  """Removes (and logs) files of an unfinished cell: the driver stopped mid-cell. Its cell
  file, if one is there, was never logged (`finished`), and goes first: until every file
  of the cell is gone the cell stays unfinished."""
  rel = f"{CELLS}/{cell.cell_id}.json"
  if os.path.exists(os.path.join(study, rel)):
    rundir.remove_file(study, rel, "discard_unlogged", cell=cell.cell_id)
  for sub, suffix in ((rundir.PREDICTIONS, ".npy"), (rundir.RECORDS, ".json")):
    directory = os.path.join(study, sub)
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
      if name.startswith(f"{cell.cell_id}__") and name.endswith(suffix):
        rundir.remove_file(study, f"{sub}/{name}", "discard_orphan", cell=cell.cell_id)


def write_cell(study: str, cell: cells_lib.Cell, result) -> dict:
  """Writes one cell's results (a worker.CellResult) and then its cell file; returns it.

  Raises FileExistsError if any of its files exists already: a cell is written once.
  """
  if result.cell_id != cell.cell_id or result.config != cell.config:
    raise StudyError(f"cell {cell.cell_id}: the worker returned another cell's results")
  e_hash = rundir.add_protocol(study, result.e)
  if e_hash != result.e_hash:
    raise StudyError(f"cell {cell.cell_id}: E hashes to {e_hash[:12]}..., the worker said "
                     f"{result.e_hash[:12]}...")
  attacker = replay.Attacker(None, None, result.pinned["attacker_params_sha256"],
                             result.calibration, result.config["knowledge"],
                             result.pinned["attacker_source"])
  replay.pin_inputs(study, e_hash, attacker, result.pinned["calibration_defense"])
  # The registry the driver runs with (its plugins loaded), merged into the study's.
  replay.record_threat_space(study)
  entries = []
  for attack in result.attacks:
    record = AttackRecord.from_json(attack["record"])
    prediction_rel = prediction_sha = None
    if attack["predictions"] is not None:
      prediction_rel, prediction_sha = rundir.save_predictions(study, attack["file"],
                                                               attack["predictions"])
      if prediction_sha != record.prediction_sha256:
        raise StudyError(f"{prediction_rel}: sha256 differs from its record's")
    record_rel = rundir.save_record(study, attack["file"], record)
    entries.append({"attack": attack["name"], "run_id": record.run_id, "status": record.status,
                    "record": record_rel, "record_sha256": files.sha256_bytes(record.to_json()),
                    "predictions": prediction_rel, "prediction_sha256": prediction_sha,
                    "flops": record.flops})
  stored = {"schema": SCHEMA, "cell_id": cell.cell_id, "group": cell.group,
            "config": cell.config, "e_hash": e_hash, "attacks": entries,
            "worker": result.worker, "wall_s": result.wall_s}
  rundir.save_file(study, f"{CELLS}/{cell.cell_id}.json", files.canonical_json(stored), "cell",
                   cell=cell.cell_id)
  return stored
