"""The capture directory: boundary messages stored once, replayed by any attack.

    CAPTURE/
      messages.safetensors   activations [B, T, d] float32; gradients [B, T, d] (training)
      truth.safetensors      tokens [B, T] int32 (ground truth, for the scorer only)
      metadata.json          session id, step, order, document ids, E, checkpoint hash
      <extra files>          optional files an attack replays with the capture (e.g. the
                             decoder an active server trained), named in metadata.json
      manifest.sha256        sha256 of every other file

A capture is written into a temporary sibling directory and renamed into place, so an
interrupted capture leaves nothing that looks finished; an existing capture is never
overwritten. Loading verifies the manifest, shapes, dtypes and finiteness, and hands the
replay driver a `Capture` that holds no ground truth. What reaches an attack is less still
(lla.attacks.workspace): the messages, `attack_files` (the extra files, never the truth)
and `attack_metadata` (the blocks of ATTACK_METADATA, never document ids, the session or a
path); the driver keeps the directory and the rest of the metadata for itself.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import tempfile

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from lla.evidence import files, manifest

MESSAGES_FILE = "messages.safetensors"
TRUTH_FILE = "truth.safetensors"
METADATA_FILE = "metadata.json"
SCHEMA = "lla.capture.v1"


class CaptureError(ValueError):
  """A capture that cannot be used; the message names the file and the problem."""


@dataclasses.dataclass(frozen=True)
class Capture:
  """What the attacker observed. Ground truth is deliberately not a field.

  Attributes:
    directory: where it was loaded from.
    activations: [B, T, d] float32 forward messages.
    gradients: [B, T, d] float32 backward messages, or None for inference captures.
    metadata: the metadata.json contents (includes the protocol tuple E).
    manifest_sha256: sha256 of manifest.sha256, the capture's identity.
  """

  directory: str
  activations: np.ndarray
  gradients: np.ndarray | None
  metadata: dict
  manifest_sha256: str

  @property
  def observations(self) -> frozenset[str]:
    return frozenset({"activations"} | ({"gradients"} if self.gradients is not None else set()))

  @property
  def document_ids(self) -> list[int]:
    return list(self.metadata["document_ids"])


def _check_float_message(name: str, label: str, message: np.ndarray) -> None:
  if message.dtype != np.float32:
    raise CaptureError(f"{name}: {label} must be float32, got {message.dtype}")
  if not np.isfinite(message).all():
    raise CaptureError(f"{name}: {label} contain NaN or Inf "
                       f"({int((~np.isfinite(message)).sum())} values)")


def _check_messages(name: str, activations, gradients, tokens) -> None:
  if activations.ndim != 3:
    raise CaptureError(f"{name}: activations must be [B, T, d], got shape {activations.shape}")
  _check_float_message(name, "activations", activations)
  if gradients is not None:
    if gradients.shape != activations.shape:
      raise CaptureError(f"{name}: gradients shape {gradients.shape} != activations "
                         f"shape {activations.shape}")
    _check_float_message(name, "gradients", gradients)
  if tokens is not None:
    if tokens.shape != activations.shape[:2] or tokens.dtype != np.int32:
      raise CaptureError(f"{name}: tokens must be int32 {activations.shape[:2]}, got "
                         f"{tokens.dtype} {tokens.shape}")


RESERVED_FILES = (MESSAGES_FILE, TRUTH_FILE, METADATA_FILE, manifest.MANIFEST_NAME)
# The blocks of metadata.json an attack may read (an active server's own account of the
# hijack it ran); everything else (document ids, session, steps, E, where the model came
# from) stays with the replay driver and the scorer.
ATTACK_METADATA = ("active",)


def write_capture(directory: str | os.PathLike, activations: np.ndarray,
                  gradients: np.ndarray | None, tokens: np.ndarray, metadata: dict,
                  extra_files: dict[str, bytes] | None = None) -> str:
  """Writes a capture atomically; refuses to overwrite an existing one.

  Args:
    activations: [B, T, d] float32.
    gradients: [B, T, d] float32 or None.
    tokens: [B, T] int32 ground truth.
    metadata: JSON-serialisable; must hold `document_ids` (B of them) and `protocol`.
    extra_files: file name -> bytes, written beside the messages and covered by the
      manifest (plain names, none of RESERVED_FILES).

  Returns:
    The sha256 of the written manifest (the capture's identity).
  """
  directory = pathlib.Path(directory)
  if directory.exists() and any(directory.iterdir()):
    raise FileExistsError(f"{directory}: a capture is already there; refusing to overwrite it")
  activations = np.ascontiguousarray(activations, np.float32)
  gradients = None if gradients is None else np.ascontiguousarray(gradients, np.float32)
  tokens = np.ascontiguousarray(tokens, np.int32)
  _check_messages(str(directory), activations, gradients, tokens)
  if len(metadata.get("document_ids", ())) != activations.shape[0]:
    raise CaptureError(f"{directory}: metadata needs {activations.shape[0]} document_ids")
  extra_files = dict(extra_files or {})
  for name in extra_files:
    if name in RESERVED_FILES or os.path.basename(name) != name or name.startswith("."):
      raise CaptureError(f"{directory}: extra file name {name!r} is reserved or not a plain "
                         "file name")
  directory.parent.mkdir(parents=True, exist_ok=True)
  staging = pathlib.Path(tempfile.mkdtemp(prefix=f".tmp-{directory.name}-", dir=directory.parent))
  try:
    messages = {"activations": activations}
    if gradients is not None:
      messages["gradients"] = gradients
    save_file(messages, str(staging / MESSAGES_FILE))
    save_file({"tokens": tokens}, str(staging / TRUTH_FILE))
    files.atomic_write_json(str(staging / METADATA_FILE), {"schema": SCHEMA, **metadata})
    for name, content in sorted(extra_files.items()):
      files.atomic_write_bytes(str(staging / name), content)
    manifest.write_manifest(str(staging / ""))
    if directory.exists():
      directory.rmdir()
    os.rename(staging, directory)
  finally:
    if staging.exists():
      shutil.rmtree(staging)
  return files.sha256_file(str(directory / manifest.MANIFEST_NAME))


def verify(directory: str | os.PathLike) -> str:
  """Checks the manifest; returns its sha256 or raises CaptureError naming each problem."""
  directory = pathlib.Path(directory)
  if not directory.is_dir():
    raise CaptureError(f"{directory}: capture directory does not exist")
  report = manifest.verify_manifest(str(directory))
  if not report.ok:
    raise CaptureError(f"{directory}: manifest check failed: " + "; ".join(report.problems()))
  return files.sha256_file(str(directory / manifest.MANIFEST_NAME))


def load_capture(directory: str | os.PathLike) -> Capture:
  """Loads and validates a capture (manifest, shapes, dtypes, finiteness)."""
  directory = pathlib.Path(directory)
  manifest_sha = verify(directory)
  path = directory / MESSAGES_FILE
  try:
    messages = load_file(str(path))
  except (SafetensorError, OSError) as e:
    raise CaptureError(f"{path}: unreadable safetensors ({e})") from None
  if "activations" not in messages:
    raise CaptureError(f"{path}: no 'activations' tensor (has: {sorted(messages)})")
  activations, gradients = messages["activations"], messages.get("gradients")
  _check_messages(str(path), activations, gradients, None)
  metadata = files.read_json(str(directory / METADATA_FILE))
  if metadata.get("schema") != SCHEMA:
    raise CaptureError(f"{directory / METADATA_FILE}: schema {metadata.get('schema')!r}, "
                       f"expected {SCHEMA!r}")
  if len(metadata.get("document_ids", ())) != activations.shape[0]:
    raise CaptureError(f"{directory / METADATA_FILE}: {len(metadata.get('document_ids', ()))} "
                       f"document_ids for {activations.shape[0]} documents")
  return Capture(str(directory), activations, gradients, metadata, manifest_sha)


def attack_files(capture: Capture) -> dict[str, bytes]:
  """The files stored with `capture` for its attacks, name -> bytes: every file its manifest
  covers except the reserved ones (messages, ground truth, metadata, manifest), each checked
  against the manifest's sha256."""
  directory = pathlib.Path(capture.directory)
  entries, errors = manifest.read_manifest(str(directory / manifest.MANIFEST_NAME))
  if errors:
    raise CaptureError(f"{directory}: " + "; ".join(errors))
  out = {}
  for name, sha in sorted(entries.items()):
    if name in RESERVED_FILES or os.path.basename(name) != name:
      continue
    raw = (directory / name).read_bytes()
    if files.sha256_bytes(raw) != sha:
      raise CaptureError(f"{directory / name}: sha256 differs from the capture's manifest")
    out[name] = raw
  return out


def attack_metadata(capture: Capture) -> dict:
  """The blocks of the capture's metadata an attack may read (ATTACK_METADATA), copied."""
  return {k: json.loads(json.dumps(capture.metadata[k]))
          for k in ATTACK_METADATA if k in capture.metadata}


def load_truth(directory: str | os.PathLike) -> np.ndarray:
  """Ground-truth tokens [B, T] int32. For the scorer; never passed to an attack."""
  path = pathlib.Path(directory) / TRUTH_FILE
  try:
    return load_file(str(path))["tokens"]
  except (SafetensorError, OSError, KeyError) as e:
    raise CaptureError(f"{path}: cannot read ground truth ({e})") from None


def reuse_or_write(directory: str | os.PathLike, write, expected: dict | None = None) -> str:
  """A finished capture is verified and reused; otherwise `write(str(directory))` makes it.

  Args:
    expected: {"T.model_id": ..., "T.cut": ..., "C.split_hashes": {...}, ...}: fields of the
      capture's protocol tuple that a reused capture must match (a capture of another
      target, cut or split draw left in the directory is refused, naming the fields).

  Returns the manifest sha256 either way.
  """
  if not pathlib.Path(directory).exists():
    return write(str(directory))
  sha = verify(directory)
  check_expected(directory, expected)
  return sha


def check_expected(directory: str | os.PathLike, expected: dict | None) -> None:
  """Raises CaptureError (one line, naming each field with its stored and expected value)
  if the protocol tuple of the capture in `directory` differs from `expected` ({"T.model_id":
  ..., ...}, dotted paths into E)."""
  stored = files.read_json(str(pathlib.Path(directory) / METADATA_FILE)).get("protocol", {})
  differ = []
  for path, want in sorted((expected or {}).items()):
    have = stored
    for key in path.split("."):
      have = have.get(key) if isinstance(have, dict) else None
    if have != want:
      differ.append(f"{path} (stored {have!r}, expected {want!r})"[:200])
  if differ:
    raise CaptureError(f"{directory}: the capture there is of another target: differs in "
                       + "; ".join(differ) + "; use a new --workdir")
