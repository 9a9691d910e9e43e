"""Process-wide JAX settings that every lla binary applies before its first computation.

The persistent compilation cache: XLA executables are written to disk keyed by the
computation and the compiler, so a second process that runs the same (model, cut, budget,
chunk shape) loads them instead of compiling again. Within one process the attack
runtime's executable cache (lla.attacks.workspace.compiled) already compiles each once.

  $LLA_COMPILATION_CACHE_DIR, else $LLA_CACHE_DIR/jax, else $XDG_CACHE_HOME/lla/jax or
  ~/.cache/lla/jax; "off" disables it.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

ENV_VAR = "LLA_COMPILATION_CACHE_DIR"


def default_compilation_cache_dir() -> Path | None:
  """Where compiled executables are cached, or None when the cache is turned off."""
  explicit = os.environ.get(ENV_VAR)
  if explicit:
    return None if explicit == "off" else Path(explicit).expanduser()
  if os.environ.get("LLA_CACHE_DIR"):
    return Path(os.environ["LLA_CACHE_DIR"]).expanduser() / "jax"
  xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
  return Path(xdg) / "lla" / "jax"


def configure(compilation_cache_dir: str | os.PathLike | None = None) -> Path | None:
  """Turns on JAX's persistent compilation cache; returns its directory (None: off).

  Every executable is cached, however short its compilation: an attack compiles dozens of
  small ones (candidate rankings, one-position steps) whose total dominates a cold start.
  """
  path = (Path(compilation_cache_dir) if compilation_cache_dir is not None
          else default_compilation_cache_dir())
  if path is None:
    return None
  path.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path
