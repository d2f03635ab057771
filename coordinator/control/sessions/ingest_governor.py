"""``IngestGovernor``: page-event ingest kept to a share of the event loop, so a fleet sending
more than one replica can apply slows its own events down instead of starving routes.

Every Sync stream's reader asks ``admit()`` before it applies an event batch and reports how
long the apply took (``applied``). Within each window (100 ms) event batches may use at most
``share`` of the window's time; past it, readers wait, first come first served. ``share`` starts
at ``max_share`` and follows the loop's own lag: reading what arrives costs the loop too, so when
a timer fires late the share is cut, and given back while the loop keeps time. A waiting reader
stops reading its stream, so HTTP/2 flow control pushes back to the worker, whose agent (or
bridge) holds and coalesces what it has not sent: the queue is bounded by one batch per stream
here, and by the workers' own event logs behind that. Routes, lookups, heartbeats and
acknowledgements are never held back: only event batches wait, so a saturated replica still
answers routes, and its lag (``kvcoord_ingest_wait_seconds``, the streams waiting) is what
grows. Readers run one at a time on the loop, so the budget is checked against every apply
before it. The lag watch runs only while batches come: an idle fleet's replica does not wake
for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable

WINDOW_S = 0.1
# The share adapts to what routes feel: a timer every TICK_S that fires more than LOOP_LAG_S
# late (the loop is busy with something: applying, or just reading what arrives) cuts the share
# (x BACKOFF, down to MIN_SHARE); a timely one gives back STEP, up to ``max_share``.
TICK_S = 0.02
LOOP_LAG_S = 0.01
BACKOFF = 0.7
STEP = 0.02
MIN_SHARE = 0.05
# After the loop last lagged, acks stay delayed this long: merging them is what keeps it from
# lagging again, so it must not stop the moment the loop catches up.
BUSY_HOLD_S = 2.0
# The watch stops once no event batch came for this long and the share is whole again (an idle
# fleet's replica then wakes for nothing); the next batch starts it.
IDLE_S = 1.0


class IngestGovernor:
    def __init__(self, max_share: float, *, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.perf_counter,
                 max_ack_delay_s: float = 0.0, idle_s: float = IDLE_S) -> None:
        if not 0 < max_share <= 1:
            raise ValueError(f"max_share must be in (0, 1], got {max_share}")
        if max_ack_delay_s < 0:
            raise ValueError(f"max_ack_delay_s must be >= 0, got {max_ack_delay_s}")
        self.max_share = max_share
        self.max_ack_delay_s = max_ack_delay_s
        self.share = max_share
        """The share in force now (adapted to the loop's lag, at most ``max_share``)."""
        self.loop_lag_s = 0.0
        """How late the last watch tick fired."""
        self._watcher: asyncio.Task[None] | None = None
        self._watching = False  # between start() and stop()
        self._last_batch = clock()
        self._idle_s = idle_s
        self._window_s = window_s
        self._clock = clock
        self._window_start = clock()
        self._lagged_until = 0.0  # acks stay delayed until then after the loop last lagged
        self._busy_s = 0.0
        # Readers waiting for the budget, first come first served: one is let in at a time
        # (its apply is charged before the next is), so waiting costs no polling.
        self._queue: deque[asyncio.Future[None]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self.waiting = 0
        """Streams whose next event batch waits for the budget now."""
        self.waited = 0
        """Event batches that had to wait, since start."""
        self.on_wait: Callable[[float], None] | None = None
        """Called with each wait's length (seconds), for the metrics."""

    def ack_delay_s(self) -> float:
        """How long an event batch's ack may wait to be merged with the stream's next ones
        (``control.delayed_acks``): ``max_ack_delay_s`` while the budget is cut, a stream
        waits for it, or the loop lagged within ``BUSY_HOLD_S``; else 0 (an idle replica acks
        every batch at once)."""
        busy = (self.share < self.max_share or self.waiting > 0
                or self._clock() < self._lagged_until)
        return self.max_ack_delay_s if busy else 0.0

    @property
    def enabled(self) -> bool:
        return self.max_share < 1

    def _roll(self, now: float) -> None:
        if now - self._window_start >= self._window_s:
            # Time spent past the last window's budget is carried over, so a long apply
            # (a big batch) is paid for rather than forgotten at the boundary.
            over = self._busy_s - self.share * self._window_s
            self._busy_s = max(0.0, over)
            self._window_start = now

    def _over_budget(self, now: float) -> bool:
        self._roll(now)
        return self._busy_s >= self.share * self._window_s

    def start(self) -> None:
        """Watch the loop's lag (adapts ``share``) while event batches come; a no-op when
        unbounded."""
        self._watching = self.enabled
        self._wake()

    def _wake(self) -> None:
        """A batch came: (re)start the watch if it stopped for want of batches."""
        self._last_batch = self._clock()
        if self._watching and (self._watcher is None or self._watcher.done()):
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    @property
    def watching(self) -> bool:
        """Whether the lag watch is running now (it sleeps while no batch comes)."""
        return self._watcher is not None and not self._watcher.done()

    async def stop(self) -> None:
        self._watching = False
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def _watch(self) -> None:
        while True:
            began = self._clock()
            await asyncio.sleep(TICK_S)
            self.loop_lag_s = max(0.0, self._clock() - began - TICK_S)
            if self.loop_lag_s > LOOP_LAG_S:
                self._lagged_until = self._clock() + BUSY_HOLD_S
                # Never below MIN_SHARE, nor above max_share (a configured share under
                # MIN_SHARE stays as configured).
                self.share = max(min(MIN_SHARE, self.max_share), self.share * BACKOFF)
            else:
                self.share = min(self.max_share, self.share + STEP)
                if (self.share >= self.max_share and not self._queue
                        and self._clock() - self._last_batch > self._idle_s):
                    return  # idle: nothing to adapt to until the next batch (``_wake``)

    def admits_now(self) -> bool:
        """Whether ``admit()`` would return at once (nobody waiting, budget left): a caller
        that applies at once on True reports the time with ``applied`` as after ``admit``."""
        return not self.enabled or (not self._queue and not self._over_budget(self._clock()))

    async def admit(self) -> None:
        """Return once this window's budget has room for one more event batch (at once when
        it has and nobody is waiting)."""
        if not self.enabled:
            return
        self._wake()
        began = self._clock()
        if not self._queue and not self._over_budget(began):
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append(turn)
        self.waiting += 1
        self.waited += 1
        self._arm()
        try:
            await turn
        finally:
            self.waiting -= 1
            if self.on_wait is not None:
                self.on_wait(self._clock() - began)

    def applied(self, seconds: float) -> None:
        """An event batch took ``seconds`` of the loop to apply; the next waiter may go if the
        budget still has room."""
        self._busy_s += seconds
        if self._watching:
            self._wake()
        self._release()

    def _release(self) -> None:
        if not self._over_budget(self._clock()):
            while self._queue:
                turn = self._queue.popleft()
                if not turn.done():  # a waiter whose stream ended is skipped
                    turn.set_result(None)
                    break
        if self._queue:
            self._arm()  # the next window lets the rest in, if no apply does first

    def _arm(self) -> None:
        if self._timer is None:
            wait = self._window_start + self._window_s - self._clock()
            self._timer = asyncio.get_running_loop().call_later(max(wait, 0.001), self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._release()
