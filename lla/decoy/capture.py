"""Captures of what the cloud node sees, in the project's capture format (docs/run_format.md).

    CAPTURE/
      messages.safetensors  forward [S, M, D] f32 (frames sent), gradient [S, M, D] f32
                            (returned gradients as received), step [S] i32, order [S] i32
      truth.safetensors     real_mask [S, M] u8, input_tokens [S, M] i32, target_tokens
                            [S, M] i32 (-1 on decoy rows); only the scorer reads it
      metadata.json         session id, protocol tuple E and its hash, policy hash, CE
      manifest.sha256       sha256sum of the three files above

The truth is expressed in wire order (row i of frame s), so an attack's per-row
predictions are scored without knowing the secret permutation.
"""

from __future__ import annotations

import os

import numpy as np
from safetensors.numpy import load_file, save_file

from lla.evidence import files, manifest

MESSAGES = "messages.safetensors"
TRUTH = "truth.safetensors"
METADATA = "metadata.json"


def truth_from_perm(perm: np.ndarray, blocks: np.ndarray, n_real: int) -> dict:
  """Wire-order truth from perm [S, M] and the blocks [S, R + 1] that were trained on."""
  real = perm < n_real
  src = np.where(real, perm, 0)
  take = lambda tokens: np.where(real, np.take_along_axis(tokens, src, axis=1), -1)
  return {"real_mask": real.astype(np.uint8),
          "input_tokens": take(blocks[:, :-1]).astype(np.int32),
          "target_tokens": take(blocks[:, 1:]).astype(np.int32)}


def write(directory: str, forward: np.ndarray, gradient: np.ndarray, truth: dict,
          metadata: dict) -> str:
  """Writes a capture directory (fails if one is already there) and returns its manifest hash."""
  os.makedirs(directory, exist_ok=True)
  steps = np.arange(forward.shape[0], dtype=np.int32)
  tmp = os.path.join(directory, ".tmp-")
  # Frames reach the cloud in step order, so order equals step in this system.
  save_file({"forward": np.ascontiguousarray(forward, np.float32),
             "gradient": np.ascontiguousarray(gradient, np.float32),
             "step": steps, "order": steps}, tmp + MESSAGES)
  save_file({k: np.ascontiguousarray(v) for k, v in truth.items()}, tmp + TRUTH)
  os.replace(tmp + MESSAGES, os.path.join(directory, MESSAGES))
  os.replace(tmp + TRUTH, os.path.join(directory, TRUTH))
  files.atomic_write_json(os.path.join(directory, METADATA), metadata, overwrite=True)
  path = manifest.write_manifest(directory, overwrite=True)
  return files.sha256_file(path)


def is_complete(directory: str) -> bool:
  """True if the directory holds a capture whose manifest verifies."""
  return (os.path.exists(os.path.join(directory, manifest.MANIFEST_NAME))
          and manifest.verify_manifest(directory).ok)


def read(directory: str) -> tuple[dict, dict, dict, str]:
  """(messages, truth, metadata, manifest sha256) of a verified capture; raises if tampered."""
  report = manifest.verify_manifest(directory)
  if not report.ok:
    raise ValueError(f"{directory}: capture fails its manifest: {report.problems()}")
  return (load_file(os.path.join(directory, MESSAGES)), load_file(os.path.join(directory, TRUTH)),
          files.read_json(os.path.join(directory, METADATA)),
          files.sha256_file(os.path.join(directory, manifest.MANIFEST_NAME)))
