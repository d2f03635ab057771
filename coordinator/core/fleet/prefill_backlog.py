"""A worker's prefill backlog as the coordinator books it, and the engine's costs it learns.

Every route adds the prefill work it counted on (``routing.booked_work``) when it is issued; a
worker computes its prompts first in, first out, so the work drains at the worker's pace. A
prompt costs ``per_route_s + (work + attention / attention_tokens) / tokens_per_s`` seconds: a
fixed cost per request (the engine's scheduling, its first decode step, the answer's trip: about
33 ms on a vLLM CPU engine for a prompt it holds whole), a per-token rate, and attention: a
token at position ``p`` attends to the ``p`` before it, so it costs ``1 + p / attention_tokens``
tokens at position 0 (``attention_positions``: the sum of the positions computed, taken to be
the prompt's last ``work`` tokens; a long prompt's tail costs more than a short prompt's
start: on a 2-layer model on a CPU engine a token at position 550 costs two at position 0, on a
GPU attention weighs far less). All three start as the worker's measured peers learned them
(``peer_costs``; with none, as configured, the fixed cost at 0 and no attention) and are then
learned from what the worker reports: a route that left pages to compute marks
its last pending keys (``END_KEYS`` of them: an engine publishes whole blocks only, so a
prompt's last page may sit in a block that is never stored, while the last full block is
stored when the prefill ends), and the first of them a Stored event reports says when its
prefill ended. Each such end

- **corrects the books**: everything booked up to that route is done, so the backlog left is
  what was booked after it, from that moment;
- **measures the engine**: the work and the routes done since the previous observed end (or
  the route alone, since it was issued, when the worker was idle then) over the time taken.
  Over the last ``RATE_WINDOW`` measures, ``time = routes x f + work x u + attention x v``
  is fitted by least squares (``_fit``): all three terms, else the fixed cost and the rate,
  else the rate and attention, the first whose every coefficient is positive; while the
  measures cannot tell the terms apart (too few, the same work per route, a fit that is not
  positive), the fixed cost stays 0, attention is left out and the rate is the work over the
  time.

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


def attention_positions(work: float, context_tokens: int) -> float:
    """The positions a prefill of ``work`` tokens attends over, summed, when they are the last
    ones of a ``context_tokens``-token prompt: ``(n^2 - c^2) / 2`` for ``c = n - work``
    (0 when the context is unknown, 0)."""
    if context_tokens <= 0 or work <= 0:
        return 0.0
    start = max(0.0, context_tokens - work)
    return (context_tokens * context_tokens - start * start) / 2


@dataclass(frozen=True, slots=True)
class _Mark:
    booked_through: float  # work booked on the worker up to and including this route
    routes_through: int  # routes booked up to and including this one
    attention_through: float  # attention positions booked up to and including this route
    work: float
    attention: float
    issued_at: float
    queued: bool  # the worker had a backlog when the route was issued
    keys: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class _Measure:
    work: float
    routes: int
    attention: float
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
        self.own_attention_tokens = math.inf  # as learned (none until the measures show it)
        self._left_s = 0.0  # seconds of work queued at time _at
        self._at = 0.0
        self._booked = 0.0  # all work ever booked here
        self._routes = 0  # all routes ever booked here
        self._attention = 0.0  # all attention positions ever booked here
        self._marks: OrderedDict[bytes, _Mark] = OrderedDict()  # by each of its end keys
        self._measures: deque[_Measure] = deque(maxlen=RATE_WINDOW)
        self._last_end: _Mark | None = None  # the route whose end was seen last
        self._last_end_at = 0.0
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

    @property
    def attention_tokens(self) -> float:
        """The position at which a token costs two at position 0: its own once measured
        (infinite, no attention, until the measures show it), else its peers'."""
        if self._measures or self._peers is None:
            return self.own_attention_tokens
        return self._peers.costs()[2]

    @property
    def model_attention_tokens(self) -> float:
        """Attention as its model's workers learned it (the median over the measured ones,
        itself included; its own without peers): what a prompt's own prefill is priced at on
        every worker of the model alike, so that one engine's noisier estimate does not make
        it look cheaper for every fresh prompt (idle workers stay tied)."""
        if self._peers is None:
            return self.own_attention_tokens
        return self._peers.costs()[2]

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

    def cost_s(self, work: float, routes: int = 1, attention: float = 0.0) -> float:
        """What ``routes`` routes with ``work`` tokens to compute over ``attention`` positions
        (``attention_positions``) take, at the learned costs."""
        return routes * self.per_route_s + (
            work + attention / self.attention_tokens) / self.tokens_per_s

    def book(self, work: float, now: float, end_keys: Sequence[bytes] = (),
             context_tokens: int = 0) -> None:
        """Add a route with ``work`` tokens to compute, the last of its ``context_tokens``
        (0: unknown, no attention counted), routed at ``now``; ``end_keys``, when the route
        left pages to compute, are its last pending keys: the first of them a Stored event
        reports ends its prefill."""
        attention = attention_positions(work, context_tokens)
        left = self.seconds(now)
        self._left_s, self._at = left + self.cost_s(work, 1, attention), now
        self._moved()
        self._booked += work
        self._routes += 1
        self._attention += attention
        keys = tuple(k for k in end_keys[-END_KEYS:] if k not in self._marks)
        if keys and work > 0:
            mark = _Mark(self._booked, self._routes, self._attention, work, attention, now,
                         left > 0, keys)
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
        if mark.queued and last is not None and last.booked_through < mark.booked_through:
            measure = _Measure(mark.booked_through - last.booked_through,
                               mark.routes_through - last.routes_through,
                               mark.attention_through - last.attention_through,
                               now - self._last_end_at)
        else:
            measure = _Measure(mark.work, 1, mark.attention, now - mark.issued_at)
        if measure.seconds > 0 and measure.work > 0:
            self._measures.append(measure)
            self._fit()
            if self._peers is not None:
                self._peers.learned(self)
        self._last_end, self._last_end_at = mark, now
        # Routes booked before this one are done too: their marks can never measure anything.
        for old in {id(m): m for m in self._marks.values()
                    if m.booked_through <= mark.booked_through}.values():
            self._forget(old)
        self._left_s = self.cost_s(self._booked - mark.booked_through,
                                   self._routes - mark.routes_through,
                                   self._attention - mark.attention_through)
        self._at = now
        self._moved()

    def _fit(self) -> None:
        """The fixed cost, the rate and attention from the window's measures (the module
        docstring)."""
        measures = self._measures
        work = sum(m.work for m in measures)
        seconds = sum(m.seconds for m in measures)
        self.own_per_route_s, self.own_tokens_per_s = 0.0, work / seconds
        self.own_attention_tokens = math.inf
        if len(measures) < MIN_FIT:
            return
        per_route = [m.work / m.routes for m in measures]
        mean = sum(per_route) / len(per_route)
        if max(per_route) - min(per_route) < MIN_SPREAD * mean:
            return
        times = [m.seconds for m in measures]
        routes = [float(m.routes) for m in measures]
        works = [m.work for m in measures]
        attention = [m.attention for m in measures]
        fit = next(((columns, fitted) for columns in ((routes, works, attention),
                                                      (routes, works), (works, attention))
                    if (fitted := least_squares(columns, times)) is not None
                    and min(fitted) > 0), None)
        if fit is None:
            return
        columns, fitted = fit
        if columns[0] is routes:
            self.own_per_route_s, per_token = fitted[0], fitted[1]
        else:
            per_token = fitted[0]
        self.own_tokens_per_s = 1 / per_token
        if columns[-1] is attention:
            # seconds per position = 1 / (attention_tokens x rate)
            self.own_attention_tokens = per_token / fitted[-1]


def least_squares(columns: Sequence[Sequence[float]],
                  targets: Sequence[float]) -> list[float] | None:
    """The coefficients ``x`` that minimise ``|sum_j x_j columns[j] - targets|``, by the
    normal equations on columns scaled to unit size; None when the columns cannot be told
    apart (one is nearly a combination of the others, or all zero)."""
    scales = [math.sqrt(sum(v * v for v in column)) for column in columns]
    if min(scales) == 0:
        return None
    scaled = [[v / scale for v in column] for column, scale in zip(columns, scales, strict=True)]
    n = len(scaled)
    # [A^T A | A^T b], solved by Gaussian elimination with partial pivoting.
    rows = [[sum(a * b for a, b in zip(scaled[i], scaled[j], strict=True)) for j in range(n)]
            + [sum(a * t for a, t in zip(scaled[i], targets, strict=True))] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        # Unit columns: a pivot this small means a near-combination (a condition past 1e8).
        if abs(rows[pivot][col]) < 1e-8:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(n):
            if r != col:
                factor = rows[r][col] / rows[col][col]
                rows[r] = [a - factor * b for a, b in zip(rows[r], rows[col], strict=True)]
    return [rows[i][n] / rows[i][i] / scales[i] for i in range(n)]
