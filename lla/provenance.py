"""The software and hardware a result was computed with, and how two such records differ.

Bit-for-bit regeneration (PROTOCOL section 3) holds on one software stack and device
kind; across machines XLA may fuse, vectorise or pick kernels differently. Every record
stores `current()`, and `lla.replay.regenerate` names each difference between a record's
provenance and its own beside its verdict, so that a mismatch on another machine comes
with its likely cause (vec2text issue #53 reports exactly this drift).
"""

from __future__ import annotations

import enum
import os
import platform
import subprocess

import jax
import jaxlib
import numpy as np

import lla
from lla import allocator

# jax config options that change numerics or random draws (the rest are diagnostics).
NUMERIC_CONFIG = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl",
                  "jax_threefry_partitionable", "jax_numpy_dtype_promotion",
                  "jax_softmax_custom_jvp")
# Fields that name this checkout or process rather than the computation (the allocator
# changes where buffers live, never a value).
_NOT_NUMERIC = ("git_commit", "lla_version", "allocator")


def _git_commit() -> str:
  try:
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=os.path.dirname(lla.__file__), timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return ""


def _plain(value):
  """A config value as JSON (enums by their value, other objects by their text)."""
  value = value.value if isinstance(value, enum.Enum) else value
  return value if isinstance(value, (bool, int, float, str)) or value is None else str(value)


def current() -> dict:
  """This process's provenance: versions, XLA flags, numeric jax config, devices, and the
  memory allocator (lla.allocator: which one ran, with which settings)."""
  device = jax.devices()[0]
  config = {name: jax.config.values[name] for name in NUMERIC_CONFIG
            if name in jax.config.values}
  return {"lla_version": lla.__version__, "git_commit": _git_commit() or "unknown",
          "python_version": platform.python_version(), "numpy_version": np.__version__,
          "jax_version": jax.__version__, "jaxlib_version": jaxlib.__version__,
          "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "jax_config": {k: _plain(v) for k, v in sorted(config.items())},
          "platform": device.platform, "device_kind": device.device_kind,
          "device_count": jax.device_count(), "allocator": allocator.record()}


def differences(recorded: dict, now: dict) -> list[str]:
  """'field: recorded X, now Y' for every field that differs (nested config flattened);
  a field the record lacks is named as 'not recorded'."""
  def flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
      if isinstance(v, dict):
        out.update(flat(v, f"{prefix}{k}."))
      else:
        out[f"{prefix}{k}"] = v
    return out
  old, new = flat(recorded), flat(now)
  lines = []
  for key in sorted(set(old) | set(new)):
    if old.get(key, "<absent>") != new.get(key, "<absent>"):
      was = "not recorded" if key not in old else f"recorded {old[key]!r}"
      lines.append(f"{key}: {was}, now {new.get(key, '<absent>')!r}")
  return lines


def numeric(difference: str) -> bool:
  """Whether a `differences` line can change numbers (versions, flags, devices)."""
  return difference.split(":")[0].split(".")[0] not in _NOT_NUMERIC
