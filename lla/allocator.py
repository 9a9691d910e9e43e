"""The process's memory allocator: glibc malloc tuned so that the large buffers XLA:CPU
allocates on every executable call are reused rather than mapped and unmapped.

Why (issue 23): XLA:CPU allocates each call's temporaries and results with posix_memalign
and frees them when the call ends. On small models the attacks and the training loops make
thousands of such calls with large buffers (TAG's and LAMP's [B, T, V] soft tokens are 51 MB
at B 8 x T 32 x V 50,257; their gradients' temporaries reach 0.9 GB; a pre-training step
frees about 3 GB). glibc serves every block above its mmap threshold (128 KiB, dynamically
up to 32 MiB) with a fresh mmap and munmaps it on free, and gives the heap's free top back
to the OS above its trim threshold: either way the next call faults every page in again.

What: `apply()`, at `import lla` (before JAX starts its threads), calls mallopt through
ctypes:

  M_MMAP_MAX 0              no block is served by mmap: large ones come from the heap and
                            go back to it
  M_ARENA_MAX 1             one heap for every thread: a thread's arena is a 64 MiB heap
                            that a larger block cannot live in (it would be mmapped anyway)
  M_TRIM_THRESHOLD -1       the heap's free top is never given back (glibc: "-1 disables
                            trimming"); this also stops the dynamic mmap threshold
  M_TOP_PAD 64 MiB          the heap grows by at least 64 MiB at a time

Arenas are fixed early: glibc gives each thread an arena of its own at the thread's first
malloc while the limit is unset, and mallopt cannot take one back. A process that starts
threads before `import lla` (pytest-xdist's workers start execnet's, Ray's workers gRPC's,
a Jupyter kernel its own) keeps their arenas, and XLA:CPU's threads started later share
them with the main heap. Such an arena grows in 64 MiB heaps, so a block larger than that
is mapped and unmapped on every call whatever M_MMAP_MAX says: the tiny main job in a
pytest-xdist worker faulted 68 M pages (160 s of system time) against 5.3 M alone
(docs/benchmarks.md, "Memory churn"). `apply()` counts the arenas (`arena_count()`,
recorded) and says so in one line on stderr where there is more than one;
`environment_for_workers()` is the environment to start such a process with: glibc reads
$GLIBC_TUNABLES (glibc.malloc.arena_max) before the process's first thread runs.

The cost is memory: the heap keeps its high-water mark, plus the large blocks that glibc's
per-thread cache walls in (posix_memalign splits a small remainder off each block; the
cache keeps up to 7 such remainders per size, and the block beside one cannot coalesce
until it leaves). Turning the cache off (glibc.malloc.tcache_count=0, which takes a restart
of the process) removes that, but every small malloc then goes to the one arena: 60 steps
of the main job's pre-training took 173 s of user time that way against 145 s with the
cache (docs/benchmarks.md, "Memory churn").

$LLA_ALLOCATOR selects:

  tuned    (default) the settings above, where malloc is glibc's
  system   malloc as the process found it (glibc's defaults, or an LD_PRELOADed allocator)

$LLA_MALLOPT overrides or adds settings ("mmap_max=0,arena_max=1,top_pad=67108864"; names
are glibc's M_* without the prefix, lower case). Where malloc is not glibc's (musl,
another libc), nothing is applied and one line on stderr says so; where another allocator
was preloaded (LD_PRELOAD of TCMalloc, jemalloc, mimalloc), it is used as it is, silently.
`heap_usage()` says what malloc holds in use and free; `release_free()` returns the free
blocks' pages to the OS between large units of work once more than a limit of them is
resident (1/8 of physical memory; $LLA_RESIDENT_FREE_MB sets it in MB). `record()` is what a
run's provenance records: which allocator ran and with which settings.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Mapping

ENV_VAR = "LLA_ALLOCATOR"
MALLOPT_ENV_VAR = "LLA_MALLOPT"
RESIDENT_FREE_ENV_VAR = "LLA_RESIDENT_FREE_MB"
TUNABLES_ENV_VAR = "GLIBC_TUNABLES"
ARENA_TUNABLE = "glibc.malloc.arena_max"
MODES = ("tuned", "system")
# The share of physical memory the heap's free pages may keep resident before release_free
# gives them back: below it, giving them back only buys the next unit of work its faults.
RESIDENT_FREE_FRACTION = 1 / 8
# glibc's <malloc.h> parameter numbers.
PARAMS = {"mxfast": 1, "trim_threshold": -1, "top_pad": -2, "mmap_threshold": -3,
          "mmap_max": -4, "arena_test": -7, "arena_max": -8}
TUNED = {"mmap_max": 0, "arena_max": 1, "trim_threshold": -1, "top_pad": 64 << 20}

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
           "preload": os.environ.get("LD_PRELOAD", ""), "mallopt": {},
           "resident_free_limit_mb": round(resident_free_limit_mb(), 1),
           "glibc_tunables": os.environ.get(TUNABLES_ENV_VAR, ""), "arenas": None}
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
      state["arenas"] = arena_count()
      if state["arenas"] and state["arenas"] > settings["arena_max"]:
        print(f"lla: malloc already has {state['arenas']} arenas (threads that started "
              "before `import lla` keep their own), where XLA:CPU's blocks over 64 MiB are "
              "mapped and unmapped on every call; start the process with "
              f"{TUNABLES_ENV_VAR}={ARENA_TUNABLE}={settings['arena_max']} "
              "(lla.allocator.environment_for_workers)", file=sys.stderr)
  _STATE = state
  return record()


def environment_for_workers(env: Mapping[str, str] | None = None) -> dict[str, str]:
  """`env` (default this process's) to start a process that runs threads before it imports
  lla with (pytest-xdist and Ray workers): $GLIBC_TUNABLES gains the tuned arena limit,
  read by glibc before the new process's first thread (module docstring). Unchanged where
  tuning is off ($LLA_ALLOCATOR=system) or the variable already sets the limit."""
  env = dict(os.environ if env is None else env)
  if (env.get(ENV_VAR) or "tuned") != "tuned":
    return env
  arena_max = {**TUNED, **parse(env.get(MALLOPT_ENV_VAR, ""))}["arena_max"]
  tunables = [t for t in env.get(TUNABLES_ENV_VAR, "").split(":") if t]
  if not any(t.startswith(f"{ARENA_TUNABLE}=") for t in tunables):
    env[TUNABLES_ENV_VAR] = ":".join(tunables + [f"{ARENA_TUNABLE}={arena_max}"])
  return env


def arena_count() -> int | None:
  """How many arenas glibc's malloc has (malloc_info's heaps): 1 where every thread
  allocates from the main heap, as tuned; None where malloc is not glibc's."""
  malloc_info = _glibc_malloc_function("malloc_info")
  if malloc_info is None:
    return None
  libc = ctypes.CDLL("libc.so.6")
  libc.open_memstream.restype = ctypes.c_void_p
  libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_void_p),
                                  ctypes.POINTER(ctypes.c_size_t)]
  libc.fclose.argtypes, libc.free.argtypes = [ctypes.c_void_p], [ctypes.c_void_p]
  malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
  buffer, size = ctypes.c_void_p(), ctypes.c_size_t()
  stream = libc.open_memstream(ctypes.byref(buffer), ctypes.byref(size))
  if not stream:
    return None
  malloc_info(0, stream)
  libc.fclose(stream)  # sets buffer and size
  text = ctypes.string_at(buffer, size.value)
  libc.free(buffer)
  return text.count(b"<heap nr=")


def _glibc_malloc_function(name: str):
  """glibc's malloc-introspection function `name`, or None where this process's malloc is
  another library's (its statistics would describe a heap nobody uses) or glibc lacks it."""
  library = _malloc_library()
  if library and not os.path.basename(library).startswith("libc.so"):
    return None
  try:
    return getattr(ctypes.CDLL("libc.so.6"), name)
  except (OSError, AttributeError):
    return None


class _MallInfo2(ctypes.Structure):
  _fields_ = [(name, ctypes.c_size_t) for name in (
      "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
      "fordblks", "keepcost")]


def heap_usage() -> dict | None:
  """{"in_use_mb", "free_mb"}: what glibc's malloc has handed out and not had back (the
  heap's blocks in use plus mmapped ones: the program's arrays, models and XLA:CPU's
  buffers), and what it keeps free in its heap (never given back under the tuned settings:
  RSS less the first is the allocator's share). None where malloc is not glibc's or glibc
  is older than 2.33 (no mallinfo2)."""
  mallinfo2 = _glibc_malloc_function("mallinfo2")
  if mallinfo2 is None:
    return None
  mallinfo2.restype = _MallInfo2
  info = mallinfo2()
  return {"in_use_mb": (info.uordblks + info.hblkhd) / 2**20, "free_mb": info.fordblks / 2**20}


def resident_mb() -> float:
  """The process's resident set now (/proc/self/statm, in pages)."""
  with open("/proc/self/statm") as statm:
    return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def resident_free_limit_mb() -> float:
  """How many MB of resident pages outside malloc's bytes in use release_free tolerates:
  $LLA_RESIDENT_FREE_MB, else RESIDENT_FREE_FRACTION of physical memory."""
  text = os.environ.get(RESIDENT_FREE_ENV_VAR)
  if text:
    try:
      limit = float(text)
    except ValueError:
      limit = -1.0
    if not limit >= 0:
      raise ValueError(f"${RESIDENT_FREE_ENV_VAR} must be a number of MB >= 0, got {text!r}")
    return limit
  return RESIDENT_FREE_FRACTION * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**20


def release_free(limit_mb: float | None = None) -> bool:
  """Gives the pages of the heap's free blocks back to the OS (glibc's malloc_trim(0)) when
  more than `limit_mb` (default `resident_free_limit_mb()`) of the resident set is not
  malloc's bytes in use.

  The tuned heap never trims itself, so its resident size is its high-water mark. A job
  whose units each churn through gigabytes (the main job's defended fine-tunes of a 135M
  model) fragments it: freed blocks too small for the next large request stay resident
  while the heap grows past them. Called between such units, the free blocks' pages leave
  RSS, to be faulted in again by the next unit that reuses them. Below the limit that
  costs more than it saves: the tiny main job, trimming before each of its 33 units, spent
  38 s more system time on 8 M more page faults than trimming 6 times under the default
  limit, for a peak 0.7 GB lower (docs/benchmarks.md, "Memory churn").
  The resident set less the bytes in use bounds the free pages from above (it also holds
  the interpreter, the libraries and compiled code, a few hundred MB). Returns whether
  anything was released; False where malloc is not glibc's or the limit is not reached.
  """
  malloc_trim = _glibc_malloc_function("malloc_trim")
  if malloc_trim is None:
    return False
  if limit_mb is None:  # as apply() recorded it, else as the environment says now
    limit_mb = _STATE["resident_free_limit_mb"] if _STATE else resident_free_limit_mb()
  heap = heap_usage()  # None before glibc 2.33: the limit cannot be checked, so trim
  if heap is not None and resident_mb() - heap["in_use_mb"] <= limit_mb:
    return False
  malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
  return bool(malloc_trim(0))


def record() -> dict:
  """Which allocator this process runs and how it was set (for provenance)."""
  if _STATE is None:
    return {"allocator": "not applied"}
  return {k: (dict(v) if isinstance(v, dict) else v) for k, v in _STATE.items()}
