"""A sweep worker: runs cells and returns their predictions and records, writing no result.

One `Worker` lives in each process that runs cells (the driver for the local backend, each
Ray actor, each submitit job). It keeps what cells share: loaded models, corpus splits,
captures, and one Workspace per group (lla.sweep.cells), so that a group's shared stages
are computed once; the attack runtime keeps every compiled executable of the process warm
across cells. The only files a worker writes are captures: content-addressed directories
under WORKDIR/captures, made once (a concurrent writer of the same capture loses the race
and reuses the winner's, which has the same bytes).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import io
import json
import os
import pathlib
import socket
import time

import ml_collections
import numpy as np

from lla import data as data_lib
from lla.attacks import registry
from lla.replay import driver as replay
from lla.attacks.workspace import document_mesh
from lla.capture import capture as capture_lib
from lla.capture import store
from lla.defenses import training
from lla.evidence import files, rundir
from lla.model.loading import load_model
from lla.study import defense_sweep
from lla.sweep import cells

CAPTURES = "captures"
STUDY = "study"
MODEL_SOURCES = ("gguf", "gguf_package", "hf_dir", "checkpoint", "hub")
KEY_STORE = defense_sweep.KEY_STORE  # the defenders' secrets, under WORKDIR


@dataclasses.dataclass
class CellResult:
  """What a worker returns for one cell (picklable; the driver writes it).

  Attributes:
    e: the cell's protocol tuple E; e_hash its hash.
    pinned: what regenerating its predictions needs besides the capture (the attacker's
      weight source and hash, the calibration defense); calibration: [N, T] int32 tokens.
    attacks: per attack {"name", "file" (its file stem), "record" (AttackRecord JSON),
      "predictions" ([B, T] int32, or None when it crashed)}.
    worker: where it ran (host, pid, and the Ray node when there is one).
  """

  cell_id: str
  config: dict
  e: dict
  e_hash: str
  pinned: dict
  calibration: np.ndarray
  attacks: list
  worker: dict
  wall_s: float


def npy_bytes(tokens: np.ndarray) -> bytes:
  """The exact bytes rundir.save_predictions writes for [B, T] predictions."""
  buffer = io.BytesIO()
  np.save(buffer, np.asarray(tokens).astype(np.int32), allow_pickle=False)
  return buffer.getvalue()


def model_source(model: dict) -> dict:
  return {k: model[k] for k in MODEL_SOURCES if model.get(k)}


class Worker:
  """Runs cells for a sweep whose results go to WORKDIR/study (see the module doc)."""

  def __init__(self, workdir: str, max_workspaces: int = 4):
    self.workdir = pathlib.Path(workdir)
    self.study = str(self.workdir / STUDY)
    self._models: dict = {}
    self._data: dict = {}
    self._workspaces: collections.OrderedDict = collections.OrderedDict()
    self._max_workspaces = max_workspaces

  def run(self, cell) -> CellResult:
    """Runs every attack of `cell` (a lla.sweep.cells.Cell); returns its results."""
    start = time.perf_counter()
    c = cell.config
    registry.load_plugins(c["plugins"])
    target = self._model(c["target"])
    # The target's own tokenizer cuts the documents (a fine-tuned checkpoint keeps its
    # base's); token files need none.
    tokens, ids, calibration, corpus, split_hashes, known_prefix = self._splits(
        c["data"], None if c["data"]["tokens_npy"] else target.text_tokenizer(
            "data.tokens_npy and data.calibration_npy"))
    capture_dir = self._capture(c, target, tokens, ids, corpus, split_hashes, known_prefix)
    public = c["knowledge"] == "public"
    attacker_config = c["target"] if public else c["pretrained"]
    model = target if public else self._model(attacker_config)
    attacker = replay.Attacker(model.params, model.cfg, model.model_id, calibration,
                               c["knowledge"], model_source(attacker_config))
    plan = replay.prepare(capture_dir, attacker, c["attacks"], c["budget"], int(c["seed"]))
    ws = self._workspace(cell.group, plan, int(c["memory_budget_mb"]) << 20)
    e_hash = rundir.e_hash(plan.e)
    common = {**plan.record_fields(self.study, e_hash, int(c["model_seed"])), "reference": None}
    attacks = []
    for spec in plan.specs:
      result, predictions, charge, error, spent = replay.execute(ws, spec, plan.values,
                                                                 plan.seed)
      run_id = f"{cell.cell_id}/{spec.name}"
      name = replay.file_name(run_id)
      sha = None if error is not None else files.sha256_bytes(npy_bytes(predictions))
      record = replay.make_record(
          spec, ws, plan.values, run_id, result, charge, error,
          None if error is not None else f"{rundir.PREDICTIONS}/{name}.npy", sha, common,
          spent)
      attacks.append({"name": spec.name, "file": name, "record": json.loads(record.to_json()),
                      "predictions": predictions})
    pinned = {"attacker_source": attacker.source, "attacker_params_sha256": attacker.model_id,
              "calibration_defense": None}
    return CellResult(cell.cell_id, c, plan.e, e_hash, pinned, plan.attacker.calibration_tokens,
                      attacks, {"host": socket.gethostname(), "pid": os.getpid()},
                      time.perf_counter() - start)

  def _model(self, model: dict):
    key = json.dumps(model_source(model), sort_keys=True)
    if key not in self._models:
      self._models[key] = load_model(ml_collections.ConfigDict(model))
    return self._models[key]

  def _splits(self, data: dict, tokenizer=None):
    """(evaluation tokens [B, T], document ids, calibration tokens [N, T], corpus name,
    split hashes, known prefix) from .npy files or from lla.data, cut by `tokenizer`
    (None: the data directory's GPT-2 tokenizer; .npy files are already tokens)."""
    key = json.dumps([data, None if tokenizer is None else tokenizer.sha256], sort_keys=True)
    if key not in self._data:
      if data["tokens_npy"]:
        tokens = files.load_token_matrix(data["tokens_npy"], "evaluation tokens")
        if not data["calibration_npy"]:
          raise ValueError("data.tokens_npy needs data.calibration_npy (the attacker's "
                           "calibration documents)")
        calibration = files.load_token_matrix(data["calibration_npy"], "calibration tokens")
        hashes = {"evaluation": files.sha256_bytes(np.ascontiguousarray(tokens).tobytes()),
                  "calibration": files.sha256_bytes(np.ascontiguousarray(calibration).tobytes())}
        self._data[key] = (tokens.astype(np.int32), list(range(tokens.shape[0])),
                           calibration.astype(np.int32), "custom", hashes, ())
      else:
        kwargs = {k: v for k, v in data.items() if k not in ("tokens_npy", "calibration_npy")}
        splits = data_lib.load_splits(**kwargs, tokenizer=tokenizer)
        self._data[key] = (splits.evaluation.tokens, list(splits.evaluation.document_ids),
                           splits.calibration.tokens, splits.corpus,
                           {n: p.sha256 for n, p in splits.items()}, splits.known_prefix)
    return self._data[key]

  def _capture(self, c: dict, target, tokens, ids, corpus: str, split_hashes: dict,
               known_prefix: tuple[int, ...] = ()) -> str:
    """The cell's capture directory, made once (race-safe) and verified: a capture already
    there is used only if it was made from this target, through this defense, with the
    secret the defender's key store holds for it (else store.CaptureError, one line)."""
    identity = {"target": model_source(c["target"]), "model_id": target.model_id,
                "cut": c["cut"], "defense": c["defense"], "batch": c["capture_batch_size"],
                "model_seed": c["model_seed"], "corpus": corpus, "split_hashes": split_hashes,
                "tokens": files.sha256_bytes(np.ascontiguousarray(tokens).tobytes())}
    key = hashlib.sha256(files.canonical_json(identity)).hexdigest()[:16]
    directory = self.workdir / CAPTURES / f"k{c['cut']}_{c['defense']['name']}_{key}"
    cut, batch = int(c["cut"]), int(c["capture_batch_size"])
    defended = (_Defended(c["defense"], self.workdir / KEY_STORE, directory.name)
                if c["defense"]["name"] != "none" else None)
    expected = {"T.model_id": target.model_id, "T.cut": cut,
                "C.split_hashes": dict(split_hashes)}
    if defended is not None:
      expected.update(defense_sweep.capture_expectation(
          target, defended.defense, defended.secret, defended.label, False, cut,
          split_hashes))
    if not directory.exists():
      kwargs = {} if defended is None else defended.capture_arguments(target, tokens, cut,
                                                                      batch)
      try:
        capture_lib.capture_target(str(directory), target.params, target.cfg, tokens, ids, cut,
                                   model_id=target.model_id, corpus=corpus,
                                   split_hashes=split_hashes, training=True, batch_size=batch,
                                   known_prefix=known_prefix, **kwargs)
      except OSError:  # Another worker wrote it first (FileExistsError, or a failed rename).
        if not directory.exists():
          raise
    store.verify(directory)
    store.check_expected(directory, expected)
    return str(directory)

  def _workspace(self, group: str, plan, memory_budget_bytes: int):
    """The group's Workspace (its stages computed once), least recently used dropped."""
    key = (group, plan.capture.manifest_sha256, plan.attacker.model_id)
    if key in self._workspaces:
      self._workspaces.move_to_end(key)
      return self._workspaces[key]
    ws = plan.workspace(memory_budget_bytes, document_mesh())
    self._workspaces[key] = ws
    while len(self._workspaces) > self._max_workspaces:
      self._workspaces.popitem(last=False)
    return ws


class _Defended:
  """A cell's defense and the defender's secret for its capture.

  The secret is the defender's: drawn from the OS the first time a capture of this defended
  target is made and kept in the key store WORKDIR/defender/secrets.json (outside the
  captures and the study, which record its hash alone; lla.study.defense_sweep.KeyStore),
  never derived from a public value such as the model seed. The target is named by the
  capture directory, so each defended capture has its own secret.
  """

  def __init__(self, defense: dict, key_store: pathlib.Path, target: str):
    self.defense = cells.defense_of(defense)
    self.label = cells.defense_label(defense)
    self.secret = (defense_sweep.KeyStore(key_store).secret(f"{CAPTURES}/{target}")
                   if self.defense.has_secret else None)

  def capture_arguments(self, target, tokens, cut: int, batch: int) -> dict:
    """capture_target's arguments for a capture through the defense (a fixed target)."""
    return dict(
        messages=training.batched_messages(target.params, target.cfg, tokens, cut,
                                           self.defense, self.secret, batch, training=True,
                                           first_step=defense_sweep.CAPTURE_STEP),
        defense=self.defense.name,
        defense_seed_sha256=self.secret.sha256 if self.secret is not None else "",
        defense_params=defense_sweep.public_params(self.defense, self.secret, self.label,
                                                   False))
