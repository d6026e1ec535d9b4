"""Build the Cython hot path. Every compiled module has a pure-Python twin in
filters/ (xds/ for the control channel's decoder), so a build without a C compiler
still installs (MESHD_NO_CYTHON=1 forces that), and `meshd version` says which
implementation is active."""

import glob
import os

from setuptools import setup

ext_modules = []
if not os.environ.get("MESHD_NO_CYTHON"):
    try:
        from Cython.Build import cythonize
    except ImportError:  # pragma: no cover - Cython is a build requirement
        cythonize = None
    sources = sorted(glob.glob("filters/_*_c.pyx") + glob.glob("xds/_*_c.pyx"))
    if cythonize is not None and sources:
        ext_modules = cythonize(
            sources,
            compiler_directives={"language_level": "3", "boundscheck": False, "wraparound": False},
            quiet=True,
        )

setup(ext_modules=ext_modules)
