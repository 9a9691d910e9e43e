"""Replay: run registered attacks on a stored capture and write a run directory.

Everything a replay needs is checked before anything is written: the capture (manifest,
shapes, finiteness), each attack against the capture and the attacker (observations,
knowledge, the defense an adaptive attack adapts to), the budget (every field in range;
a changed field that no requested attack reads is refused) and the calibration tokens
(shape, ids in [0, V)). A bad input is a one-line error and the run directory is left
as it was; a "crashed" record is reserved for a real failure inside an attack.

The replay's protocol tuple E covers every input: the capture's manifest hash (O), the
attacker's weights and calibration tokens (K, by sha256), every budget field (B) and the
policy (G). A finished attack is reused only when its record was made under the same E
and capture; otherwise the replay is refused, naming what differs. Each finished attack's
predictions and record are written atomically and logged, so an interrupted replay run
again on the same directory runs only the rest.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import dataclasses
import io
import json
import os
import traceback

import jax
import ml_collections
import numpy as np
from absl import logging

from lla import dist
from lla import provenance as provenance_lib
from lla import runtime
from lla.attacks import budget as budget_lib
from lla.attacks import registry
from lla.attacks.workspace import LAYER_FORMS, Workspace, document_mesh, spans_processes
from lla.capture import store
from lla.defenses import aware
from lla.evidence import files, rundir
from lla.evidence.records import AttackRecord
from lla.model.loading import load_model
from lla.protocol import tuple as protocol
from lla.scoring import threat_space
from lla.scoring.policy import load_named_policy

INPUTS = rundir.INPUTS


class ReplayInputError(ValueError):
  """An input of a replay that can be checked before anything runs; names the problem."""


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
  """What every record stores of the software and devices (lla.provenance)."""
  return provenance_lib.current()


def calibration_sha256(tokens: np.ndarray) -> str:
  return files.sha256_bytes(np.ascontiguousarray(tokens, np.int32).tobytes())


def check_calibration(tokens, vocab_size: int, seq_len: int) -> np.ndarray:
  """The calibration tokens as int32 [N, T], or ReplayInputError naming what is wrong."""
  tokens = np.asarray(tokens)
  if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer) or tokens.shape[0] < 1:
    raise ReplayInputError(f"calibration tokens must be a non-empty [N, T] integer array, got "
                           f"{tokens.dtype}{list(tokens.shape)}")
  if tokens.shape[1] != seq_len:
    raise ReplayInputError(f"calibration documents have T={tokens.shape[1]}, the capture has "
                           f"T={seq_len}")
  low, high = int(tokens.min()), int(tokens.max())
  if low < 0 or high >= vocab_size:
    raise ReplayInputError(f"calibration token ids must lie in [0, {vocab_size}), got "
                           f"[{low}, {high}]")
  return tokens.astype(np.int32)


def replay_protocol(capture: store.Capture, attacker: Attacker, budget_values: dict, seed: int,
                    calibration_defense: dict | None = None) -> dict:
  """E of the replay: the capture's target, observations and corpus, the attacker's K and B."""
  captured = protocol.ProtocolTuple.from_dict(capture.metadata["protocol"])
  try:
    policy = load_named_policy(captured.G.policy)
  except (ValueError, FileNotFoundError) as e:
    raise ReplayInputError(f"capture {capture.directory}: metadata.json G.policy: {e}") from None
  e = captured.replace(
      O=dataclasses.replace(captured.O, capture_sha256=capture.manifest_sha256),
      K=protocol.Knowledge(attacker.knowledge, weights_sha256=attacker.model_id,
                           calibration_sha256=calibration_sha256(attacker.calibration_tokens),
                           mechanism=protocol.frozen(calibration_defense or {})),
      B=protocol.Budgets(calibration_size=int(attacker.calibration_tokens.shape[0]),
                         fields=protocol.frozen(budget_values)),
      G=dataclasses.replace(captured.G, seeds=(int(seed),),
                            policy_sha256=policy.sha256))
  return e.to_dict()


def differences(old: dict, new: dict, path: str = "") -> list[str]:
  """The paths at which two protocol tuples differ, e.g. ['K.calibration_sha256']."""
  if isinstance(old, dict) and isinstance(new, dict):
    out = []
    for key in sorted(set(old) | set(new)):
      out += differences(old.get(key), new.get(key), f"{path}.{key}" if path else key)
    return out
  return [] if old == new else [path]


def check_workdir(run_dir: str, capture_dir: str | None = None) -> None:
  """Refuses (before anything is written) a run directory that is not one: a capture
  directory (or the capture being replayed), a file, or a directory of other files."""
  if capture_dir is not None and os.path.realpath(run_dir) == os.path.realpath(capture_dir):
    raise ReplayInputError(f"--workdir={run_dir} is the capture being replayed; the run "
                           "directory must be another (new) directory")
  if rundir.is_run_dir(run_dir):
    return
  if os.path.exists(os.path.join(run_dir, store.METADATA_FILE)) or \
      os.path.exists(os.path.join(run_dir, store.MESSAGES_FILE)):
    raise ReplayInputError(f"--workdir={run_dir} is a capture directory, not a run directory; "
                           "give a new directory (or a run) as --workdir")
  kind = ("a directory of other files (no log.jsonl)" if os.path.isdir(run_dir)
          else "not a directory")
  raise ReplayInputError(f"--workdir={run_dir} is {kind}, not a run directory; give a new "
                         "directory (or a run) as --workdir")


def _check_protocol(run_dir: str, e: dict) -> None:
  """Refuses (before anything is written) a single-protocol run directory made under
  another E (a protocol.json the log does not hold is a leftover of an interrupted
  `rundir.create`, taken over by `_register_protocol`)."""
  protocol_path = os.path.join(run_dir, rundir.PROTOCOL)
  if rundir.started(run_dir) and not rundir.is_study(run_dir):
    stored = files.read_json(protocol_path)
    if stored != e:
      raise ReplayInputError(
          f"{run_dir} was made under another protocol tuple (differs in "
          f"{', '.join(differences(stored, e))}); use a new --workdir")


def _register_protocol(run_dir: str, e: dict) -> str:
  """Adds E to a study directory, or creates / checks a single-protocol run directory."""
  protocol_path = os.path.join(run_dir, rundir.PROTOCOL)
  if rundir.started(run_dir) and rundir.is_study(run_dir):
    return rundir.add_protocol(run_dir, e)
  if rundir.started(run_dir):
    stored = files.read_json(protocol_path)
    if stored != e:
      raise ReplayInputError(
          f"{run_dir} was made under another protocol tuple (differs in "
          f"{', '.join(differences(stored, e))}); use a new --workdir")
    return rundir.e_hash(e)
  return rundir.create(run_dir, e)


def _stored_protocol(run_dir: str, e_hash: str) -> dict | None:
  path = (os.path.join(run_dir, rundir.PROTOCOLS, f"{e_hash}.json") if rundir.is_study(run_dir)
          else os.path.join(run_dir, rundir.PROTOCOL))
  return files.read_json(path) if os.path.exists(path) else None


def pin_inputs(run_dir: str, e_hash: str, attacker: Attacker,
               calibration_defense: dict | None, check_only: bool = False) -> None:
  """Stores what regenerating E's predictions needs besides the capture: where the
  attacker's weights load from (checked by hash) and the calibration tokens themselves.
  With `check_only`, only refuses inputs that differ from those already pinned."""
  path = os.path.join(run_dir, INPUTS, f"{e_hash}.json")
  tokens = np.ascontiguousarray(attacker.calibration_tokens, np.int32)
  calibration_sha = calibration_sha256(tokens)
  calibration = f"{INPUTS}/calibration_{calibration_sha[:16]}.npy"
  pinned = {"attacker_source": dict(attacker.source),
            "attacker_params_sha256": attacker.model_id,
            "calibration_file": calibration,
            "calibration_sha256": calibration_sha,
            "calibration_defense": calibration_defense}
  logged = rundir.logged_files(run_dir)
  if f"{INPUTS}/{e_hash}.json" in logged:
    # Where the weights load from is a locator (the same weights may sit in several
    # checkpoints); what must agree is everything hashed.
    stored = {k: v for k, v in files.read_json(path).items() if k != "attacker_source"}
    mine = {k: v for k, v in pinned.items() if k != "attacker_source"}
    if stored != mine:
      raise ReplayInputError(f"{path}: pinned inputs differ from this replay's (in "
                             f"{', '.join(differences(stored, mine))})")
    return
  if check_only:
    return
  # A file here that the log does not hold (written, then interrupted before its entry) is
  # logged as recovered when its bytes are those re-derived below, else discarded and
  # written again (rundir.save_file).
  if calibration not in logged:
    buffer = io.BytesIO()
    np.save(buffer, tokens, allow_pickle=False)
    rundir.save_file(run_dir, calibration, buffer.getvalue(), "input_file")
  rundir.save_file(run_dir, f"{INPUTS}/{e_hash}.json", files.canonical_json(pinned), "inputs",
                   e_hash=e_hash)


def record_threat_space(run_dir: str) -> bool:
  """Records the attack modules registered in this process (built-in and plugins) as the
  run's threat space (lla.scoring.threat_space), merged with what it holds; returns
  whether the file changed. Whoever creates or extends a study calls this, so that scoring
  reads the modules from the study and never from the live registry."""
  return threat_space.record(run_dir, registry.module_entries())


def file_name(run_id: str) -> str:
  """A run_id as a file name: 'k6/public/m0/joint' -> 'k6__public__m0__joint'."""
  return run_id.replace("/", "__")


def _check_reuse(run_dir: str, name: str, spec, e: dict, e_hash: str,
                 capture_sha: str) -> None:
  """Refuses (before anything is written) a finished record of `name` that was made under
  another protocol tuple, from another capture or by another revision of its attack: it
  is never silently reused."""
  path = os.path.join(run_dir, rundir.RECORDS, f"{name}.json")
  if not os.path.exists(path) or f"{rundir.RECORDS}/{name}.json" not in rundir.logged_files(
      run_dir):
    return  # Absent, or never logged (discarded by `_finished`).
  record = AttackRecord.load(path)
  if record.status != "ok":
    return
  if record.capture_sha256 != capture_sha:
    raise ReplayInputError(f"{path} was made from another capture ({record.capture_dir}); "
                           "refusing to reuse it: use a new --workdir or run prefix")
  if record.e_hash != e_hash:
    old = _stored_protocol(run_dir, record.e_hash)
    what = "" if old is None else f" (differs in {', '.join(differences(old, e))})"
    raise ReplayInputError(f"{path} was made under another protocol tuple{what}; refusing "
                           "to reuse it: use a new --workdir or run prefix")
  if record.attack_revision != spec.revision:
    raise ReplayInputError(f"{path} was made by {spec.name} revision {record.attack_revision}, "
                           f"the registered {spec.name} is revision {spec.revision}; refusing "
                           "to reuse it: use a new --workdir or run prefix")


def _finished(run_dir: str, name: str, spec) -> AttackRecord | None:
  """The stored record of `name` if it finished, its predictions are intact and it was made
  by the attack's code as registered now.

  A crashed attack's record, or predictions whose record was never written (an
  interruption between the two writes), are not results: they are removed, logged, and
  the attack runs again. So is a record made by other code (another code identity,
  lla.attacks.registry.code_identity): the study's threat space lists today's, and a gate
  counts a record of other code as unmeasured (lla.scoring.gates.stale), so reusing it
  would leave the study unable to pass.
  """
  record = rundir.finished_record(run_dir, name)
  code = (registry.source(spec.name) or {}).get("sha256")
  if record is not None and record.attack_code_sha256 and code and (
      record.attack_code_sha256 != code):
    rundir.remove_file(run_dir, f"{rundir.RECORDS}/{name}.json", "retry", attack=name,
                       previous_status=record.status,
                       reason=f"made by code {record.attack_code_sha256[:12]}, registered "
                              f"code is {code[:12]}")
    rundir.remove_file(run_dir, record.prediction_file, "discard_orphan")
    return None
  return record


def batch_docs(metadata: dict) -> np.ndarray:
  """[B] the number of documents in each document's capture batch (its `step`)."""
  steps = np.asarray(metadata.get("step", [0] * len(metadata["document_ids"])))
  counts = collections.Counter(steps.tolist())
  return np.asarray([counts[s] for s in steps.tolist()], np.int32)


def replay(run_dir: str, capture_dir: str, attacker: Attacker, attacks: list[str],
           budget, seed: int, *, run_prefix: str = "",
           reference_prefix: str | None = None, model_seed: int = 0,
           memory_budget_bytes: int = 2 << 30, mesh="auto",
           calibration_defense: dict | None = None, seal: bool = False,
           lock_wait_s: float = 0.0, layer_form: str = "auto") -> list[AttackRecord]:
  """Runs `attacks` on the capture at `capture_dir`; returns their records.

  Args:
    run_dir: run directory (created, or resumed if its protocol.json matches), or a study
      directory (`rundir.create_study`) that collects several protocol tuples.
    attacks: registered attack names.
    budget: budget fields (ConfigDict or dict); absent fields take their defaults.
    seed: the attack seed (every attack's randomness derives from it).
    run_prefix: prefix of each record's run_id (e.g. "k6/public/model0/").
    reference_prefix: for defended captures, the run_id prefix of the linked undefended
      reference: each attack links `reference_prefix + attack`.
    mesh: a document mesh, None for one device, or "auto" (every device of the job: in a
      job across processes (lla.dist) this process leads and the others, in `follow`,
      compute their share of every chunk).
    calibration_defense: {"name", "params", "attacker_seed"} of the defense a
      defense-aware attacker mimics on its calibration data (lla.defenses.aware); for
      defense-aware attacks, and only those.
    seal: the replay is a whole run (experiments/replay.py): a finished (sealed) run
      directory is reopened (rundir.reopen) once every input has been checked, and the
      run is finalized (sealed, manifest written) when the replay ends, crashed attacks
      included. A study being built by several replays leaves this False.
    lock_wait_s: how long to wait for another writer's lock on `run_dir`
      (rundir.locked) before refusing; the lock is held from the checks of the run
      directory to the seal.
    layer_form: how the attacks' model calls run the layers (workspace.LAYER_FORMS).

  Raises:
    ReplayInputError, registry.IncompatibleCaptureError, budget.BudgetError,
    store.CaptureError or rundir.RunLockedError before anything is written, naming the
    problem.
  """
  if not dist.is_leader():
    raise RuntimeError(f"process {dist.process_index()}: replay runs on process 0 of a job "
                       "across processes; the others serve it with lla.replay.driver.follow")
  if layer_form not in LAYER_FORMS:
    raise ReplayInputError(f"layer_form {layer_form!r}: one of {LAYER_FORMS}")
  check_workdir(run_dir, capture_dir)
  plan = prepare(capture_dir, attacker, attacks, budget, seed, calibration_defense)
  capture, specs, e = plan.capture, plan.specs, plan.e
  with rundir.locked(run_dir, lock_wait_s, what="replay"):
    for spec in specs:
      _check_reuse(run_dir, file_name(run_prefix + spec.name), spec, e, rundir.e_hash(e),
                   capture.manifest_sha256)
    _check_protocol(run_dir, e)
    pin_inputs(run_dir, rundir.e_hash(e), plan.attacker, calibration_defense, check_only=True)
    with rundir.extending(run_dir, always_finalize=True) if seal else contextlib.nullcontext():
      e_hash = _register_protocol(run_dir, e)
      pin_inputs(run_dir, e_hash, plan.attacker, calibration_defense)
      record_threat_space(run_dir)
      ws = plan.workspace(memory_budget_bytes, document_mesh() if mesh == "auto" else mesh,
                          layer_form)
      done = {spec.name: _finished(run_dir, file_name(run_prefix + spec.name), spec)
              for spec in specs}
      todo = [spec.name for spec in specs if done[spec.name] is None]
      if todo and spans_processes(ws.mesh):
        dist.send(plan.request(todo, memory_budget_bytes, layer_form))
      common = plan.record_fields(run_dir, e_hash, model_seed)
      records = []
      for spec in specs:
        if done[spec.name] is not None:
          logging.info("replay: %s already finished (%s), reused", spec.name,
                       done[spec.name].prediction_sha256[:12])
          records.append(done[spec.name])
          continue
        reference = None if reference_prefix is None else (
            reference_prefix + (spec.reference_attack or spec.name))
        records.append(_run_one(run_dir, ws, spec, plan.values, seed, run_prefix,
                                {**common, "reference": reference}))
      return records


@dataclasses.dataclass(frozen=True)
class Plan:
  """A checked replay: what the capture and attacker are, E, and how to build the
  Workspace, the same way on every process of a job."""

  capture: store.Capture
  attacker: Attacker
  specs: list
  values: dict
  seed: int
  calibration_defense: dict | None
  calibration_transform: object
  e: dict

  def workspace(self, memory_budget_bytes: int, mesh, layer_form: str = "auto") -> Workspace:
    target = self.capture.metadata["protocol"]["T"]
    return Workspace(self.capture.activations, self.capture.gradients, self.attacker.params,
                     self.attacker.cfg, int(target["cut"]), self.attacker.calibration_tokens,
                     ridge_alpha=float(self.values["ridge_alpha"]),
                     memory_budget_bytes=memory_budget_bytes, mesh=mesh,
                     calibration_transform=self.calibration_transform,
                     batch_docs=batch_docs(self.capture.metadata),
                     defense={"name": str(target["defense"]),
                              "params": dict(target["defense_params"] or {})},
                     capture_files=store.attack_files(self.capture),
                     capture_info=store.attack_metadata(self.capture),
                     known_prefix=known_prefix(self.capture.metadata),
                     knowledge=self.attacker.knowledge, layer_form=layer_form)

  def record_fields(self, run_dir: str, e_hash: str, model_seed: int) -> dict:
    """The fields every record of this replay shares."""
    capture, target = self.capture, self.capture.metadata["protocol"]["T"]
    return dict(
        e_hash=e_hash, capture_dir=os.path.relpath(capture.directory, run_dir),
        capture_sha256=capture.manifest_sha256,
        truth_file=os.path.relpath(os.path.join(capture.directory, store.TRUTH_FILE), run_dir),
        model_id=str(target["model_id"]), model_seed=int(model_seed), cut=int(target["cut"]),
        knowledge=self.attacker.knowledge, corpus=capture.metadata["protocol"]["C"]["name"],
        defense=str(target["defense"]), defense_params=dict(target["defense_params"] or {}),
        seed=int(self.seed), provenance=provenance())

  def request(self, attacks: list[str], memory_budget_bytes: int, layer_form: str) -> dict:
    """What a follower needs to take its share of `attacks` (JSON)."""
    buffer = io.BytesIO()
    np.save(buffer, self.attacker.calibration_tokens, allow_pickle=False)
    return {"type": "replay", "capture_dir": self.capture.directory,
            "capture_sha256": self.capture.manifest_sha256,
            "attacker_source": dict(self.attacker.source),
            "attacker_sha256": self.attacker.model_id, "knowledge": self.attacker.knowledge,
            "calibration_npy": base64.b64encode(buffer.getvalue()).decode(),
            "attacks": list(attacks), "budget": self.values, "seed": int(self.seed),
            "calibration_defense": self.calibration_defense,
            "memory_budget_bytes": int(memory_budget_bytes), "layer_form": layer_form}


def prepare(capture_dir: str, attacker: Attacker, attacks: list[str], budget, seed: int,
            calibration_defense: dict | None = None) -> Plan:
  """Loads and checks everything a replay needs, before anything is written.

  Raises:
    ReplayInputError, registry.IncompatibleCaptureError, budget.BudgetError or
    store.CaptureError, naming the problem.
  """
  capture = store.load_capture(capture_dir)
  defense = str(capture.metadata["protocol"]["T"]["defense"])
  specs = [registry.get(name).spec for name in attacks]
  for spec in specs:
    registry.check_family(spec, attacker.cfg)
    registry.check_compatible(spec, capture.observations, attacker.knowledge,
                              capture_name=f"capture {capture_dir}", defense=defense)
    if spec.defense_aware != (calibration_defense is not None):
      raise registry.IncompatibleCaptureError(
          f"attack {spec.name!r} is {'' if spec.defense_aware else 'not '}defense-aware: it "
          f"{'needs' if spec.defense_aware else 'must not get'} a calibration defense")
  if attacker.cfg.n_embd != capture.activations.shape[-1]:
    raise ReplayInputError(f"attacker model has d={attacker.cfg.n_embd}, capture {capture_dir} "
                           f"has d={capture.activations.shape[-1]}")
  calibration = check_calibration(attacker.calibration_tokens, attacker.cfg.vocab_size,
                                  capture.activations.shape[1])
  attacker = dataclasses.replace(attacker, calibration_tokens=calibration)
  values = budget_lib.validate(budget, specs, attacker.cfg.vocab_size)
  transform = None if calibration_defense is None else \
      aware.calibration_transform(**calibration_defense)
  e = replay_protocol(capture, attacker, values, seed, calibration_defense)
  return Plan(capture, attacker, specs, values, int(seed), calibration_defense, transform, e)


def known_prefix(metadata: dict) -> tuple[int, ...]:
  """The capture's public first tokens (E.C.known_prefix: a BOS), () without one."""
  return tuple(int(t) for t in metadata["protocol"]["C"].get("known_prefix", ()))


def scored_positions(spec, ws: Workspace) -> str:
  """The positions an attack's record is scored on: its own declaration, or every position
  after the capture's known BOS (lla.scoring.metrics)."""
  return "after_bos" if ws.known_prefix else spec.scored_positions


def _check_predictions(predictions, ws: Workspace) -> np.ndarray:
  predictions = np.asarray(predictions)
  if predictions.shape != (ws.num_docs, ws.seq_len) or not np.issubdtype(predictions.dtype,
                                                                         np.integer):
    raise ValueError(f"predictions must be [{ws.num_docs}, {ws.seq_len}] integers, got "
                     f"{predictions.dtype}{list(predictions.shape)}")
  if predictions.min() < 0 or predictions.max() >= ws.cfg.vocab_size:
    raise ValueError(f"predicted token ids outside [0, {ws.cfg.vocab_size})")
  return predictions.astype(np.int32)


def execute(ws: Workspace, spec, values: dict, seed: int):
  """Runs one attack, metered: (AttackResult, predictions [B, T] int32, Charge, None,
  compile), or (None, None, Charge, the exception, compile) when it crashed; `compile` is
  what this process compiled meanwhile (lla.runtime.compile_meter). Every process of a
  job runs this.

  A long study's compiled executables are dropped first when they crowd the process's
  memory mappings (lla.runtime): XLA:CPU would not survive the next compile."""
  runtime.release_compiled_when_crowded()
  view = budget_lib.View(values, spec.budget_fields, spec.name)
  with runtime.compile_meter() as spent, ws.attack_scope(spec.name):
    try:
      result = registry.get(spec.name)(ws, view, jax.random.key(seed))
      predictions = _check_predictions(result.predictions, ws)
    except dist.JobError:  # The job lost a process: not the attack's failure.
      raise
    except Exception as e:  # A crashed module is recorded as unmeasured, never as a failed attack.
      logging.error("attack %s crashed:\n%s", spec.name, traceback.format_exc())
      outcome = None, None, ws.charge(0.0), e
    else:
      outcome = result, predictions, ws.charge(result.flops_analytic), None
  return (*outcome, spent)


def make_record(spec, ws: Workspace, values: dict, run_id: str, result, charge, error,
                prediction_file: str | None, prediction_sha256: str | None,
                common: dict, jax_compile: dict | None = None) -> AttackRecord:
  """The record of one executed attack (`error` set: a crashed, unmeasured one);
  `jax_compile`: what `execute` measured of its compilation."""
  view = budget_lib.View(values, spec.budget_fields, spec.name)
  measured = error is None
  return AttackRecord(
      run_id=run_id, attack=spec.name, family=spec.family, attack_revision=spec.revision,
      attack_code_sha256=(registry.source(spec.name) or {}).get("sha256"),
      status="ok" if measured else "crashed",
      error=None if measured else f"{type(error).__name__}: {error}",
      prediction_file=prediction_file, prediction_sha256=prediction_sha256,
      scored_positions=scored_positions(spec, ws), baseline_token=ws.baseline_token,
      budget=view.to_dict(), flops=charge.flops if measured else None,
      flops_source=charge.flops_source if measured else None,
      flops_analytic=charge.flops_analytic if measured else None,
      wall_s=charge.wall_s, compile_s=charge.compile_s, stages=charge.stages,
      details=dict(result.details) if measured else {}, jax_compile=jax_compile, **common)


def _run_one(run_dir, ws: Workspace, spec, values: dict, seed: int, run_prefix: str,
             common: dict) -> AttackRecord:
  run_id = run_prefix + spec.name
  result, predictions, charge, error, spent = execute(ws, spec, values, seed)
  rel = sha = None
  if error is None:
    rel, sha = rundir.save_predictions(run_dir, file_name(run_id), predictions)
  record = make_record(spec, ws, values, run_id, result, charge, error, rel, sha, common,
                       spent)
  rundir.save_record(run_dir, file_name(run_id), record)
  if error is None:
    logging.info("replay: %s done in %.1fs (%.1fs compiling, %d executables), %.3g FLOPs "
                 "(%s)", spec.name, spent["wall_s"], spent["seconds"], spent["executables"],
                 charge.flops, charge.flops_source)
  return record


class LeaderFailedError(RuntimeError):
  """Process 0 of a job across processes stopped with an error."""


def follow(plugins="") -> None:
  """A follower's part of a job across processes (lla.dist): serves every replay process 0
  announces, computing this process's share of each document chunk, until the leader's
  job ends. Writes nothing.

  Raises:
    LeaderFailedError: the leader's job ended with an error (the followers stop too).
    ValueError: this process sees another capture or attacker than the leader (hosts
      without the same files at the same paths).
  """
  registry.load_plugins(plugins)
  models = {}
  while True:
    message = dist.receive()
    if message["type"] == "exit":
      if message["error"]:
        raise LeaderFailedError(f"process {dist.process_index()}: process 0 stopped: "
                                f"{message['error']}")
      return
    _serve(message, models)


def _serve(request: dict, models: dict) -> None:
  """One replay announced by the leader: the same Workspace and attacks, nothing written."""
  source = request["attacker_source"]
  key = json.dumps(source, sort_keys=True)
  if key not in models:
    models[key] = load_model(ml_collections.ConfigDict(source))
  model = models[key]
  if model.model_id != request["attacker_sha256"]:
    raise ValueError(f"process {dist.process_index()}: attacker weights at {source} hash to "
                     f"{model.model_id[:12]}..., process 0's to "
                     f"{request['attacker_sha256'][:12]}...")
  calibration = np.load(io.BytesIO(base64.b64decode(request["calibration_npy"])),
                        allow_pickle=False)
  attacker = Attacker(model.params, model.cfg, model.model_id, calibration,
                      request["knowledge"], source)
  plan = prepare(request["capture_dir"], attacker, request["attacks"], request["budget"],
                 request["seed"], request["calibration_defense"])
  if plan.capture.manifest_sha256 != request["capture_sha256"]:
    raise ValueError(f"process {dist.process_index()}: capture {request['capture_dir']} differs "
                     "from process 0's (manifest hash)")
  ws = plan.workspace(int(request["memory_budget_bytes"]), document_mesh(),
                      request["layer_form"])
  for spec in plan.specs:
    execute(ws, spec, plan.values, plan.seed)
