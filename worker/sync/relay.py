"""The thread -> event loop handoff of page events: the runtime calls its ``EventSink`` on the
generating thread with its lock held; the ``SyncClient`` lives on the event loop."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol

from coordinator.core.index import PageEvent, PagesRemoved, PagesStored, Tier


class PageEventTarget(Protocol):
    """Where the relay hands events (the worker's ``SyncClient``), on the event loop."""

    def page_event(self, event: PageEvent) -> None: ...


class EventRelay:
    """The runtime's ``EventSink``: called from the generation thread, hands each event to the
    event loop with ``call_soon_threadsafe``. Events before ``bind`` (or after the loop closed)
    are dropped: a registration always announces the full inventory."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._target: PageEventTarget | None = None

    def bind(self, loop: asyncio.AbstractEventLoop, target: PageEventTarget) -> None:
        self._loop, self._target = loop, target

    def stored(self, keys: list[bytes]) -> None:
        if keys:
            self._post(PagesStored(list(keys)))

    def removed(self, keys: list[bytes]) -> None:
        if keys:
            self._post(PagesRemoved(list(keys)))

    def moved(self, keys: list[bytes], tier: Tier) -> None:
        # NOTE: a Stored event for keys already held moves them to its tier (PROTOCOL.md: one
        # tier per worker and key), so a move down or back up needs no event kind of its own.
        if keys:
            self._post(PagesStored(list(keys), tier))

    def _post(self, event: PageEvent) -> None:
        # The keys were copied above: the runtime reuses its lists once this call returns.
        loop, target = self._loop, self._target
        if loop is None or target is None:
            return
        with contextlib.suppress(RuntimeError):  # loop closed: the process is stopping
            loop.call_soon_threadsafe(target.page_event, event)
