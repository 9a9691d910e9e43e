"""lla: red-teaming the privacy of split and distributed LLM systems."""

__version__ = "0.1.0"

# Before JAX starts its threads: malloc keeps XLA:CPU's large per-call buffers instead of
# mapping and unmapping them on every call (lla/allocator.py; $LLA_ALLOCATOR=system: off).
from lla import allocator as _allocator

_allocator.apply()
