"""Pallas kernels for lla's hot loops, each beside a pure-JAX reference it is tested against."""
