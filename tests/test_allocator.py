"""lla/allocator.py: malloc keeps large freed blocks, in a fresh process, by default.

Each check runs a fresh interpreter that imports lla and then measures, with the kernel's own
minor-fault counter (getrusage), what a large malloc / write / free cycle costs: with glibc's
defaults every cycle maps fresh pages (one fault per 4 KiB page); tuned, the pages are
reused. XLA:CPU's pattern (posix_memalign of the same large size, a small block allocated
meanwhile, free) is reused once glibc's per-thread cache is full (7 remainders per size),
so its memory stays bounded; a heap top above 2 GiB is kept, not trimmed; release_free gives
freed pages back only above its limit of resident free pages. A thread that ran before
`import lla` keeps an arena of its own, unless the process started with the environment
`environment_for_workers` gives (as this suite's pytest-xdist workers do). The fallback
(mallopt unreachable) must leave malloc as it was and say so in one line on stderr.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

MIB = 1 << 20
PAGES = (96 * MIB) // os.sysconf("SC_PAGE_SIZE")

# Faults per page of a 96 MiB block malloc'ed, written and freed 8 times (after one warm-up
# cycle); then the allocator's provenance entry. Runs after `import lla` (or PRELUDE).
CYCLES = """
import ctypes, resource
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                ctypes.c_size_t]
n = 96 << 20
def plain():
  p = libc.malloc(n); ctypes.memset(p, 1, n); libc.free(p)
kept = []
def aligned():  # XLA:CPU's buffers: 64-byte aligned; something small allocated meanwhile
  p = ctypes.c_void_p(); libc.posix_memalign(ctypes.byref(p), 64, n); ctypes.memset(p, 1, n)
  kept.append(libc.malloc(40)); libc.free(p)
def faults_per_cycle(cycle, warmup=1):
  for _ in range(warmup):
    cycle()
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  for _ in range(8):
    cycle()
  return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 8
def resident():
  return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) << 10
"""
PROBE = """
import ctypes, json, os, resource, sys
{prelude}
import lla
from lla import allocator
""" + CYCLES + """
start = resident()
plain_faults = faults_per_cycle(plain)
aligned_faults = faults_per_cycle(aligned, warmup=32)  # past the cache's 7 per size
print(json.dumps({{"plain": plain_faults, "aligned": aligned_faults,
                  "growth": resident() - start, "record": allocator.record()}}))
"""
# A block above 2 GiB (glibc's largest trim threshold short of "never") at the heap's top,
# written and freed twice: faults per page of the second cycle, or glibc's own page count.
ABOVE_2GIB = """
import ctypes, json, resource
import lla
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
n = (9 << 30) // 4
def cycle():
  p = libc.malloc(n); ctypes.memset(p, 1, n); libc.free(p)
cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
cycle()
print(json.dumps((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) * 4096 / n))
"""

NO_MALLOPT = """
real = ctypes.CDLL
class NoMallopt(real):  # a libc without mallopt (musl-like), for lla's view only
  def __getattr__(self, name):
    if name == "mallopt":
      raise AttributeError(name)
    return super().__getattr__(name)
ctypes.CDLL = NoMallopt
"""


def clean_env() -> dict[str, str]:
  """This environment without anything that selects or tunes an allocator."""
  return {k: v for k, v in os.environ.items()
          if k not in ("LD_PRELOAD", "LLA_ALLOCATOR", "LLA_MALLOPT", "LLA_RESIDENT_FREE_MB",
                       "GLIBC_TUNABLES")
          and not k.startswith("MALLOC_")}


def probe(prelude: str = "", **env) -> tuple[dict, str]:
  result = subprocess.run([sys.executable, "-c", PROBE.format(prelude=prelude)],
                          env={**clean_env(), **env}, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


glibc_only = pytest.mark.skipif(
    not os.path.exists("/proc/self/maps") or os.confstr("CS_GNU_LIBC_VERSION") is None,
    reason="glibc malloc only")


@glibc_only
def test_default_keeps_freed_pages_where_glibc_refaults_them():
  tuned, tuned_err = probe()  # `import lla`: what every binary, the suite and a notebook get
  system, _ = probe(LLA_ALLOCATOR="system")
  # glibc's defaults: a fresh mapping per cycle, every page faulted in again.
  assert system["plain"] > 0.9 * PAGES and system["aligned"] > 0.9 * PAGES
  # Tuned: a freed block goes back to the heap and is reused, XLA's aligned pattern too
  # once the cache is full; what the cache walls in is at most its 7 blocks and the one in
  # use (9 allowed), not a block per cycle (42 cycles ran).
  assert tuned["plain"] < 0.01 * PAGES and tuned["aligned"] < 0.01 * PAGES
  assert tuned["growth"] < 9 * 96 * MIB
  assert tuned_err == ""
  libc_version = os.confstr("CS_GNU_LIBC_VERSION").split()[-1]
  assert tuned["record"]["name"] == f"glibc {libc_version}"
  assert tuned["record"]["mallopt"]["mmap_max"] == 0 and system["record"]["mallopt"] == {}


@glibc_only
def test_a_heap_top_above_2gib_is_kept():
  """Pre-training frees about 3 GB a step: glibc's defaults, and its largest finite trim
  threshold (2 GiB - 1), give it back to the OS, and the next step faults it in again."""
  def refaults(**env):
    result = subprocess.run([sys.executable, "-c", ABOVE_2GIB], env={**clean_env(), **env},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)
  assert refaults() < 0.01
  assert refaults(LLA_ALLOCATOR="system") > 0.9
  assert refaults(LLA_MALLOPT=f"trim_threshold={2**31 - 1}") > 0.9


# A thread started, its first malloc made, before `import lla` (as in pytest-xdist's and
# Ray's workers); then faults per page of 96 MiB blocks malloc'ed, written and freed in it.
EARLY_THREAD = """
import ctypes, json, queue, resource, threading
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
jobs, results, started = queue.Queue(), queue.Queue(), threading.Event()
def serve():
  libc.free(libc.malloc(64))
  started.set()
  while True:
    results.put(jobs.get()())
threading.Thread(target=serve, daemon=True).start()
started.wait()
import lla
from lla import allocator
""" + CYCLES + """
jobs.put(lambda: faults_per_cycle(plain))
print(json.dumps({"plain": results.get(), "record": allocator.record()}))
"""


@glibc_only
def test_a_thread_older_than_lla_keeps_an_arena_unless_the_environment_limits_them():
  def run(env):
    result = subprocess.run([sys.executable, "-c", EARLY_THREAD], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr
  from lla import allocator
  late, stderr = run(clean_env())
  # The thread's own arena grows in 64 MiB heaps: each 96 MiB block is a fresh mapping.
  assert late["record"]["arenas"] == 2 and late["plain"] > 0.9 * PAGES
  line, = stderr.strip().splitlines()
  assert line.startswith("lla: malloc already has 2 arenas") and "arena_max=1" in line
  environment = allocator.environment_for_workers(clean_env())
  assert environment["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=1"
  early, stderr = run(environment)
  assert early["record"]["arenas"] == 1 and early["plain"] < 0.01 * PAGES and stderr == ""


def test_the_environment_for_workers_keeps_what_is_set():
  from lla import allocator
  tunables = lambda **env: allocator.environment_for_workers(env).get("GLIBC_TUNABLES")
  assert tunables(GLIBC_TUNABLES="glibc.malloc.tcache_count=0") == (
      "glibc.malloc.tcache_count=0:glibc.malloc.arena_max=1")
  assert tunables(GLIBC_TUNABLES="glibc.malloc.arena_max=4") == "glibc.malloc.arena_max=4"
  assert tunables(LLA_MALLOPT="arena_max=2") == "glibc.malloc.arena_max=2"
  assert tunables(LLA_ALLOCATOR="system") is None


@glibc_only
def test_this_suite_runs_tuned():
  if os.environ.get("LLA_ALLOCATOR", "tuned") != "tuned":
    pytest.skip("$LLA_ALLOCATOR turns the tuning off")
  from lla import allocator
  assert allocator.record()["mode"] == "tuned"
  # One heap for every thread, in a pytest-xdist worker too (tests/conftest.py).
  assert allocator.record()["arenas"] == 1 == allocator.arena_count()
  scope = {}
  exec(CYCLES, scope)  # in this pytest process
  assert scope["faults_per_cycle"](scope["plain"]) < 0.01 * PAGES


@glibc_only
def test_without_mallopt_one_line_note_and_malloc_untouched():
  fallback, stderr = probe(prelude=NO_MALLOPT)
  lines = stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("lla: malloc is not glibc's"), stderr
  assert fallback["plain"] > 0.9 * PAGES  # nothing was applied
  assert fallback["record"]["mallopt"] == {}


@glibc_only
def test_a_preloaded_allocator_is_used_as_it_is_and_recorded():
  # Ray (a dependency of the lock file) ships jemalloc for its own processes, so some
  # other allocator is always there to preload; a system TCMalloc is taken first.
  ray_core = pathlib.Path(importlib.util.find_spec("ray").origin).parent / "core"
  candidates = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", str(ray_core / "libjemalloc.so"))
  library = next((p for p in candidates if os.path.exists(p)), None)
  assert library is not None, f"none of {candidates} exists"
  preloaded, stderr = probe(LD_PRELOAD=library)
  assert stderr == ""
  assert preloaded["record"]["name"] == os.path.basename(library)
  assert preloaded["record"]["mallopt"] == {}


def test_bad_settings_are_refused():
  from lla import allocator
  assert allocator.parse("mmap_max=0, top_pad=1024") == {"mmap_max": 0, "top_pad": 1024}
  with pytest.raises(ValueError, match="mmap_maximum"):
    allocator.parse("mmap_maximum=0")


@pytest.mark.parametrize("env, fact", [
    ({"LLA_ALLOCATOR": "mallopt"}, "$LLA_ALLOCATOR must be one of ('tuned', 'system'), got "
                                   "'mallopt'"),
    ({"LLA_MALLOPT": "mmap_maximum=0"}, "'mmap_maximum=0' is not name=integer"),
    ({"LLA_RESIDENT_FREE_MB": "-1"}, "$LLA_RESIDENT_FREE_MB must be a number of MB >= 0, "
                                     "got '-1'"),
    ({"LLA_RESIDENT_FREE_MB": "3G"}, "got '3G'")])
def test_a_bad_setting_stops_import_with_one_line(env, fact):
  result = subprocess.run([sys.executable, "-c", "import lla"], env={**clean_env(), **env},
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 1
  line, = result.stderr.strip().splitlines()
  assert line.startswith("lla: ") and fact in line


@glibc_only
def test_heap_usage_counts_what_is_held_and_what_is_kept_free():
  """A 256 MiB block malloc'ed in this process is in use until freed; freed, the tuned heap
  keeps it (free, not in use). Measured against the block's own size, not against lla."""
  import ctypes  # pylint: disable=g-import-not-at-top
  from lla import allocator  # pylint: disable=g-import-not-at-top
  libc = ctypes.CDLL("libc.so.6")
  libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
  libc.free.argtypes = [ctypes.c_void_p]
  before = allocator.heap_usage()
  block = libc.malloc(256 * MIB)
  held = allocator.heap_usage()
  libc.free(block)
  after = allocator.heap_usage()
  # Within 1 MiB: the interpreter's own small blocks come and go meanwhile.
  assert held["in_use_mb"] - before["in_use_mb"] >= 255
  assert held["in_use_mb"] - after["in_use_mb"] >= 255
  if allocator.record().get("mode") == "tuned":
    assert after["free_mb"] - held["free_mb"] >= 255  # kept in the heap, not unmapped


# A 256 MiB block written and freed (the tuned heap keeps it resident), then release_free
# with the limit given as `{limit}`; RSS as the kernel's own VmRSS says, in a fresh process.
RELEASE = """
import ctypes, json
import lla
from lla import allocator
""" + CYCLES + """
block = libc.malloc(256 << 20); ctypes.memset(block, 1, 256 << 20)
written = resident()
libc.free(block)
freed = resident()
released = allocator.release_free({limit})
print(json.dumps({{"written": written, "freed": freed, "after": resident(),
                   "released": released, "record": allocator.record()}}))
"""


def release(limit: str, **env) -> dict:
  result = subprocess.run([sys.executable, "-c", RELEASE.format(limit=limit)],
                          capture_output=True, text=True, check=True, timeout=120,
                          env={**clean_env(), **env})
  out = json.loads(result.stdout.strip().splitlines()[-1])
  assert out["record"]["mode"] == "tuned"
  assert out["written"] - out["freed"] < 16 * MIB  # freed, still resident
  return out


@glibc_only
def test_release_free_gives_a_freed_blocks_pages_back_above_its_limit():
  """With no resident free pages tolerated, the freed block's pages leave RSS."""
  out = release("limit_mb=0")
  assert out["released"] and out["freed"] - out["after"] >= 240 * MIB


@glibc_only
@pytest.mark.parametrize("limit, env", [("limit_mb=1 << 20", {}),
                                        ("", {"LLA_RESIDENT_FREE_MB": "1048576"})])
def test_release_free_keeps_them_below_its_limit(limit, env):
  """A limit of 1 TiB of resident free pages, given or from the environment: the block's
  256 MiB stay resident for the next unit of work to reuse without faulting them in."""
  out = release(limit, **env)
  assert not out["released"] and abs(out["freed"] - out["after"]) < 16 * MIB
  if env:
    assert out["record"]["resident_free_limit_mb"] == 1048576


@glibc_only
def test_the_default_limit_is_an_eighth_of_physical_memory():
  """As /proc/meminfo's MemTotal says (its kB are KiB), recorded in the provenance entry."""
  out = release("")
  with open("/proc/meminfo") as meminfo:
    total_kib = int(next(l for l in meminfo if l.startswith("MemTotal:")).split()[1])
  assert out["record"]["resident_free_limit_mb"] == pytest.approx(total_kib / 1024 / 8, abs=0.1)
