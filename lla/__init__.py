"""lla: red-teaming the privacy of split and distributed LLM systems."""

__version__ = "0.1.0"
