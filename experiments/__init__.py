"""lla's binaries: `python -m experiments.NAME`."""

import sys as _sys

# A binary (python -m experiments.NAME) restarts itself once, before its imports, with
# glibc's malloc tuned through tunables (lla/allocator.py, issue 23: XLA:CPU's per-call
# buffers reused instead of mapped and faulted in again). Importing this package from
# elsewhere (a notebook, a test) restarts nothing.
_ARGV = _sys.orig_argv
_M = _ARGV.index("-m") if "-m" in _ARGV else -1
if 0 < _M < len(_ARGV) - 1 and _ARGV[_M + 1].startswith("experiments."):
  from lla import allocator as _allocator

  _allocator.reexec()
