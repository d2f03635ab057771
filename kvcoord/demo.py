"""``kvcoord demo`` (and what ``make demo`` ran before ``kvcoord up`` existed): now ``kvcoord up``
with its defaults.

The process helpers that used to live here moved to ``kvcoord.fleet_procs``; they are re-exported
so existing importers (the integration tests) keep working.
"""

from __future__ import annotations

from kvcoord.child_process import stop_process
from kvcoord.fleet_procs import free_port, start_coordinator_process, wait_healthy

__all__ = ["free_port", "run_demo", "start_coordinator_process", "stop_process", "wait_healthy"]


def run_demo() -> int:
    """``kvcoord up`` with default options; returns its exit status."""
    from kvcoord.up import UpOptions, run_up

    return run_up(UpOptions())
