"""Helpers to run a real coordinator server in the test's event loop and wait on conditions."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from coordinator.config import CoordinatorConfig
from coordinator.core.hashing import DEV_HASH_KEY, HashConfig
from coordinator.server.main import RunningCoordinator, start_coordinator

FAST_KNOBS: dict[str, Any] = {
    "lease_ms": 2_000, "heartbeat_ms": 200, "drop_grace_ms": 5_000, "pending_ttl_ms": 1_000,
    "reaper_interval_ms": 50,
}
DEV_HASH = HashConfig(key=DEV_HASH_KEY)


@asynccontextmanager
async def running_coordinator(**overrides: Any) -> AsyncIterator[RunningCoordinator]:
    """A coordinator on a free loopback port with sub-second timing knobs."""
    settings = {"listen": "127.0.0.1:0", **FAST_KNOBS, **overrides}
    running = await start_coordinator(CoordinatorConfig(**settings))
    try:
        yield running
    finally:
        await running.stop(grace=0.2)


def target(running: RunningCoordinator) -> str:
    return f"127.0.0.1:{running.port}"


async def eventually(
    condition: Callable[[], Awaitable[bool]], *, timeout: float = 5.0, what: str = "condition"
) -> None:
    """Poll ``condition`` until true (the awaited event lives in another process/stream)."""
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)
