"""The admission gate in front of the runtime: counts Generate calls in flight and finished, and
closes for a policy drain. Event-loop only (no locks): the server and the agent share one loop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


class Draining(Exception):
    """The worker is draining for a policy update and takes no new generation."""


@dataclass(slots=True)
class GenerationTotals:
    """Generate calls answered since the process started (what ``GetStats`` reports)."""

    requests: int = 0
    tokens: int = 0
    cached_prompt_tokens: int = 0  # either tier
    host_cached_prompt_tokens: int = 0  # of those, copied back from the host tier
    computed_prompt_tokens: int = 0


class GenerationGate:
    """``enter``/``leave`` bracket every Generate call. ``close`` (DRAIN) refuses new calls with
    ``Draining``; ``wait_idle`` returns once none is in flight; ``open`` (RESUME) admits again.
    ``take_completed`` hands the heartbeat the calls finished since it last asked."""

    def __init__(self) -> None:
        self.totals = GenerationTotals()
        self._in_flight = 0
        self._completed_unreported = 0
        self._closed = False
        self._idle = asyncio.Event()
        self._idle.set()
        # Set when a call ends: the agent reports completions at once (coalesced), so the
        # coordinator stops counting a finished route as queued work before the next turn of
        # the same conversation is routed.
        self.completion = asyncio.Event()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def closed(self) -> bool:
        return self._closed

    def enter(self) -> None:
        """Admit one call; raises ``Draining`` while closed."""
        if self._closed:
            raise Draining("worker is draining for a policy update: retry on another worker")
        self._in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        """One admitted call ended, answered or refused: either way its route is settled."""
        self._in_flight -= 1
        self._completed_unreported += 1
        self.completion.set()
        if self._in_flight == 0:
            self._idle.set()

    def close(self) -> None:
        self._closed = True

    def open(self) -> None:
        self._closed = False

    async def wait_idle(self) -> None:
        """Return once no admitted call is in flight (immediately when none is)."""
        await self._idle.wait()

    def take_completed(self) -> int:
        """Calls ended since the previous ``take_completed`` (resets the count)."""
        count, self._completed_unreported = self._completed_unreported, 0
        return count
