"""Model checkpoints: orbax params + config + metadata, identified by a content hash.

Layout of a checkpoint directory:

  DIR/
    params/          orbax StandardCheckpointer tree of float32 arrays
    config.json      the GPT2Config fields
    hf/              the same weights as a HF `save_pretrained` directory (optional)
    tokenizer.json   the model's own tokenizer, for a model that brought one (optional)
    metadata.json    {"format", "params_sha256", "hf_sha256", "tokenizer", ...caller's metadata}

The model's identity is `params_sha256`: sha256 over every leaf in sorted path order (path,
dtype, shape, little-endian bytes), so it does not depend on how the params were produced or
stored (the model id adds its architecture and tokenizer: lla.model.loading). A model
fine-tuned from one that brought its own tokenizer (a Qwen3 directory's) keeps it:
`tokenizer.json` and metadata "tokenizer" {"sha256", "bos_id", "source"}. A model lla
pre-trains, or fine-tunes from one cut by GPT-2's tokenizer, records that: metadata
"tokenizer" {"kind": "gpt2"} (`GPT2_TOKENS`: the data directory's GPT-2 tokenizer). A
checkpoint recording neither (written before lla recorded it, or by a caller that knows no
tokenizer) is GPT-2's only with GPT-2's vocabulary (lla.model.loading). A checkpoint is
written complete under a sibling `DIR.partial-*` and renamed into place
in one step, so `DIR` either does not exist or holds every file; `restore` still re-hashes the
params (and the HF weights) and refuses a directory whose hash disagrees, e.g. one copied or
edited by hand. `Resident` holds the params of a few restored checkpoints at a time, for a
job that goes over many copies. `load_or_create` is the cache: a valid DIR is reused; a DIR that fails to
restore (damaged, or unreadable by this software version) is never deleted: it is moved aside
to `DIR.quarantined-<UTC time>-<id>` (with QUARANTINE.txt saying why), named in a warning, and
rebuilt.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import hashlib
import json
import os
import pathlib
import shutil
import uuid
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from lla.data import tokenizer as tokenizer_lib
from lla.model import hf_io
from lla.model import split
from lla.model.decoder import DecoderConfig
from lla.model.gpt2 import GPT2Config

FORMAT = "lla-checkpoint.v1"
PARAMS_DIR, CONFIG_FILE, METADATA_FILE, HF_DIR = "params", "config.json", "metadata.json", "hf"
TOKENIZER_FILE = "tokenizer.json"
_PARTIAL = ".partial-"
_QUARANTINED = ".quarantined-"
QUARANTINE_NOTE = "QUARANTINE.txt"


# `save(tokenizer=GPT2_TOKENS)`: trained here on text cut by the data directory's GPT-2
# tokenizer; recorded as metadata "tokenizer" {"kind": "gpt2"}.
GPT2_TOKENS = "gpt2"


class CheckpointError(ValueError):
  """A checkpoint directory that is missing, incomplete or fails its hash."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  """A restored (hash-verified) checkpoint."""

  path: pathlib.Path
  params: dict
  cfg: GPT2Config
  metadata: dict
  tokenizer: tokenizer_lib.Tokenizer | None = None  # the model's own; else None

  @property
  def sha256(self) -> str:
    return self.metadata["params_sha256"]

  @property
  def gpt2_tokens(self) -> bool:
    """Whether it records being trained here on the data directory's GPT-2 tokens."""
    return (self.metadata.get("tokenizer") or {}).get("kind") == GPT2_TOKENS

  @property
  def hf_dir(self) -> pathlib.Path | None:
    return self.path / HF_DIR if self.metadata.get("hf_sha256") else None


def params_sha256(params) -> str:
  """The model's identity: sha256 over (path, dtype, shape, little-endian bytes) of each leaf."""
  flat = {"/".join(str(getattr(p, "key", p)) for p in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  digest = hashlib.sha256()
  for name in sorted(flat):
    array = np.asarray(flat[name])
    array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    header = f"{name}\0{array.dtype.str}\0{list(array.shape)}\0"
    digest.update(header.encode("utf-8"))
    digest.update(array.tobytes())
  return digest.hexdigest()


def _file_sha256(path: pathlib.Path) -> str:
  digest = hashlib.sha256()
  with path.open("rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      digest.update(chunk)
  return digest.hexdigest()


def config_to_json(cfg: GPT2Config | DecoderConfig) -> dict:
  """The config's fields. A RoPE family's carry `family`; GPT-2's are unchanged (no family)."""
  return dataclasses.asdict(cfg)


def config_from_json(fields: dict) -> GPT2Config | DecoderConfig:
  if "family" in fields:
    return DecoderConfig(**fields)
  return GPT2Config(**fields)


def _checkpointer() -> ocp.StandardCheckpointer:
  """An orbax checkpointer for this process alone. In a job across processes (lla.dist)
  only process 0 saves, and each process restores what it needs on its own; orbax's
  default would wait for every process of the job at its barriers."""
  me = jax.process_index()
  return ocp.StandardCheckpointer(multiprocessing_options=ocp.options.MultiprocessingOptions(
      primary_host=me, active_processes={me}, barrier_sync_key_prefix=f"lla-process-{me}"))


def save(directory: str | os.PathLike, params, cfg: GPT2Config, metadata: dict | None = None,
         export_hf: bool = True,
         tokenizer: tokenizer_lib.Tokenizer | str | None = None) -> Checkpoint:
  """Writes a checkpoint atomically to `directory` (which must not exist yet).

  Args:
    directory: final location.
    params: GPT-2 parameter pytree.
    cfg: its config.
    metadata: JSON-serialisable extra fields (run config, data hashes, eval results).
    export_hf: also write `hf/`, a `save_pretrained` directory.
    tokenizer: the model's own tokenizer; GPT2_TOKENS for a model trained here on the data
      directory's GPT-2 tokens; None: none recorded.

  Returns:
    The checkpoint, with `params_sha256` in its metadata.
  """
  directory = pathlib.Path(directory).absolute()
  if directory.exists():
    raise CheckpointError(f"{directory}: already exists; remove it or use load_or_create")
  directory.parent.mkdir(parents=True, exist_ok=True)
  partial = directory.with_name(directory.name + _PARTIAL + uuid.uuid4().hex[:8])
  partial.mkdir()
  params = jax.device_get(params)
  full_metadata = {**(metadata or {}), "format": FORMAT, "params_sha256": params_sha256(params)}
  if isinstance(cfg, DecoderConfig):  # GPT-2 metadata stays as it was (family implicit)
    full_metadata.setdefault("family", cfg.family)
  with _checkpointer() as checkpointer:
    checkpointer.save(partial / PARAMS_DIR, params)
  (partial / CONFIG_FILE).write_text(json.dumps(config_to_json(cfg), indent=2, sort_keys=True) + "\n")
  if tokenizer == GPT2_TOKENS:
    full_metadata["tokenizer"] = {"kind": GPT2_TOKENS}
  elif tokenizer is not None:
    (partial / TOKENIZER_FILE).write_text(tokenizer_lib.definition(tokenizer))
    full_metadata["tokenizer"] = {"sha256": tokenizer.sha256, "bos_id": tokenizer.bos_id,
                                  "source": tokenizer.source}
  if export_hf:
    hf_io.save_hf_dir(params, cfg, partial / HF_DIR)
    full_metadata["hf_sha256"] = _file_sha256(partial / HF_DIR / hf_io.WEIGHTS_FILE)
  (partial / METADATA_FILE).write_text(json.dumps(full_metadata, indent=2, sort_keys=True) + "\n")
  os.rename(partial, directory)
  logging.info("saved checkpoint %s (params sha256 %s)", directory, full_metadata["params_sha256"])
  return Checkpoint(directory, params, cfg, full_metadata,
                    None if tokenizer == GPT2_TOKENS else tokenizer)


def _restore_tokenizer(directory: pathlib.Path, metadata: dict) -> tokenizer_lib.Tokenizer | None:
  recorded = metadata.get("tokenizer")
  if not recorded or recorded.get("kind") == GPT2_TOKENS:
    return None
  path = directory / TOKENIZER_FILE
  try:
    tokenizer = tokenizer_lib.from_definition(path.read_text(), recorded["source"])
  except Exception as e:  # tokenizers raises its own exception type for a bad definition
    raise CheckpointError(f"{path}: missing or unreadable ({type(e).__name__})") from None
  if tokenizer.sha256 != recorded["sha256"]:
    raise CheckpointError(f"{path}: its sha256 differs from metadata.json")
  bos = recorded.get("bos_id")
  return dataclasses.replace(tokenizer, bos_id=None if bos is None else int(bos))


def restore(directory: str | os.PathLike) -> Checkpoint:
  """Reads and verifies a checkpoint. Raises CheckpointError if anything is missing or off."""
  directory = pathlib.Path(directory).absolute()
  for name in (METADATA_FILE, CONFIG_FILE, PARAMS_DIR):
    if not (directory / name).exists():
      raise CheckpointError(f"{directory}: incomplete checkpoint, {name} is missing")
  try:
    metadata = json.loads((directory / METADATA_FILE).read_text())
    cfg = config_from_json(json.loads((directory / CONFIG_FILE).read_text()))
  except (json.JSONDecodeError, TypeError, ValueError) as e:
    raise CheckpointError(f"{directory}: unreadable metadata or config ({e})") from None
  if metadata.get("format") != FORMAT:
    raise CheckpointError(f"{directory}: format {metadata.get('format')!r}, expected {FORMAT!r}")
  target = jax.eval_shape(lambda: split.init_params(cfg, jax.random.key(0)))
  try:
    with _checkpointer() as checkpointer:
      params = checkpointer.restore(directory / PARAMS_DIR, target)
  except Exception as e:  # Orbax raises many types for damaged files; all mean "unusable".
    raise CheckpointError(f"{directory}: params unreadable ({type(e).__name__}: {e})") from None
  actual = params_sha256(params)
  if actual != metadata.get("params_sha256"):
    raise CheckpointError(f"{directory}: params sha256 {actual} != recorded "
                          f"{metadata.get('params_sha256')}")
  if metadata.get("hf_sha256"):
    weights = directory / HF_DIR / hf_io.WEIGHTS_FILE
    if not weights.exists() or _file_sha256(weights) != metadata["hf_sha256"]:
      raise CheckpointError(f"{weights}: missing or its sha256 differs from metadata.json")
  return Checkpoint(directory, params, cfg, metadata, _restore_tokenizer(directory, metadata))


class Resident:
  """The params of at most `capacity` checkpoints in memory, restored (and so verified) on
  first use, the least recently used dropped.

  A job over many fine-tuned copies (each of SmolLM2's is 0.54 GB) holds only the few its
  current phase cycles over, not every copy it has made.
  """

  def __init__(self, capacity: int):
    if capacity < 1:
      raise ValueError(f"a Resident holds at least one checkpoint, got capacity {capacity}")
    self.capacity = capacity
    self._params: collections.OrderedDict = collections.OrderedDict()

  def params(self, directory: str | os.PathLike, sha256: str) -> dict:
    """The params of the checkpoint at `directory`, which must hash to `sha256`.

    Raises:
      CheckpointError: it fails to restore, or it holds another model than `sha256`.
    """
    key = str(pathlib.Path(directory).absolute())
    if key not in self._params:
      checkpoint = restore(key)
      if checkpoint.sha256 != sha256:
        raise CheckpointError(f"{key}: holds params {checkpoint.sha256[:12]}..., expected "
                              f"{sha256[:12]}...")
      self.keep(checkpoint)
    self._params.move_to_end(key)
    return self._params[key]

  def keep(self, checkpoint: Checkpoint) -> None:
    """Holds the params of a checkpoint just restored or made (no second restore)."""
    key = str(pathlib.Path(checkpoint.path).absolute())
    self._params[key] = checkpoint.params
    self._params.move_to_end(key)
    while len(self._params) > self.capacity:
      self._params.popitem(last=False)


def quarantine(directory: str | os.PathLike, reason: str) -> pathlib.Path:
  """Moves a checkpoint that failed to restore aside (never deletes it); returns where.

  The reason is written into the moved directory as QUARANTINE.txt, and logged.
  """
  directory = pathlib.Path(directory).absolute()
  stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
  target = directory.with_name(f"{directory.name}{_QUARANTINED}{stamp}-{uuid.uuid4().hex[:8]}")
  os.rename(directory, target)
  (target / QUARANTINE_NOTE).write_text(
      f"Moved here from {directory} at {stamp}: it failed to restore.\n{reason}\n")
  logging.warning("checkpoint %s failed to restore (%s); moved to %s (kept, not deleted) and "
                  "recomputing it", directory, reason, target)
  return target


def load_or_create(directory: str | os.PathLike,
                   create: Callable[[], tuple[Any, GPT2Config, dict]],
                   export_hf: bool = True,
                   tokenizer: tokenizer_lib.Tokenizer | str | None = None
                   ) -> tuple[Checkpoint, bool]:
  """Returns (checkpoint, created): the valid checkpoint at `directory`, else `create()`'s.

  `create` returns (params, cfg, metadata) and runs only when no valid checkpoint exists. A
  directory that fails to restore is quarantined (`quarantine`), never deleted: the error may
  be transient or a version mismatch, and the checkpoint may have cost hours. Leftovers of an
  interrupted save (`.partial-*`, never complete) are removed. `tokenizer` is saved with a
  created checkpoint (`save`).
  """
  directory = pathlib.Path(directory).absolute()
  if directory.exists():
    try:
      checkpoint = restore(directory)
      logging.info("reusing checkpoint %s (params sha256 %s)", directory, checkpoint.sha256)
      return checkpoint, False
    except CheckpointError as e:
      quarantine(directory, str(e))
  for leftover in directory.parent.glob(directory.name + _PARTIAL + "*"):
    shutil.rmtree(leftover, ignore_errors=True)
  params, cfg, metadata = create()
  return save(directory, params, cfg, metadata, export_hf=export_hf, tokenizer=tokenizer), True
