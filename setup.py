"""The optional compiled index core (coordinator/core/_holdings_accel.pyx).

Everything else is declared in pyproject.toml. The extension is built when Cython and a C
compiler are present and skipped otherwise (``optional=True``): the pure-Python holdings then
serve (``coordinator.core.holdings.accel_status()`` says which). ``make install`` builds it in
place with ``python setup.py build_ext --inplace``.
"""

from setuptools import Extension, setup

try:
    from Cython.Build import cythonize
except ImportError:  # no Cython: the pure-Python path only
    ext_modules = []
else:
    ext_modules = cythonize(
        [Extension("coordinator.core._holdings_accel", ["coordinator/core/_holdings_accel.pyx"],
                   extra_compile_args=["-O2"], optional=True)],
        language_level=3, quiet=True,
    )

setup(ext_modules=ext_modules)
