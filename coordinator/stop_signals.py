"""How a serving process learns it must stop: SIGINT, or SIGTERM (Kubernetes' termination)."""

from __future__ import annotations

import asyncio
import signal


def stop_requested() -> asyncio.Event:
    """An event set on SIGINT or SIGTERM (handlers installed on the running loop, replacing
    Python's KeyboardInterrupt), so the caller drains instead of dying mid-request."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop
