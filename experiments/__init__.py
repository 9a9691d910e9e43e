"""lla's binaries: `python -m experiments.NAME`."""
