"""Hashing, canonical JSON and atomic file writes shared by the evidence layer.

Every finished artefact is written through `atomic_write_bytes`: the bytes go to
a temporary file in the target's directory, are fsync'ed, and are then moved
into place, so an interrupted run leaves either the old file or the new one,
never half of one. Finished results are never overwritten unless the caller
says so explicitly.
"""

import hashlib
import json
import os
import tempfile

import numpy as np

_BLOCK = 1 << 20


def canonical_json(obj) -> bytes:
  """Canonical JSON bytes: sorted keys, no whitespace, UTF-8, trailing newline."""
  text = json.dumps(obj, sort_keys=True, separators=(",", ":"),
                    ensure_ascii=False, allow_nan=False)
  return (text + "\n").encode("utf-8")


def sha256_bytes(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def int32_sha256(array) -> str:
  """Hex sha256 of an integer array's int32 bytes (C order): predictions compared across
  runs."""
  return sha256_bytes(np.ascontiguousarray(array, np.int32).tobytes())


def sha256_file(path: str) -> str:
  """Hex sha256 of a file's bytes, streamed so large captures fit in memory."""
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(_BLOCK), b""):
      h.update(block)
  return h.hexdigest()


def atomic_write_bytes(path: str, data: bytes, overwrite: bool = False) -> None:
  """Writes `data` to `path` atomically.

  Args:
    path: destination file; its directory must exist.
    data: the complete file contents.
    overwrite: if False (the default) an existing `path` raises
      FileExistsError instead of being replaced; the check and the write are
      one atomic `os.link`, so two writers cannot both win.
  """
  directory = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    if overwrite:
      os.replace(tmp, path)
    else:
      try:
        os.link(tmp, path)
      except FileExistsError:
        raise FileExistsError(
            f"{path}: refusing to overwrite a finished result") from None
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)


def atomic_write_json(path: str, obj, overwrite: bool = False) -> None:
  atomic_write_bytes(path, canonical_json(obj), overwrite=overwrite)


def read_json(path: str):
  """Reads a JSON file, naming the file in any error."""
  try:
    with open(path, "rb") as f:
      return json.loads(f.read().decode("utf-8"))
  except FileNotFoundError:
    raise FileNotFoundError(f"{path}: file not found") from None
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{path}: not valid JSON ({e})") from None


def load_token_matrix(path: str, what: str):
  """A [B, T] integer .npy (token ids or predictions), never unpickled; errors name `path`."""
  try:
    arr = np.load(path, allow_pickle=False)
  except FileNotFoundError:
    raise FileNotFoundError(f"{path}: {what} file not found") from None
  except ValueError as e:
    raise ValueError(f"{path}: not a readable .npy array ({e})") from None
  if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.integer):
    raise ValueError(f"{path}: expected [B, T] integer {what}, got {arr.dtype}{list(arr.shape)}")
  return arr
