"""A worker's prefill backlog as the coordinator books it, and the engine's costs it learns.

Every route adds the prefill work it counted on (``routing.booked_work``) when it is issued; a
worker computes its prompts first in, first out, so the work drains at the worker's pace. A
prompt costs ``per_route_s + work / tokens_per_s`` seconds: a fixed cost per request (the
engine's scheduling, its first decode step, the answer's trip: about 33 ms on a vLLM CPU engine
for a prompt it holds whole) and a per-token rate. Both start as the worker's measured peers
learned them (``peer_costs``; with none, as configured, the fixed cost at 0) and are then
learned from what the worker reports: a route that left pages to compute marks
its last pending keys (``END_KEYS`` of them: an engine publishes whole blocks only, so a
prompt's last page may sit in a block that is never stored, while the last full block is
stored when the prefill ends), and the first of them a Stored event reports says when its
prefill ended. Each such end

- **corrects the books**: everything booked up to that route is done, so the backlog left is
  what was booked after it, from that moment;
- **measures the engine**: the work and the routes done since the previous observed end (or
  the route alone, since it was issued, when the worker was idle then) over the time taken.
  Over the last ``RATE_WINDOW`` measures, ``time = routes x per_route_s + work / rate`` is
  fitted by least squares; while the measures cannot tell the two apart (too few, the same
  work per route, or a fit that is not positive), the fixed cost stays 0 and the rate is the
  work over the time, as before there was a fixed cost.

A measure includes the event's trip to the coordinator (a few ms), which makes the engine look
a little slower: the safe side, since a pace set too fast makes routes wait behind work the
coordinator thinks done. Engines that prefill several prompts at once (chunked prefill batches
them) break the FIFO assumption; their measures still add up to the work done over the time
taken. The backlog is read in token-equivalents (seconds left x rate), the unit of the
router's cost. Pure core: time comes from the caller.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from coordinator.core.fleet.peer_costs import PeerCosts

RATE_WINDOW = 32
"""Measured prefills the estimate uses: enough to smooth one odd prefill, few enough to follow
a change of model or load within a minute of traffic."""
MAX_MARKS = 1024
"""Routes awaiting their end at most; past it the oldest mark is forgotten (no measure)."""
END_KEYS = 4
"""Pending keys a route marks, its last ones: engines whose blocks hold up to this many pages
(a 64-token block with 16-token pages) confirm each prefill's end by its last full block."""
MIN_FIT = 8
"""Measures before the fixed cost is fitted at all."""
MIN_SPREAD = 0.1
"""The fit needs prompts of different sizes: the work per route must vary by at least this
share of its mean (else the fixed cost and the rate cannot be told apart)."""


@dataclass(frozen=True, slots=True)
class _Mark:
    booked_through: float  # work booked on the worker up to and including this route
    routes_through: int  # routes booked up to and including this one
    work: float
    issued_at: float
    queued: bool  # the worker had a backlog when the route was issued
    keys: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class _Measure:
    work: float
    routes: int
    seconds: float


class PrefillBacklog:
    """One worker's booked prefill work. ValueError for a rate that is not finite and > 0.
    ``peers``: the learned costs of the other workers of its model, which it costs its routes
    at until it has measured a prefill of its own (``peer_costs``); it adds its own to them."""

    def __init__(self, tokens_per_s: float, peers: PeerCosts | None = None) -> None:
        if not (0 < tokens_per_s < float("inf")):
            raise ValueError(f"prefill_tokens_per_s must be finite and > 0, got {tokens_per_s!r}")
        self.configured_rate = tokens_per_s
        self._peers = peers
        self.own_tokens_per_s = tokens_per_s  # as learned (the configured rate until then)
        self.own_per_route_s = 0.0  # as learned (0 until the measures can tell it apart)
        self._left_s = 0.0  # seconds of work queued at time _at
        self._at = 0.0
        self._booked = 0.0  # all work ever booked here
        self._routes = 0  # all routes ever booked here
        self._marks: OrderedDict[bytes, _Mark] = OrderedDict()  # by each of its end keys
        self._measures: deque[_Measure] = deque(maxlen=RATE_WINDOW)
        self._last_end: tuple[float, int, float] | None = None  # (booked, routes, time)
        # Past this time the backlog is surely 0 (a second after it drained): tokens() answers
        # without arithmetic, as it does for most of a fleet.
        self._zero_after = -math.inf

    @property
    def measured(self) -> bool:
        """Whether it has measured a prefill of its own engine."""
        return bool(self._measures)

    @property
    def tokens_per_s(self) -> float:
        """The rate: its own once a prefill was measured, else its peers' (their median),
        else the configured one."""
        if self._measures or self._peers is None:
            return self.own_tokens_per_s
        return self._peers.costs()[0]

    @property
    def per_route_s(self) -> float:
        """The fixed cost of a route: its own once measured (0 until the measures can tell it
        from the rate), else its peers'."""
        if self._measures or self._peers is None:
            return self.own_per_route_s
        return self._peers.costs()[1]

    def seconds(self, now: float) -> float:
        """Seconds of prefill still queued at ``now``."""
        if now > self._zero_after:
            return 0.0
        left = self._left_s - (now - self._at)
        return left if left > 0 else 0.0

    def tokens(self, now: float) -> float:
        """Prefill still queued at ``now``, in token-equivalents (seconds x the rate)."""
        if now > self._zero_after:
            return 0.0
        return self.seconds(now) * self.tokens_per_s

    def _moved(self) -> None:
        """``_left_s`` or ``_at`` changed: when the backlog is surely empty again."""
        self._zero_after = self._at + self._left_s + 1.0 if self._left_s > 0 else -math.inf

    def cost_s(self, work: float, routes: int = 1) -> float:
        """What ``routes`` routes with ``work`` tokens to compute take, at the learned costs."""
        return routes * self.per_route_s + work / self.tokens_per_s

    def book(self, work: float, now: float, end_keys: Sequence[bytes] = ()) -> None:
        """Add a route with ``work`` tokens to compute, routed at ``now``; ``end_keys``, when
        the route left pages to compute, are its last pending keys: the first of them a Stored
        event reports ends its prefill."""
        left = self.seconds(now)
        self._left_s, self._at = left + self.cost_s(work), now
        self._moved()
        self._booked += work
        self._routes += 1
        keys = tuple(k for k in end_keys[-END_KEYS:] if k not in self._marks)
        if keys and work > 0:
            mark = _Mark(self._booked, self._routes, work, now, left > 0, keys)
            for key in keys:
                self._marks[key] = mark
            while len(self._marks) > MAX_MARKS * END_KEYS:
                self._forget(next(iter(self._marks.values())))

    def _forget(self, mark: _Mark) -> None:
        for key in mark.keys:
            if self._marks.get(key) is mark:
                del self._marks[key]

    def observe_stored(self, keys: Iterable[bytes], now: float) -> None:
        """The worker stored ``keys`` (reported at ``now``): a route one of whose end keys is
        among them has finished its prefill."""
        if not self._marks:
            return
        done: _Mark | None = None
        for key in keys:
            mark = self._marks.get(key)
            if mark is not None and (done is None or mark.booked_through > done.booked_through):
                done = mark
        if done is not None:
            self._ended(done, now)

    def _ended(self, mark: _Mark, now: float) -> None:
        last = self._last_end
        if mark.queued and last is not None and last[0] < mark.booked_through:
            measure = _Measure(mark.booked_through - last[0], mark.routes_through - last[1],
                               now - last[2])
        else:
            measure = _Measure(mark.work, 1, now - mark.issued_at)
        if measure.seconds > 0 and measure.work > 0:
            self._measures.append(measure)
            self._fit()
            if self._peers is not None:
                self._peers.learned(self)
        self._last_end = (mark.booked_through, mark.routes_through, now)
        # Routes booked before this one are done too: their marks can never measure anything.
        for old in {id(m): m for m in self._marks.values()
                    if m.booked_through <= mark.booked_through}.values():
            self._forget(old)
        self._left_s = self.cost_s(self._booked - mark.booked_through,
                                   self._routes - mark.routes_through)
        self._at = now
        self._moved()

    def _fit(self) -> None:
        """The fixed cost and the rate from the window's measures (the module docstring)."""
        measures = self._measures
        work = sum(m.work for m in measures)
        seconds = sum(m.seconds for m in measures)
        self.own_per_route_s, self.own_tokens_per_s = 0.0, work / seconds
        if len(measures) < MIN_FIT:
            return
        per_route = [m.work / m.routes for m in measures]
        mean = sum(per_route) / len(per_route)
        if max(per_route) - min(per_route) < MIN_SPREAD * mean:
            return
        # Least squares of seconds = c x routes + u x work: the 2x2 normal equations.
        nn = sum(m.routes * m.routes for m in measures)
        nw = sum(m.routes * m.work for m in measures)
        ww = sum(m.work * m.work for m in measures)
        nt = sum(m.routes * m.seconds for m in measures)
        wt = sum(m.work * m.seconds for m in measures)
        det = nn * ww - nw * nw
        if det <= 0:
            return
        fixed, per_token = (nt * ww - wt * nw) / det, (nn * wt - nw * nt) / det
        if fixed > 0 and per_token > 0:
            self.own_per_route_s, self.own_tokens_per_s = fixed, 1 / per_token
