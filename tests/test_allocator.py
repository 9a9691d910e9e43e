"""lla/allocator.py: malloc keeps large freed blocks, in a fresh process, by default.

Each check runs a fresh interpreter that imports lla and then measures, with the kernel's own
minor-fault counter (getrusage), what a large malloc / write / free cycle costs: with glibc's
defaults every cycle maps fresh pages (one fault per 4 KiB page); tuned, the pages are
reused. XLA:CPU's pattern (posix_memalign of the same large size, a small block allocated
meanwhile, free) is reused only after the restart with glibc tunables (tcache off), which
binaries and this test suite (conftest.py) do. The fallback (mallopt unreachable) must
leave malloc as it was and say so in one line on stderr.
"""

import json
import os
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
def faults_per_cycle(cycle):
  cycle()
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  for _ in range(8):
    cycle()
  return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 8
"""
PROBE = """
import ctypes, json, os, resource, sys
{prelude}
import lla
from lla import allocator
""" + CYCLES + """
print(json.dumps({{"plain": faults_per_cycle(plain), "aligned": faults_per_cycle(aligned),
                  "record": allocator.record()}}))
"""
REEXEC = "from lla import allocator as a; a.reexec()"

NO_MALLOPT = """
real = ctypes.CDLL
class NoMallopt(real):  # a libc without mallopt (musl-like), for lla's view only
  def __getattr__(self, name):
    if name == "mallopt":
      raise AttributeError(name)
    return super().__getattr__(name)
ctypes.CDLL = NoMallopt
"""


def probe(prelude: str = "", **env) -> tuple[dict, str]:
  environ = {k: v for k, v in os.environ.items()
             if k not in ("LD_PRELOAD", "LLA_ALLOCATOR", "LLA_MALLOPT", "GLIBC_TUNABLES",
                          "LLA_ALLOCATOR_REEXEC") and not k.startswith("MALLOC_")}
  result = subprocess.run([sys.executable, "-c", PROBE.format(prelude=prelude)],
                          env={**environ, **env}, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


glibc_only = pytest.mark.skipif(
    not os.path.exists("/proc/self/maps") or os.confstr("CS_GNU_LIBC_VERSION") is None,
    reason="glibc malloc only")


@glibc_only
def test_default_keeps_freed_pages_where_glibc_refaults_them():
  imported, imported_err = probe()  # `import lla` alone: mallopt
  restarted, restarted_err = probe(prelude=REEXEC)  # what binaries and the suite do
  system, _ = probe(LLA_ALLOCATOR="system")
  # glibc's defaults: a fresh mapping per cycle, every page faulted in again.
  assert system["plain"] > 0.9 * PAGES and system["aligned"] > 0.9 * PAGES
  # mallopt alone: a freed plain block goes back to the heap and is reused ...
  assert imported["plain"] < 0.01 * PAGES
  # ... and after the restart with tunables, XLA's aligned pattern is reused too.
  assert restarted["plain"] < 0.01 * PAGES and restarted["aligned"] < 0.01 * PAGES
  assert imported_err == restarted_err == ""
  libc_version = os.confstr("CS_GNU_LIBC_VERSION").split()[-1]
  assert restarted["record"]["name"] == f"glibc {libc_version}"
  assert restarted["record"]["mallopt"]["mmap_max"] == 0 and system["record"]["mallopt"] == {}
  assert "glibc.malloc.tcache_count=0" in restarted["record"]["glibc_tunables"]
  assert imported["record"]["glibc_tunables"] == system["record"]["glibc_tunables"] == ""


@glibc_only
def test_this_suite_runs_restarted_with_tunables():
  if os.environ.get("LLA_ALLOCATOR", "tuned") != "tuned":
    pytest.skip("$LLA_ALLOCATOR turns the restart off")
  scope = {}
  exec(CYCLES, scope)  # in this pytest process
  assert scope["faults_per_cycle"](scope["aligned"]) < 0.01 * PAGES
  assert "glibc.malloc.tcache_count=0" in os.environ.get("GLIBC_TUNABLES", "")


@glibc_only
def test_without_mallopt_one_line_note_and_malloc_untouched():
  fallback, stderr = probe(prelude=NO_MALLOPT + REEXEC)
  lines = stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("lla: malloc is not glibc's"), stderr
  assert fallback["plain"] > 0.9 * PAGES  # nothing was applied
  assert fallback["record"]["mallopt"] == {}


@glibc_only
def test_a_preloaded_allocator_is_used_as_it_is_and_recorded():
  library = next((p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                              "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2") if os.path.exists(p)),
                 None)
  if library is None:
    pytest.skip("no TCMalloc or jemalloc installed to preload")
  preloaded, stderr = probe(LD_PRELOAD=library)
  assert stderr == ""
  assert preloaded["record"]["name"] == os.path.basename(library)
  assert preloaded["record"]["mallopt"] == {}


def test_bad_settings_are_refused():
  from lla import allocator
  assert allocator.parse("mmap_max=0, top_pad=1024") == {"mmap_max": 0, "top_pad": 1024}
  with pytest.raises(ValueError, match="mmap_maximum"):
    allocator.parse("mmap_maximum=0")
