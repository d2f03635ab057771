"""The optional compiled core: which parts were built, and whether they may be used.

``make install`` builds the Cython extensions (``setup.py``) where a C compiler is: the index's
holdings (``_holdings_accel``, which imports ``_slot_positions_accel``, its per-slot positions:
without that one built it does not import, and ``status`` names the missing module) and the
page-key chain (``_chain_accel``). Each part has a pure-Python twin with the same contract that
serves where it was not built, or everywhere when ``KVCOORD_NO_ACCEL=1``. Pure core: no I/O
beyond importing.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

NO_ACCEL_VARIABLE = "KVCOORD_NO_ACCEL"
"""Set to ``1``: the pure-Python twins even where the compiled parts are built."""

DISABLED = os.environ.get(NO_ACCEL_VARIABLE, "") == "1"

PARTS = {"_holdings_accel": "index holdings", "_chain_accel": "page-key chain"}
_built: dict[str, ModuleType | None] = {}
_why: dict[str, str] = {}


def built(name: str) -> ModuleType | None:
    """The compiled module ``coordinator.core.<name>`` if it was built (whatever
    ``KVCOORD_NO_ACCEL`` says), else None."""
    if name not in _built:
        try:
            # By name: the extension exists only where it was built (and has no type stub).
            _built[name] = importlib.import_module(f"coordinator.core.{name}")
        except ImportError as exc:
            _built[name], _why[name] = None, str(exc)
    return _built[name]


def enabled(name: str) -> ModuleType | None:
    """The compiled module when it was built and is not disabled, else None."""
    return None if DISABLED else built(name)


def status() -> str:
    """Which core serves, and why: for ``make install`` and the startup log."""
    missing = [f"{PARTS[n]}: {_why[n]}" for n in PARTS if built(n) is None]
    if missing:
        return f"pure Python (not built: {'; '.join(missing)})"
    if DISABLED:
        return f"pure Python ({NO_ACCEL_VARIABLE}=1; the compiled core is built)"
    return "compiled (Cython: " + ", ".join(PARTS.values()) + ")"
