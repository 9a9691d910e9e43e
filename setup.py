"""lla's import packages: `lla`, and the Pallas kernels of the folder kernels/ as `lla_kernels`.

`kernels` is the import name of Hugging Face's `kernels` distribution, which transformers
requires, so lla's kernels are installed under a name of lla's own; kernels/ has no
__init__.py, so running from the repository root (which puts the root on sys.path) cannot
shadow Hugging Face's package either. pyproject.toml cannot add a renamed package to the
discovered ones, hence this file. experiments/ and configs/ are not installed: they are the
repository's binaries and configs, run from its root (`python -m experiments.X`), and their
names are too generic to claim in site-packages.
"""

import setuptools

setuptools.setup(
    packages=setuptools.find_namespace_packages(include=["lla", "lla.*"]) + ["lla_kernels"],
    package_dir={"lla_kernels": "kernels"})
