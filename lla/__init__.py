"""lla: red-teaming the privacy of split and distributed LLM systems."""

__version__ = "0.1.0"

# Before JAX starts its threads: malloc keeps XLA:CPU's large per-call buffers instead of
# mapping and unmapping them on every call (lla/allocator.py; $LLA_ALLOCATOR=system: off).
from lla import allocator as _allocator

try:
  _allocator.apply()
except ValueError as _bad_setting:  # a bad $LLA_* setting: one line, no traceback
  raise SystemExit(f"lla: {_bad_setting}") from None
