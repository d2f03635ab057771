"""``kvcoord bench``: hand over to the source checkout's ``bench/`` package (bench/runner.py).

The benchmarks are not part of the installed package: they live beside it in the checkout and
import ``kvcoord`` themselves, so ``kvcoord`` imports ``bench`` only here, at call time, never
at module import (no import circle). Installed without a checkout (a wheel), ``bench`` is not
importable and the command exits 2 with one line saying so.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
"""Where ``bench/`` sits when this package is run from (or installed editable from) a checkout."""

NEEDS_CHECKOUT = ("kvcoord bench: the benchmarks need a source checkout (bench/ is not part of "
                  "the installed package): run it from a clone with `make bench`")


def run(suite: str, *, quick: bool, out: Path | None,
        options: dict[str, str] | None = None, allow_busy: bool = False) -> int:
    """``bench.runner.run_suite``'s exit status (0 ran clean, 1 a crash or a broken invariant,
    2 an unknown suite or option), run from the checkout's root (``out`` relative to the caller's
    directory); or 2 with NEEDS_CHECKOUT when there is no ``bench`` package."""
    if (CHECKOUT / "bench" / "runner.py").exists() and str(CHECKOUT) not in sys.path:
        sys.path.insert(0, str(CHECKOUT))
    try:
        runner = importlib.import_module("bench.runner")
    except ModuleNotFoundError as exc:
        if exc.name not in ("bench", "bench.runner"):
            raise  # a missing dependency of the benchmarks: its own error says which
        print(NEEDS_CHECKOUT, file=sys.stderr)
        return 2
    where = {} if out is None else {"out": out.resolve()}
    os.chdir(Path(str(runner.__file__)).resolve().parent.parent)  # after resolving out
    status: int = runner.run_suite(suite, quick=quick, options=options or {},
                                   allow_busy=allow_busy, **where)
    return status
