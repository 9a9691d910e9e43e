"""The process's memory allocator: glibc malloc tuned so that the large buffers XLA:CPU
allocates on every executable call are reused rather than mapped and unmapped.

Why (issue 23): XLA:CPU allocates each call's temporaries and results with posix_memalign
and frees them when the call ends. On small models the attacks make thousands of such
calls with large buffers (TAG's and LAMP's [B, T, V] soft tokens are 51 MB at B 8 x T 32 x
V 50,257; their gradients' temporaries reach 0.9 GB). glibc serves every block above its
mmap threshold (128 KiB, dynamically up to 32 MiB) with a fresh mmap and munmaps it on free:
the next call faults every page in again. A replay of five attacks on a 4-layer random
GPT-2 spent 44% of its CPU time in the kernel (17 million minor faults); tuned as below,
5% (0.8 million), as with TCMalloc preloaded (experiments/bench_alloc.py;
docs/benchmarks.md, "Memory churn (allocator)").

What, in two steps, neither needing root, a dependency or a preload:

`apply()`, at `import lla` (before JAX starts its threads), calls mallopt through ctypes:

  M_MMAP_MAX 0              no block is served by mmap: large ones come from the heap and
                            go back to it
  M_ARENA_MAX 1             one heap for every thread: a thread's arena is a 64 MiB heap
                            that a larger block cannot live in (it would be mmapped anyway)
  M_TRIM_THRESHOLD 2 GiB-1  the heap's free top goes back to the OS only above 2 GiB (mallopt
                            takes an int; this also stops the dynamic mmap threshold)
  M_TOP_PAD 64 MiB          the heap grows by at least 64 MiB at a time

`reexec()`, called first thing by every binary (experiments/__init__.py) and by the test
suite (tests/conftest.py), restarts the process once with the same settings as
$GLIBC_TUNABLES plus one mallopt cannot set, `glibc.malloc.tcache_count=0`: posix_memalign
splits small remainders off each large block, the per-thread cache keeps them, and they
wall the freed block in, so that the next aligned request of the same size does not fit
and the heap grows instead of reusing it (mallopt alone: 11% kernel time, 1.3 million
faults on the replay above).

The cost: the heap keeps its high-water mark (freed memory is reused, not returned).

$LLA_ALLOCATOR selects:

  tuned    (default) both steps, where malloc is glibc's
  mallopt  `apply()` alone (no restart)
  system   malloc as the process found it (glibc's defaults, or an LD_PRELOADed allocator)

$LLA_MALLOPT overrides or adds settings ("mmap_max=0,arena_max=1,top_pad=67108864"; names
are glibc's M_* without the prefix, lower case). Where malloc is not glibc's (musl,
another libc), nothing is applied and one line on stderr says so; where another allocator
was preloaded (LD_PRELOAD of TCMalloc, jemalloc, mimalloc), it is used as it is, silently.
`record()` is what a run's provenance records: which allocator ran and with which settings.
"""

from __future__ import annotations

import ctypes
import os
import sys

ENV_VAR = "LLA_ALLOCATOR"
MALLOPT_ENV_VAR = "LLA_MALLOPT"
MODES = ("tuned", "mallopt", "system")
# Set in the environment of the process `reexec` starts (and so of its children): no loop.
REEXEC_ENV_VAR = "LLA_ALLOCATOR_REEXEC"
# glibc's <malloc.h> parameter numbers.
PARAMS = {"mxfast": 1, "trim_threshold": -1, "top_pad": -2, "mmap_threshold": -3,
          "mmap_max": -4, "arena_test": -7, "arena_max": -8}
TUNED = {"mmap_max": 0, "arena_max": 1, "trim_threshold": 2**31 - 1, "top_pad": 64 << 20}
# The same settings as glibc tunables (read once, when a process starts), plus the one
# mallopt cannot set: no per-thread cache (tcache). XLA:CPU allocates its buffers with
# posix_memalign, whose small trailing remainders land in the tcache, where they never
# coalesce: each freed large block stays walled in and slightly too small for the next
# aligned request of the same size, so the heap grows instead of reusing it.
TUNABLES = ":".join(["glibc.malloc.tcache_count=0"]
                    + [f"glibc.malloc.{name}={value}" for name, value in TUNED.items()])

_STATE: dict | None = None  # What `apply` did, once per process.


class _DlInfo(ctypes.Structure):
  _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
              ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _malloc_library() -> str:
  """The file of the library whose `malloc` this process calls (dladdr), or ""."""
  try:
    process = ctypes.CDLL(None)
    info = _DlInfo()
    address = ctypes.cast(process.malloc, ctypes.c_void_p)
    if process.dladdr(address, ctypes.byref(info)) and info.dli_fname:
      return os.fsdecode(info.dli_fname)
  except (OSError, AttributeError):
    pass
  return ""


def _glibc():
  """(libc handle, glibc version) when malloc is glibc's and mallopt reachable, else None."""
  try:
    libc = ctypes.CDLL("libc.so.6")
    version = libc.gnu_get_libc_version
    version.restype = ctypes.c_char_p
    mallopt = libc.mallopt
  except (OSError, AttributeError):
    return None
  mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
  return libc, version().decode()


def parse(text: str) -> dict[str, int]:
  """'name=value,...' (names of PARAMS) as a dict; raises ValueError naming a bad entry."""
  out = {}
  for item in filter(None, (s.strip() for s in text.split(","))):
    name, _, value = item.partition("=")
    if name not in PARAMS or not value.lstrip("-").isdigit():
      raise ValueError(f"${MALLOPT_ENV_VAR}: {item!r} is not name=integer with name one of "
                       f"{sorted(PARAMS)}")
    out[name] = int(value)
  return out


def apply() -> dict:
  """Tunes malloc once per process (module docstring) and returns `record()`."""
  global _STATE
  if _STATE is not None:
    return record()
  mode = os.environ.get(ENV_VAR) or "tuned"
  if mode not in MODES:
    raise ValueError(f"${ENV_VAR} must be one of {MODES}, got {mode!r}")
  library = _malloc_library()
  state = {"name": "", "mode": mode, "malloc_library": os.path.basename(library) or "unknown",
           "preload": os.environ.get("LD_PRELOAD", ""), "mallopt": {}}
  glibc = _glibc()
  interposed = bool(library) and not os.path.basename(library).startswith("libc.so")
  if glibc is None or interposed:
    state["name"] = os.path.basename(library) or "unknown"
    if glibc is None and mode != "system" and sys.platform.startswith("linux"):
      print(f"lla: malloc is not glibc's ({state['name']}): left untuned, so large "
            "XLA:CPU buffers may be remapped on every call (lla/allocator.py)", file=sys.stderr)
  else:
    libc, version = glibc
    state["name"] = f"glibc {version}"
    if mode != "system":
      settings = {**TUNED, **parse(os.environ.get(MALLOPT_ENV_VAR, ""))}
      for name, value in settings.items():
        if libc.mallopt(PARAMS[name], value) != 1:
          raise OSError(f"mallopt({name}={value}) refused by glibc {version}")
      state["mallopt"] = settings
  state["glibc_tunables"] = _tunables_active()
  _STATE = state
  return record()


def reexec_needed() -> bool:
  """Whether `reexec` would restart this process."""
  return not (os.environ.get(REEXEC_ENV_VAR) or (os.environ.get(ENV_VAR) or "tuned") != "tuned"
              or not sys.platform.startswith("linux") or _glibc() is None
              or not os.path.basename(_malloc_library()).startswith("libc.so"))


def reexec(argv: list[str] | None = None) -> None:
  """Restarts this process once with `TUNABLES` in $GLIBC_TUNABLES (mode "tuned", glibc's
  malloc, no allocator preloaded); call it first thing in a binary, before heavy imports.

  `argv` defaults to the interpreter's own command line (sys.orig_argv). Returns (nothing
  done) when already restarted, in another mode, or without glibc; where the restart fails,
  one line on stderr says so and the process continues with mallopt's settings alone.
  """
  if not reexec_needed():
    return
  env = dict(os.environ)
  env[REEXEC_ENV_VAR] = "1"
  env["GLIBC_TUNABLES"] = ":".join(filter(None, (env.get("GLIBC_TUNABLES"), TUNABLES)))
  sys.stdout.flush()
  sys.stderr.flush()
  try:
    os.execve(sys.executable, argv or sys.orig_argv, env)
  except OSError as e:
    print(f"lla: could not restart with glibc tunables ({e}): mallopt settings only "
          "(lla/allocator.py)", file=sys.stderr)


def _tunables_active() -> str:
  """Our tunables, when this process started with them (glibc reads them at startup)."""
  if os.environ.get(REEXEC_ENV_VAR) and TUNABLES in os.environ.get("GLIBC_TUNABLES", ""):
    return TUNABLES
  return ""


def record() -> dict:
  """Which allocator this process runs and how it was set (for provenance)."""
  if _STATE is None:
    return {"allocator": "not applied"}
  return {k: (dict(v) if isinstance(v, dict) else v) for k, v in _STATE.items()}
