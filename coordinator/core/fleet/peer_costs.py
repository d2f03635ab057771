"""``PeerCosts``: the engine costs that one model's workers have learned, pooled for the ones
that have not measured a prefill yet.

A worker's prefill backlog starts at a configured rate (15,000 tokens/s, a GPU's), and learns
its engine's own rate, fixed cost per request and attention from the prefills it sees end
(``prefill_backlog``). Until it has, the configured guess can be far off (a vLLM CPU engine
does about 300 to 3,000 tokens/s), and a worker judged by a guess five times too fast drains its
booked work five times too soon, so it takes nearly every new prompt while a measured peer
waits. Engines serving one model run at about one pace, so a worker that has measured nothing
yet costs its routes at the median of what its measured peers learned; with no measured peer,
at the configured rate. Medians, not means: one odd engine moves them least. Pure core.
"""

from __future__ import annotations

import math
import statistics
from typing import Protocol


class LearnedCosts(Protocol):
    """What a backlog has learned: its rate, fixed cost per route and attention position."""

    @property
    def own_tokens_per_s(self) -> float: ...

    @property
    def own_per_route_s(self) -> float: ...

    @property
    def own_attention_tokens(self) -> float: ...


class PeerCosts:
    """Learned costs by worker backlog (one model's); read as medians, recomputed on read
    after a change (a fleet learns at every prefill end, and reads these only for its
    unmeasured workers)."""

    def __init__(self, configured_tokens_per_s: float) -> None:
        self.configured_tokens_per_s = configured_tokens_per_s
        self._learned: dict[LearnedCosts, tuple[float, float, float]] = {}
        self._medians: tuple[float, float, float] | None = None  # None: computed on read

    def learned(self, backlog: LearnedCosts) -> None:
        """``backlog`` measured its engine (again): its costs count from now on."""
        self._learned[backlog] = (backlog.own_tokens_per_s, backlog.own_per_route_s,
                                  backlog.own_attention_tokens)
        self._medians = None

    def forget(self, backlog: LearnedCosts) -> None:
        """``backlog``'s worker left the fleet: its costs no longer count."""
        if self._learned.pop(backlog, None) is not None:
            self._medians = None

    def costs(self) -> tuple[float, float, float]:
        """(tokens per second, seconds per route, attention tokens) for a worker that has
        measured nothing (``prefill_backlog``; attention infinite for a peer that has not
        shown any)."""
        if self._medians is None:
            if self._learned:
                values = self._learned.values()
                self._medians = (statistics.median(rate for rate, _, _ in values),
                                 statistics.median(fixed for _, fixed, _ in values),
                                 statistics.median(at for _, _, at in values))
            else:
                self._medians = (self.configured_tokens_per_s, 0.0, math.inf)
        return self._medians
