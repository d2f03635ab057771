"""``IngestGovernor``: page-event ingest kept to a share of the event loop, so a fleet sending
more than one replica can apply slows its own events down instead of starving routes.

Every Sync stream's reader asks ``admit()`` before it applies an event batch and reports how
long the apply took (``applied``). Within each window (100 ms) event batches may use at most
``max_share`` of the window's time; past it, readers wait for the next window. A waiting reader
stops reading its stream, so HTTP/2 flow control pushes back to the worker, whose agent (or
bridge) holds and coalesces what it has not sent: the queue is bounded by one batch per stream
here, and by the workers' own event logs behind that. Routes, lookups, heartbeats and
acknowledgements are never held back: only event batches wait, so a saturated replica still
answers routes, and its lag (``kvcoord_ingest_wait_seconds``, the streams waiting) is what
grows. Readers run one at a time on the loop, so the budget is checked against every apply
before it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

WINDOW_S = 0.1


class IngestGovernor:
    def __init__(self, max_share: float, *, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not 0 < max_share <= 1:
            raise ValueError(f"max_share must be in (0, 1], got {max_share}")
        self.max_share = max_share
        self._window_s = window_s
        self._clock = clock
        self._window_start = clock()
        self._busy_s = 0.0
        self.waiting = 0
        """Streams whose next event batch waits for the budget now."""
        self.waited = 0
        """Event batches that had to wait, since start."""
        self.on_wait: Callable[[float], None] | None = None
        """Called with each wait's length (seconds), for the metrics."""

    @property
    def enabled(self) -> bool:
        return self.max_share < 1

    def _roll(self, now: float) -> None:
        if now - self._window_start >= self._window_s:
            # Time spent past the last window's budget is carried over, so a long apply
            # (a big batch) is paid for rather than forgotten at the boundary.
            over = self._busy_s - self.max_share * self._window_s
            self._busy_s = max(0.0, over)
            self._window_start = now

    def _over_budget(self, now: float) -> bool:
        self._roll(now)
        return self._busy_s >= self.max_share * self._window_s

    async def admit(self) -> None:
        """Return once this window's budget has room for one more event batch."""
        if not self.enabled:
            return
        began = self._clock()
        if not self._over_budget(began):
            return
        self.waiting += 1
        self.waited += 1
        try:
            while self._over_budget(self._clock()):
                left = self._window_s - (self._clock() - self._window_start)
                await asyncio.sleep(max(left, 0.001))
        finally:
            self.waiting -= 1
            if self.on_wait is not None:
                self.on_wait(self._clock() - began)

    def applied(self, seconds: float) -> None:
        """An event batch took ``seconds`` of the loop to apply."""
        self._busy_s += seconds
