"""The optional compiled core: the index's holdings (coordinator/core/_holdings_accel.pyx, with
each worker slot's positions in its table in _slot_positions_accel.pyx, which it cimports) and
the page-key chain (coordinator/core/_chain_accel.pyx).

Everything else is declared in pyproject.toml. The extension is built when Cython and a C
compiler are present and skipped otherwise (``optional=True``): the pure-Python holdings then
serve (``coordinator.core.index.holdings.accel_status()`` says which). ``make install`` builds it in
place with ``python setup.py build_ext --inplace``.
"""

from setuptools import Extension, setup

try:
    from Cython.Build import cythonize
except ImportError:  # no Cython: the pure-Python path only
    ext_modules = []
else:
    ext_modules = cythonize(
        [Extension(f"coordinator.core.{name}", [f"coordinator/core/{name}.pyx"],
                   extra_compile_args=["-O2"], optional=True)
         for name in ("_slot_positions_accel", "_holdings_accel", "_chain_accel")],
        language_level=3, quiet=True,
    )

setup(ext_modules=ext_modules)
