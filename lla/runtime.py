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
                 choice for float32 GEMMs), and the vocabulary scans of lla_kernels.vocab_topk
                 take bfloat16 operands with float32 accumulation on every backend
  auto           float32 on CPU, tensorfloat32 on GPU and TPU

It is set once, through JAX's `jax_default_matmul_precision`, so that every jitted
function sees it when traced; `precision_record()` is what a run records. On CPU only
float32 exists: asking for another is an error rather than a run that says bf16 and
computed float32.

Compiled executables are dropped before they exhaust the kernel's memory mappings
(`release_compiled_when_crowded`): XLA:CPU maps each executable's code and data into
memory (about six mappings each), JAX's caches keep every executable for the life of the
process, and Linux refuses an mmap beyond vm.max_map_count (65,530 by default), which
XLA:CPU does not survive (a segmentation fault while compiling, no error). The tiny main
job alone reached about 17,000 mappings; a study or a test session that runs longer
crosses the limit. Long-running drivers call it between units of work (main-job phases,
every attack through lla.replay.driver.execute, test modules): when the process holds more
than half the limit, every cache is dropped and what runs next recompiles (from the
persistent cache where it is on).

Several processes that share one machine (pytest-xdist's workers in the test suite) can
each take a disjoint share of its CPUs (`pin_to_cpu_share`), set before the process's first
computation: XLA:CPU sizes its intra-op thread pool from the CPUs a process may run on, and
its idle threads spin before they sleep, so two unpinned processes on two cores take turns
at spinning. Four compile-heavy test files under `pytest -n 2`: 183-185 s pinned against
220-238 s unpinned, 342 user seconds against 412 (docs/benchmarks.md section 13).

Compile cost is counted from JAX's own monitoring events (`compile_totals`, `compile_since`):
every trace to a jaxpr, lowering to MLIR and backend compilation (an XLA compile, or a load
from the persistent cache) JAX runs in this process, however it was reached (lla's
executable cache, a plain jax.jit call, an eager op). Attack records and the main job's
phases carry the differences (docs/run_format.md, lla.study.report).
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

from absl import logging
import jax
from jax import monitoring

ENV_VAR = "LLA_COMPILATION_CACHE_DIR"
PRECISION_ENV_VAR = "LLA_MATMUL_PRECISION"
PRECISIONS = ("float32", "tensorfloat32", "bfloat16")
ACCELERATOR_PRECISION = "tensorfloat32"
MAP_COUNT_LIMIT_FILE = "/proc/sys/vm/max_map_count"
# Held above this fraction of vm.max_map_count, compiled executables are dropped: the other
# half is the room left for the work between two checks (the whole tiny main job took about
# 17,000 mappings, a quarter of the limit).
CROWDED_FRACTION = 0.5
_CACHE_CLEARERS: list[Callable[[], None]] = []  # lla's own executable caches
_JAX_PRECISION = {"float32": "highest", "tensorfloat32": "tensorfloat32",
                  "bfloat16": "bfloat16"}
# JAX's monitoring events of a compilation (jax 0.10.2: jax/_src/dispatch.py and
# compiler.py, compilation_cache.py). The backend's duration spans the persistent cache's
# look-up: a hit's load is counted there, as the compile it replaced.
_DURATIONS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
              "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
              "/jax/core/compile/backend_compile_duration": "backend_s"}
_COUNTS = {"/jax/core/compile/backend_compile_duration": "executables",
           "/jax/compilation_cache/cache_hits": "cache_hits",
           "/jax/compilation_cache/cache_misses": "cache_writes"}
_COMPILE_TOTALS = dict.fromkeys(("trace_s", "lower_s", "backend_s"), 0.0) | dict.fromkeys(
    ("executables", "cache_hits", "cache_writes"), 0)
_COMPILE_LOCK = threading.Lock()
_LISTENING: list[bool] = []  # [True] once the listeners are registered


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
  Processes given the same directory share it (a sweep's workers are given their
  driver's, `worker_environment`): each loads what another compiled with the same key
  instead of compiling it again (tests/test_runtime_shared_cache.py). In a job across
  processes (lla.dist) JAX writes from process 0 alone: hosts share its entries only
  through a directory on a filesystem they all mount ($LLA_COMPILATION_CACHE_DIR). Two that compile one
  program at once both write it; one that reads an entry still being written fails to load
  it, warns and compiles (JAX's compiler._cache_read), never runs a broken executable.
  """
  configure_matmul_precision(matmul_precision)
  path = (Path(compilation_cache_dir) if compilation_cache_dir is not None
          else default_compilation_cache_dir())
  if path is None:
    return None
  compile_totals()  # counting from the first compilation on
  path.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(path))
  # JAX persists by default only executables that took >= 1 s to compile, and its size
  # floor 0 means "the cache's backend may raise it" (jax/_src/compilation_cache.py):
  # every other process (a sweep's workers, a job's followers, the next run) would compile
  # the many small ones again. No time floor, and -1: no size floor that anything overrides.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  return path


def _on_duration(event: str, seconds: float, **unused_metadata) -> None:
  if event in _DURATIONS:
    with _COMPILE_LOCK:
      _COMPILE_TOTALS[_DURATIONS[event]] += seconds
      if event in _COUNTS:
        _COMPILE_TOTALS[_COUNTS[event]] += 1


def _on_event(event: str, **unused_metadata) -> None:
  if event in _COUNTS:
    with _COMPILE_LOCK:
      _COMPILE_TOTALS[_COUNTS[event]] += 1


def compile_totals() -> dict:
  """What this process has compiled so far, from JAX's monitoring events: seconds tracing
  (trace_s), lowering (lower_s) and in the backend (backend_s: XLA's compile, or the
  persistent cache's load), executables built (each backend compilation: one executable,
  distinct from every other this process holds while its in-memory caches are not
  dropped, `release_compiled_when_crowded`), how many of them the persistent cache gave
  (cache_hits) and how many compiles it stored (cache_writes). The first call registers
  the listeners: compilations before it are not counted."""
  with _COMPILE_LOCK:
    if not _LISTENING:
      monitoring.register_event_duration_secs_listener(_on_duration)
      monitoring.register_event_listener(_on_event)
      _LISTENING.append(True)
    return dict(_COMPILE_TOTALS)


def compile_since(before: dict) -> dict:
  """`compile_totals()` now minus `before` (an earlier `compile_totals()`), with
  `seconds` (trace + lower + backend) and `compiled` (executables that XLA compiled,
  i.e. not loaded from the persistent cache)."""
  now = compile_totals()
  spent = {key: now[key] - before.get(key, 0) for key in now}
  spent["seconds"] = spent["trace_s"] + spent["lower_s"] + spent["backend_s"]
  spent["compiled"] = spent["executables"] - spent["cache_hits"]
  return spent


@contextlib.contextmanager
def compile_meter():
  """Yields a dict that, on exit, holds what this process compiled inside the block
  (`compile_since`: seconds, trace_s, lower_s, backend_s, executables,
  cache_hits, cache_writes, compiled) with the block's wall seconds (wall_s) and the rest
  of them (run_s = wall_s - seconds). Unlike an attack record's compile_s (lla's
  executable cache, shared stages charged in full to each attack that uses them), it
  counts every compilation JAX ran here, and only once."""
  spent = {}
  before, start = compile_totals(), time.perf_counter()
  try:
    yield spent
  finally:
    wall = time.perf_counter() - start
    spent.update(compile_since(before), wall_s=wall)
    spent["run_s"] = wall - spent["seconds"]


def worker_environment() -> dict[str, str]:
  """The environment that points a process this one starts at this process's persistent
  compilation cache ($LLA_COMPILATION_CACHE_DIR: its directory, or "off"), so that neither
  compiles what the other did."""
  directory = jax.config.jax_compilation_cache_dir
  return {ENV_VAR: str(directory) if directory else "off"}


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
  from lla_kernels import vocab_topk  # the vocabulary scans read the same setting

  setting = jax.config.jax_default_matmul_precision
  return {"matmul_precision": vocab_topk.matmul_precision(setting),
          "jax_default_matmul_precision": setting, "backend": jax.default_backend()}


def cpu_share(index: int, count: int, cpus: Sequence[int]) -> list[int] | None:
  """The CPUs of process `index` of `count` processes that split `cpus`: contiguous, disjoint
  and as equal as can be (the first `len(cpus) % count` processes take one more), or None
  when there are fewer CPUs than processes (a share would be a fraction of a CPU)."""
  if not 0 <= index < count:
    raise ValueError(f"process index {index} is not one of {count} processes")
  cpus = sorted(cpus)
  if count > len(cpus):
    return None
  size, extra = divmod(len(cpus), count)
  start = index * size + min(index, extra)
  return cpus[start:start + size + (index < extra)]


def pin_to_cpu_share(index: int, count: int) -> list[int] | None:
  """Restricts this process (the calling thread and every thread it starts afterwards,
  XLA's pool among them) to its `cpu_share` of the CPUs it may run on now; returns the
  share, or None (nothing changed) where there is no share. Call it before the first
  computation: a pool already started keeps its size (module docstring)."""
  share = cpu_share(index, count, os.sched_getaffinity(0))
  if share is not None:
    os.sched_setaffinity(0, share)
  return share


def register_executable_cache(clear: Callable[[], None]) -> None:
  """Registers `clear`, which empties one of lla's own caches of compiled executables
  (lla.attacks.workspace.compiled), to run with JAX's when executables are dropped."""
  _CACHE_CLEARERS.append(clear)


def memory_mappings() -> tuple[int, int] | None:
  """(memory mappings this process holds, the kernel's limit vm.max_map_count), or None
  where /proc does not say (not Linux)."""
  try:
    with open(MAP_COUNT_LIMIT_FILE) as f:
      limit = int(f.read())
    with open("/proc/self/maps", "rb") as f:
      held = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
  except OSError:
    return None
  return held, limit


def held_arrays(largest: int = 3) -> dict:
  """The JAX arrays alive in this process: how many, their bytes on this host's devices
  in MB, and the `largest` (dtype, shape) groups by bytes ("float32[49152,576] x 4:
  432.0 MB"). Set beside malloc's bytes in use (lla.allocator.heap_usage), this says how
  much of the heap the arrays a run still references hold; on CPU their buffers are
  malloc's blocks, the rest is numpy, compiled executables and Python."""
  groups: dict[str, list[int]] = {}
  for array in jax.live_arrays():
    size = sum(shard.data.nbytes for shard in array.addressable_shards)
    group = groups.setdefault(f"{array.dtype}{list(array.shape)}".replace(" ", ""), [0, 0])
    group[0] += 1
    group[1] += size
  ranked = sorted(groups.items(), key=lambda item: -item[1][1])[:largest]
  return {"count": sum(count for count, _ in groups.values()),
          "mb": sum(size for _, size in groups.values()) / 2**20,
          "largest": [f"{name} x {count}: {size / 2**20:.1f} MB"
                      for name, (count, size) in ranked]}


def release_compiled_when_crowded(fraction: float = CROWDED_FRACTION) -> bool:
  """Drops every cached compiled executable (JAX's and lla's) when this process holds
  more than `fraction` of the kernel's memory-mapping limit (module docstring); returns
  whether it did. Executables still referenced elsewhere stay alive; the rest are freed
  and their mappings unmapped."""
  mappings = memory_mappings()
  if mappings is None or mappings[0] <= fraction * mappings[1]:
    return False
  for clear in _CACHE_CLEARERS:
    clear()
  jax.clear_caches()
  gc.collect()  # executables held in reference cycles
  after = memory_mappings()
  logging.info("compiled executables dropped: %d of vm.max_map_count %d memory mappings "
               "held, %s after", mappings[0], mappings[1], after and after[0])
  return True
