"""The thread -> event loop handoff of page events: the runtime calls its ``EventSink`` on the
generating thread with its lock held; the agent lives on the event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Protocol

from coordinator.core.index import Tier
from coordinator.v1 import coordinator_pb2 as pb
from worker.sync.sync_protocol import TIER_PB


class PageEventTarget(Protocol):
    def page_event(
        self, kind: pb.PageEvent.Kind, keys: list[bytes], tier: pb.Tier = pb.TIER_GPU
    ) -> None: ...


class EventRelay:
    """The runtime's ``EventSink``: called from the generation thread, hands each event to the
    event loop with ``call_soon_threadsafe``. Events before ``bind`` (or after the loop closed)
    are dropped: a registration always announces the full inventory."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._agent: PageEventTarget | None = None

    def bind(self, loop: asyncio.AbstractEventLoop, agent: PageEventTarget) -> None:
        self._loop, self._agent = loop, agent

    def stored(self, keys: list[bytes]) -> None:
        self._post(pb.PageEvent.KIND_STORED, keys)

    def removed(self, keys: list[bytes]) -> None:
        self._post(pb.PageEvent.KIND_REMOVED, keys)

    def moved(self, keys: list[bytes], tier: Tier) -> None:
        # A Stored event for keys already held moves them to its tier (PROTOCOL.md: one tier
        # per worker and key), so a move down or back up needs no event kind of its own.
        self._post(pb.PageEvent.KIND_STORED, keys, TIER_PB[tier])

    def _post(
        self, kind: pb.PageEvent.Kind, keys: Sequence[bytes], tier: pb.Tier = pb.TIER_GPU
    ) -> None:
        loop, agent = self._loop, self._agent
        if loop is None or agent is None or not keys:
            return
        with contextlib.suppress(RuntimeError):  # loop closed: the process is stopping
            loop.call_soon_threadsafe(agent.page_event, kind, list(keys), tier)
