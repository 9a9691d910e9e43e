"""Process-wide JAX settings that every lla binary applies before its first computation.

The persistent compilation cache: XLA executables are written to disk keyed by the
computation and the compiler, so a second process that runs the same (model, cut, budget,
chunk shape) loads them instead of compiling again. Within one process the attack
runtime's executable cache (lla.attacks.workspace.compiled) already compiles each once.

  $LLA_COMPILATION_CACHE_DIR, else $LLA_CACHE_DIR/jax, else $XDG_CACHE_HOME/lla/jax or
  ~/.cache/lla/jax; "off" disables it.

The matmul precision of every float32 matrix product ($LLA_MATMUL_PRECISION):

  float32        exact float32 products ("highest"); what XLA:CPU always computes, the
                 CPU default
  tensorfloat32  TF32 inputs (10-bit mantissa), float32 accumulation on GPU; three bf16
                 passes on TPU. The default on GPU and TPU: tensor-core speed with 8x
                 bf16's mantissa, the closest to float32 while the >= 99.9% agreement
                 with float32 has not been measured on an accelerator
  bfloat16       JAX's "bfloat16" (XLA's DEFAULT: one bf16 pass on TPU; on GPU XLA's own
                 choice for float32 GEMMs), and the vocabulary scans of kernels.vocab_topk
                 take bfloat16 operands with float32 accumulation on every backend
  auto           float32 on CPU, tensorfloat32 on GPU and TPU

It is set once, through JAX's `jax_default_matmul_precision`, so that every jitted
function sees it when traced; `precision_record()` is what a run records. On CPU only
float32 exists: asking for another is an error rather than a run that says bf16 and
computed float32.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

ENV_VAR = "LLA_COMPILATION_CACHE_DIR"
PRECISION_ENV_VAR = "LLA_MATMUL_PRECISION"
PRECISIONS = ("float32", "tensorfloat32", "bfloat16")
ACCELERATOR_PRECISION = "tensorfloat32"
_JAX_PRECISION = {"float32": "highest", "tensorfloat32": "tensorfloat32",
                  "bfloat16": "bfloat16"}


def default_compilation_cache_dir() -> Path | None:
  """Where compiled executables are cached, or None when the cache is turned off."""
  explicit = os.environ.get(ENV_VAR)
  if explicit:
    return None if explicit == "off" else Path(explicit).expanduser()
  if os.environ.get("LLA_CACHE_DIR"):
    return Path(os.environ["LLA_CACHE_DIR"]).expanduser() / "jax"
  xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
  return Path(xdg) / "lla" / "jax"


def configure(compilation_cache_dir: str | os.PathLike | None = None,
              matmul_precision: str | None = None) -> Path | None:
  """Sets the matmul precision (`configure_matmul_precision`) and turns on JAX's
  persistent compilation cache; returns the cache's directory (None: off).

  Every executable is cached, however short its compilation: an attack compiles dozens of
  small ones (candidate rankings, one-position steps) whose total dominates a cold start.
  """
  configure_matmul_precision(matmul_precision)
  path = (Path(compilation_cache_dir) if compilation_cache_dir is not None
          else default_compilation_cache_dir())
  if path is None:
    return None
  path.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path


def resolve_matmul_precision(requested: str, backend: str) -> str:
  """The precision mode (module docstring) that `requested` means on `backend`."""
  if requested == "auto":
    return "float32" if backend == "cpu" else ACCELERATOR_PRECISION
  if requested not in PRECISIONS:
    raise ValueError(f"{PRECISION_ENV_VAR} must be auto or one of {PRECISIONS}, got "
                     f"{requested!r}")
  if backend == "cpu" and requested != "float32":
    raise ValueError(f"{PRECISION_ENV_VAR}={requested}: XLA:CPU multiplies float32 in float32; "
                     "tensorfloat32 and bfloat16 exist on GPU and TPU only")
  return requested


def configure_matmul_precision(requested: str | None = None) -> str:
  """Sets JAX's default matmul precision from `requested`, else $LLA_MATMUL_PRECISION,
  else "auto"; returns the mode. On CPU (float32 only) JAX's setting is left alone, so
  that CPU executables are exactly those of a run without it."""
  backend = jax.default_backend()
  mode = resolve_matmul_precision(requested or os.environ.get(PRECISION_ENV_VAR) or "auto",
                                  backend)
  if backend != "cpu":
    jax.config.update("jax_default_matmul_precision", _JAX_PRECISION[mode])
  return mode


def precision_record() -> dict:
  """What a run records of its arithmetic: the mode, JAX's setting, the backend."""
  from kernels import vocab_topk  # the vocabulary scans read the same setting

  setting = jax.config.jax_default_matmul_precision
  return {"matmul_precision": vocab_topk.matmul_precision(setting),
          "jax_default_matmul_precision": setting, "backend": jax.default_backend()}
