"""A worker's prefill backlog as the coordinator books it, and the prefill rate it learns.

Every route adds the prefill work it counted on (``routing.booked_work``) when it is issued; a
worker computes its prompts first in, first out, so the work drains at the worker's prefill
rate. The rate starts as the configured ``prefill_tokens_per_s`` and is then learned from what
the worker reports: a route that left pages to compute marks its last pending key, and the
Stored event for that key says when its prefill ended. Each such end

- **corrects the books**: everything booked up to that route is done, so the backlog left is
  what was booked after it, from that moment;
- **measures the rate**: the work done since the previous observed end (or since the route was
  issued, when the worker was idle then) over the time it took. The estimate is the work over
  the time of the last ``RATE_WINDOW`` measured prefills.

A measure includes the event's trip to the coordinator (a few ms), which makes the rate a
little low: the safe side, since a rate set too high makes routes wait behind work the
coordinator thinks done. Engines that prefill several prompts at once (chunked prefill batches
them) break the FIFO assumption; their measures still add up to the work done over the time
taken. Pure core: time comes from the caller.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

RATE_WINDOW = 32
"""Measured prefills the rate averages over: enough to smooth one odd prefill, few enough to
follow a change of model or load within a minute of traffic."""
MAX_MARKS = 1024
"""Routes awaiting their end at most; past it the oldest mark is forgotten (no measure)."""


@dataclass(frozen=True, slots=True)
class _Mark:
    booked_through: float  # work booked on the worker up to and including this route
    work: float
    issued_at: float
    queued: bool  # the worker had a backlog when the route was issued


class PrefillBacklog:
    """One worker's booked prefill work. ValueError for a rate that is not finite and > 0."""

    def __init__(self, tokens_per_s: float) -> None:
        if not (0 < tokens_per_s < float("inf")):
            raise ValueError(f"prefill_tokens_per_s must be finite and > 0, got {tokens_per_s!r}")
        self.configured_rate = tokens_per_s
        self._left = 0.0  # work queued at time _at
        self._at = 0.0
        self._booked = 0.0  # all work ever booked here
        self._marks: OrderedDict[bytes, _Mark] = OrderedDict()  # by last pending key
        self._measures: deque[tuple[float, float]] = deque(maxlen=RATE_WINDOW)  # (work, s)
        self._measured_work = 0.0
        self._measured_s = 0.0
        self._last_end: tuple[float, float] | None = None  # (booked_through, time)
        # Past this time the backlog is surely 0 (a second after it drained at the current
        # rate): tokens() answers without arithmetic, as it does for most of a fleet.
        self._zero_after = -math.inf

    @property
    def tokens_per_s(self) -> float:
        """The learned rate once a prefill was measured, else the configured one."""
        if self._measured_s > 0 and self._measured_work > 0:
            return self._measured_work / self._measured_s
        return self.configured_rate

    def tokens(self, now: float) -> float:
        """Prefill tokens still queued at ``now``: drained at the current rate since last
        booked or corrected."""
        if now > self._zero_after:
            return 0.0
        left = self._left - (now - self._at) * self.tokens_per_s
        return left if left > 0 else 0.0

    def _moved(self) -> None:
        """``_left``, ``_at`` or the rate changed: when the backlog is surely empty again."""
        self._zero_after = (self._at + self._left / self.tokens_per_s + 1.0
                            if self._left > 0 else -math.inf)

    def book(self, work: float, now: float, last_pending_key: bytes | None = None) -> None:
        """Add ``work`` tokens routed at ``now``; ``last_pending_key``, when the route left
        pages to compute, is the key whose Stored event will say its prefill ended."""
        left = self.tokens(now)
        self._left, self._at = left + work, now
        self._moved()
        self._booked += work
        if last_pending_key is not None and work > 0 and last_pending_key not in self._marks:
            self._marks[last_pending_key] = _Mark(self._booked, work, now, left > 0)
            if len(self._marks) > MAX_MARKS:
                self._marks.popitem(last=False)

    def observe_stored(self, keys: Iterable[bytes], now: float) -> None:
        """The worker stored ``keys`` (reported at ``now``): a route whose last pending key is
        among them has finished its prefill."""
        if not self._marks:
            return
        done: _Mark | None = None
        for key in keys:
            mark = self._marks.pop(key, None)
            if mark is not None and (done is None or mark.booked_through > done.booked_through):
                done = mark
        if done is not None:
            self._ended(done, now)

    def _ended(self, mark: _Mark, now: float) -> None:
        last = self._last_end
        if mark.queued and last is not None and last[0] < mark.booked_through:
            work, took = mark.booked_through - last[0], now - last[1]
        else:
            work, took = mark.work, now - mark.issued_at
        if took > 0 and work > 0:
            if len(self._measures) == self._measures.maxlen:
                old_work, old_s = self._measures[0]
                self._measured_work -= old_work
                self._measured_s -= old_s
            self._measures.append((work, took))
            self._measured_work += work
            self._measured_s += took
        self._last_end = (mark.booked_through, now)
        # Routes booked before this one are done too: their marks can never measure anything.
        for key in [k for k, m in self._marks.items() if m.booked_through <= mark.booked_through]:
            del self._marks[key]
        self._left, self._at = self._booked - mark.booked_through, now
        self._moved()
