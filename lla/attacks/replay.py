"""Replay: run registered attacks on a stored capture and write a run directory.

Every attack is checked against the capture before anything runs, so an incompatible
request fails without touching the run directory. Each finished attack's predictions and
record are written atomically and logged; a replay interrupted and started again on the
same run directory reuses them (verified by hash) and runs only the rest.
"""

from __future__ import annotations

import dataclasses
import io
import os
import subprocess
import time
import traceback

import jax
import ml_collections
import numpy as np
from absl import logging

import lla
from lla.attacks import registry
from lla.attacks.workspace import Workspace, document_mesh
from lla.capture import store
from lla.defenses import aware
from lla.evidence import files, rundir
from lla.protocol import tuple as protocol
from lla.scoring.policy import load_policy
from lla.scoring.records import AttackRecord


@dataclasses.dataclass(frozen=True)
class Attacker:
  """The attacker's side: its copy of the model and its public calibration documents."""

  params: dict
  cfg: object
  model_id: str
  calibration_tokens: np.ndarray  # [N, T] int32
  knowledge: str                  # "public" or "trained"
  source: dict                    # how to load the weights again (lla.model.loading)


def provenance() -> dict:
  try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(lla.__file__), timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    commit = ""
  device = jax.devices()[0]
  return {"lla_version": lla.__version__, "git_commit": commit or "unknown",
          "jax_version": jax.__version__, "device_kind": device.device_kind,
          "device_count": jax.device_count()}


def replay_protocol(capture: store.Capture, attacker: Attacker, budget, seed: int,
                    calibration_defense: dict | None = None) -> dict:
  """E of the replay: the capture's target, observations and corpus, the attacker's K and B."""
  captured = protocol.ProtocolTuple.from_dict(capture.metadata["protocol"])
  e = captured.replace(
      K=protocol.Knowledge(attacker.knowledge, weights_sha256=attacker.model_id,
                           mechanism=protocol.frozen(calibration_defense or {})),
      B=protocol.Budgets(calibration_size=int(attacker.calibration_tokens.shape[0]),
                         candidates=int(budget.candidates), beam_width=int(budget.beam_width),
                         c_a=int(budget.c_a), c_g=int(budget.c_g),
                         ridge_alpha=float(budget.ridge_alpha),
                         shuffle_seed=int(budget.shuffle_seed)),
      G=dataclasses.replace(captured.G, seeds=(int(seed),),
                            policy_sha256=load_policy(captured.G.policy).sha256))
  return e.to_dict()


def _register_protocol(run_dir: str, e: dict) -> str:
  """Adds E to a study directory, or creates / checks a single-protocol run directory."""
  protocol_path = os.path.join(run_dir, rundir.PROTOCOL)
  if rundir.is_study(run_dir):
    return rundir.add_protocol(run_dir, e)
  if os.path.exists(protocol_path):
    if files.read_json(protocol_path) != e:
      raise ValueError(f"{protocol_path}: this run directory belongs to another protocol tuple; "
                       "use a new --workdir")
    return rundir.e_hash(e)
  return rundir.create(run_dir, e)


INPUTS = "inputs"


def pin_inputs(run_dir: str, e_hash: str, attacker: Attacker,
               calibration_defense: dict | None) -> None:
  """Stores what regenerating E's predictions needs besides the capture: where the
  attacker's weights load from (checked by hash) and the calibration tokens themselves."""
  path = os.path.join(run_dir, INPUTS, f"{e_hash}.json")
  if os.path.exists(path):
    return
  os.makedirs(os.path.join(run_dir, INPUTS), exist_ok=True)
  tokens = np.ascontiguousarray(attacker.calibration_tokens, np.int32)
  calibration_sha = files.sha256_bytes(tokens.tobytes())
  calibration = f"{INPUTS}/calibration_{calibration_sha[:16]}.npy"
  if not os.path.exists(os.path.join(run_dir, calibration)):
    buffer = io.BytesIO()
    np.save(buffer, tokens, allow_pickle=False)
    files.atomic_write_bytes(os.path.join(run_dir, calibration), buffer.getvalue())
  files.atomic_write_json(path, {"attacker_source": dict(attacker.source),
                                 "attacker_params_sha256": attacker.model_id,
                                 "calibration_file": calibration,
                                 "calibration_sha256": calibration_sha,
                                 "calibration_defense": calibration_defense})
  rundir.log(run_dir).append({"type": "inputs", "e_hash": e_hash, "file": f"{INPUTS}/{e_hash}.json"})


def file_name(run_id: str) -> str:
  """A run_id as a file name: 'k6/public/m0/joint' -> 'k6__public__m0__joint'."""
  return run_id.replace("/", "__")


def _finished(run_dir: str, name: str) -> AttackRecord | None:
  """The stored record of `name` if it finished and its predictions are intact.

  A crashed attack's record, or predictions whose record was never written (an
  interruption between the two writes), are not results: they are removed, logged, and
  the attack runs again.
  """
  path = os.path.join(run_dir, rundir.RECORDS, f"{name}.json")
  predictions = os.path.join(run_dir, rundir.PREDICTIONS, f"{name}.npy")
  if os.path.exists(path):
    record = AttackRecord.load(path)
    if record.status == "ok":
      stored = rundir.resolve(run_dir, record.prediction_file)
      if not os.path.exists(stored) or files.sha256_file(stored) != record.prediction_sha256:
        raise ValueError(f"{stored}: predictions missing or changed since {path} was written; "
                         "refusing to resume over them")
      return record
    os.remove(path)
    rundir.log(run_dir).append({"type": "retry", "attack": name, "previous_status": record.status})
  if os.path.exists(predictions):
    os.remove(predictions)
    rundir.log(run_dir).append({"type": "discard_orphan", "file": f"{rundir.PREDICTIONS}/{name}.npy"})
  return None


def replay(run_dir: str, capture_dir: str, attacker: Attacker, attacks: list[str],
           budget: ml_collections.ConfigDict, seed: int, *, run_prefix: str = "",
           reference_prefix: str | None = None, model_seed: int = 0,
           memory_budget_bytes: int = 2 << 30, mesh="auto",
           calibration_defense: dict | None = None) -> list[AttackRecord]:
  """Runs `attacks` on the capture at `capture_dir`; returns their records.

  Args:
    run_dir: run directory (created, or resumed if its protocol.json matches), or a study
      directory (`rundir.create_study`) that collects several protocol tuples.
    attacks: registered attack names.
    budget: candidates, beam_width, c_a, c_g, ridge_alpha, shuffle_seed.
    seed: the attack seed (random-candidate control).
    run_prefix: prefix of each record's run_id (e.g. "k6/public/model0/").
    reference_prefix: for defended captures, the run_id prefix of the linked undefended
      reference: each attack links `reference_prefix + attack`.
    mesh: a document mesh, None for one device, or "auto" (every local device).
    calibration_defense: {"name", "params", "attacker_seed"} of the defense a
      defense-aware attacker mimics on its calibration data (lla.defenses.aware); for
      defense-aware attacks, and only those.
  """
  calibration_transform = None if calibration_defense is None else \
      aware.calibration_transform(**calibration_defense)
  capture = store.load_capture(capture_dir)
  specs = [registry.get(name).spec for name in attacks]
  for spec in specs:
    registry.check_compatible(spec, capture.observations, attacker.knowledge,
                              capture_name=f"capture {capture_dir}")
    if spec.defense_aware != (calibration_defense is not None):
      raise registry.IncompatibleCaptureError(
          f"attack {spec.name!r} is {'' if spec.defense_aware else 'not '}defense-aware: it "
          f"{'needs' if spec.defense_aware else 'must not get'} a calibration defense")
  target_meta = capture.metadata["protocol"]["T"]
  if attacker.calibration_tokens.shape[1] != capture.activations.shape[1]:
    raise ValueError(f"calibration documents have T={attacker.calibration_tokens.shape[1]}, "
                     f"capture {capture_dir} has T={capture.activations.shape[1]}")
  if attacker.cfg.n_embd != capture.activations.shape[-1]:
    raise ValueError(f"attacker model has d={attacker.cfg.n_embd}, capture {capture_dir} has "
                     f"d={capture.activations.shape[-1]}")

  e = replay_protocol(capture, attacker, budget, seed, calibration_defense)
  e_hash = _register_protocol(run_dir, e)
  pin_inputs(run_dir, e_hash, attacker, calibration_defense)
  ws = Workspace(capture.activations, capture.gradients, attacker.params, attacker.cfg,
                 int(target_meta["cut"]), np.asarray(attacker.calibration_tokens, np.int32),
                 ridge_alpha=float(budget.ridge_alpha), memory_budget_bytes=memory_budget_bytes,
                 mesh=document_mesh() if mesh == "auto" else mesh,
                 calibration_transform=calibration_transform)
  truth_file = os.path.relpath(os.path.join(capture.directory, store.TRUTH_FILE), run_dir)
  common = dict(
      e_hash=e_hash, capture_dir=os.path.relpath(capture.directory, run_dir),
      capture_sha256=capture.manifest_sha256, truth_file=truth_file,
      model_id=str(target_meta["model_id"]), model_seed=int(model_seed), cut=ws.cut,
      knowledge=attacker.knowledge, corpus=capture.metadata["protocol"]["C"]["name"],
      defense=str(target_meta["defense"]), defense_params=dict(target_meta["defense_params"] or {}),
      seed=int(seed), provenance=provenance())
  records = []
  for spec in specs:
    done = _finished(run_dir, file_name(run_prefix + spec.name))
    if done is not None:
      logging.info("replay: %s already finished (%s), reused", spec.name, done.prediction_sha256[:12])
      records.append(done)
      continue
    reference = None if reference_prefix is None else (
        reference_prefix + (spec.reference_attack or spec.name))
    records.append(_run_one(run_dir, ws, spec, budget, seed, run_prefix,
                            {**common, "reference": reference}))
  return records


def _run_one(run_dir, ws, spec, budget, seed, run_prefix, common) -> AttackRecord:
  budget_used = {f: budget[f] for f in spec.budget_fields}
  start = time.perf_counter()
  try:
    result = registry.get(spec.name)(ws, budget, jax.random.key(seed))
  except Exception as e:  # A crashed module is recorded as unmeasured, never as a failed attack.
    logging.error("attack %s crashed:\n%s", spec.name, traceback.format_exc())
    record = AttackRecord(
        run_id=run_prefix + spec.name, attack=spec.name, family=spec.family, status="crashed",
        error=f"{type(e).__name__}: {e}", prediction_file=None, prediction_sha256=None,
        scored_positions=spec.scored_positions, baseline_token=ws.baseline_token,
        budget=budget_used, flops=None, flops_source=None, wall_s=time.perf_counter() - start,
        **common)
    rundir.save_record(run_dir, file_name(record.run_id), record)
    return record
  wall = time.perf_counter() - start
  rel, sha = rundir.save_predictions(run_dir, file_name(run_prefix + spec.name),
                                     result.predictions)
  record = AttackRecord(
      run_id=run_prefix + spec.name, attack=spec.name, family=spec.family, status="ok",
      error=None, prediction_file=rel, prediction_sha256=sha,
      scored_positions=spec.scored_positions, baseline_token=ws.baseline_token,
      budget={**budget_used, "flops_analytic": result.flops_analytic}, flops=result.flops,
      flops_source=result.flops_source, wall_s=wall, **common)
  rundir.save_record(run_dir, file_name(record.run_id), record)
  logging.info("replay: %s done in %.1fs, %.3g FLOPs (%s)", spec.name, wall, result.flops,
               result.flops_source)
  return record
