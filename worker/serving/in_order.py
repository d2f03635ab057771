"""``InOrder``: run items one at a time, in the order they arrive, on a task of the event loop's.
Both owners of policy commands use it (the reference worker's ``PolicyCommandHandler`` and the
bridge's ``PolicyDriver``): a DRAIN must finish before the APPLY behind it starts, and an APPLY
before the RESUME."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

Item = TypeVar("Item")


class InOrder(Generic[Item]):
    """``run(item)`` is awaited for each ``handle``d item, after every item handled before it.
    ``run`` must handle its own errors: one that escapes is lost with its item (the task goes on
    with the next one)."""

    def __init__(self, run: Callable[[Item], Awaitable[None]], name: str) -> None:
        self._run_one = run
        self._name = name
        self._queue: asyncio.Queue[Item] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    def handle(self, item: Item) -> None:
        """Queue ``item`` (on the loop); it runs after every item received before it."""
        self._queue.put_nowait(item)
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=self._name)

    async def idle(self) -> None:
        """Return once every queued item has run (for tests and shutdown)."""
        await self._queue.join()

    async def stop(self) -> None:
        """Cancel the item running, if any; those still queued never run."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            item = await self._queue.get()
            try:
                await self._run_one(item)
            finally:
                self._queue.task_done()
