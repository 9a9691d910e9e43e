"""Captures of what the cloud node sees, in the project's capture format (docs/run_format.md).

    CAPTURE/
      messages.safetensors  forward [S, M, D] f32 (frames sent), gradient [S, M, D] f32
                            (returned gradients as received), step [S] i32, order [S] i32
      truth.safetensors     real_mask [S, M] u8, input_tokens [S, M] i32, target_tokens
                            [S, M] i32 (-1 on decoy rows); only the scorer reads it
      truth_<view>.safetensors  tokens: the ground truth of one scored view (below)
      metadata.json         session id, protocol tuple E and its hash, policy hash, CE
      manifest.sha256       sha256sum of every other file

The truth is expressed in wire order (row i of frame s), so an attack's per-row
predictions are scored without knowing the secret permutation. The scored views are what
the main study's records are scored against (lla.decoy.records), inside the capture so
that its manifest covers them:
  structural  [S, M] int32: 1 for a real row, 0 for a decoy row (the row mask);
  content     [S_test, R] int32: the label token of each real row (wire order) of the
              frames held out from the known-plaintext probe (`attacks.split_frames`).

A capture is written into a temporary sibling directory and renamed into place, so an
interrupted write leaves nothing that looks finished; an existing capture is never
overwritten. `read` verifies the manifest, dtypes, shapes and finiteness.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from lla.evidence import files, manifest

MESSAGES = "messages.safetensors"
TRUTH = "truth.safetensors"
METADATA = "metadata.json"
VIEWS = ("structural", "content")


def view_file(view: str) -> str:
  return f"truth_{view}.safetensors"


def truth_from_perm(perm: np.ndarray, blocks: np.ndarray, n_real: int) -> dict:
  """Wire-order truth from perm [S, M] and the blocks [S, R + 1] that were trained on."""
  real = perm < n_real
  src = np.where(real, perm, 0)
  take = lambda tokens: np.where(real, np.take_along_axis(tokens, src, axis=1), -1)
  return {"real_mask": real.astype(np.uint8),
          "input_tokens": take(blocks[:, :-1]).astype(np.int32),
          "target_tokens": take(blocks[:, 1:]).astype(np.int32)}


def scored_views(truth: dict, label: str, test_frames: np.ndarray) -> dict:
  """The scored views (module docstring) of a wire-order truth; test_frames [S_test]."""
  mask = truth["real_mask"].astype(bool)
  s, r = mask.shape[0], int(mask[0].sum())
  labels = truth[f"{label}_tokens"][mask].reshape(s, r)
  return {"structural": mask.astype(np.int32),
          "content": np.ascontiguousarray(labels[np.asarray(test_frames)], np.int32)}


def _check(directory: str, messages: dict, truth: dict, views: dict | None) -> None:
  """Raises ValueError naming the capture if a tensor has the wrong dtype, shape or value."""
  def bad(what):
    return ValueError(f"{directory}: {what}")
  forward, gradient = messages.get("forward"), messages.get("gradient")
  for name, x in (("forward", forward), ("gradient", gradient)):
    if x is None or x.dtype != np.float32 or x.ndim != 3:
      raise bad(f"{name} must be float32 [S, M, D], got "
                f"{None if x is None else f'{x.dtype}{list(x.shape)}'}")
    if not np.isfinite(x).all():
      raise bad(f"{name} contains NaN or Inf ({int((~np.isfinite(x)).sum())} values)")
  if forward.shape != gradient.shape:
    raise bad(f"gradient shape {gradient.shape} != forward shape {forward.shape}")
  s, m = forward.shape[:2]
  for name in ("step", "order"):
    x = messages.get(name)
    if x is None or x.dtype != np.int32 or x.shape != (s,):
      raise bad(f"{name} must be int32 [{s}]")
  mask = truth.get("real_mask")
  if mask is None or mask.dtype != np.uint8 or mask.shape != (s, m) or mask.max(initial=0) > 1:
    raise bad(f"real_mask must be uint8 [{s}, {m}] of 0/1")
  for name in ("input_tokens", "target_tokens"):
    x = truth.get(name)
    if x is None or x.dtype != np.int32 or x.shape != (s, m):
      raise bad(f"{name} must be int32 [{s}, {m}]")
    if np.any((x < 0) != (mask == 0)):
      raise bad(f"{name} must be -1 exactly on decoy rows and a token id on real rows")
  for name, x in (views or {}).items():
    if name not in VIEWS or x.dtype != np.int32 or x.ndim != 2 or x.min(initial=0) < 0:
      raise bad(f"scored view {name!r} must be one of {VIEWS}, int32 [B, T], non-negative")


def write(directory: str, forward: np.ndarray, gradient: np.ndarray, truth: dict,
          metadata: dict, views: dict | None = None) -> str:
  """Writes a capture directory and returns its manifest hash.

  Refuses to overwrite: a directory that exists and is not empty raises FileExistsError.
  The files are written into a temporary sibling and renamed into place together.
  """
  if os.path.isdir(directory) and os.listdir(directory):
    raise FileExistsError(f"{directory}: a capture is already there; refusing to overwrite it")
  steps = np.arange(forward.shape[0], dtype=np.int32)
  # Frames reach the cloud in step order, so order equals step in this system.
  messages = {"forward": np.ascontiguousarray(forward, np.float32),
              "gradient": np.ascontiguousarray(gradient, np.float32),
              "step": steps, "order": steps}
  truth = {k: np.ascontiguousarray(v) for k, v in truth.items()}
  views = {k: np.ascontiguousarray(v) for k, v in (views or {}).items()}
  _check(directory, messages, truth, views)
  parent = os.path.dirname(os.path.abspath(directory))
  os.makedirs(parent, exist_ok=True)
  staging = tempfile.mkdtemp(prefix=f".tmp-{os.path.basename(directory)}-", dir=parent)
  try:
    save_file(messages, os.path.join(staging, MESSAGES))
    save_file(truth, os.path.join(staging, TRUTH))
    for name, tokens in views.items():
      save_file({"tokens": tokens}, os.path.join(staging, view_file(name)))
    files.atomic_write_json(os.path.join(staging, METADATA), metadata)
    manifest.write_manifest(staging)
    if os.path.isdir(directory):
      os.rmdir(directory)  # empty (checked above)
    os.rename(staging, directory)
  finally:
    if os.path.exists(staging):
      shutil.rmtree(staging)
  return files.sha256_file(os.path.join(directory, manifest.MANIFEST_NAME))


def is_complete(directory: str) -> bool:
  """True if the directory holds a capture whose manifest verifies."""
  return (os.path.exists(os.path.join(directory, manifest.MANIFEST_NAME))
          and manifest.verify_manifest(directory).ok)


def read(directory: str) -> tuple[dict, dict, dict, str]:
  """(messages, truth, metadata, manifest sha256) of a verified capture; raises ValueError
  naming the capture if it is tampered, or a tensor has the wrong dtype, shape or values."""
  report = manifest.verify_manifest(directory)
  if not report.ok:
    raise ValueError(f"{directory}: capture fails its manifest: {report.problems()}")
  try:
    messages = load_file(os.path.join(directory, MESSAGES))
    truth = load_file(os.path.join(directory, TRUTH))
  except (SafetensorError, OSError) as e:
    raise ValueError(f"{directory}: unreadable safetensors ({e})") from None
  views = {}
  for name in VIEWS:
    path = os.path.join(directory, view_file(name))
    if os.path.exists(path):
      views[name] = load_file(path).get("tokens", np.zeros((0,), np.float32))
  _check(directory, messages, truth, views)
  return (messages, truth, files.read_json(os.path.join(directory, METADATA)),
          files.sha256_file(os.path.join(directory, manifest.MANIFEST_NAME)))
