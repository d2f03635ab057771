"""Routing: which worker a prompt runs on, and in what order a batch runs.

Pure core: no I/O, no clock, no module state; randomness comes in as a ``random.Random``.
The caller passes only eligible workers, with matched depths from the index (pending included).
Costs are in *prefill-token equivalents* (1.0 = prefilling one uncached token), so a
``kv_aware`` cost estimates time to first token and each weight is an exchange rate.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import chain
from types import MappingProxyType
from typing import Protocol

from coordinator.core.fleet import Candidate, WorkerLoad, attention_positions
from coordinator.core.routing.routing_values import Decision, KvAwareWeights, RoutingRequest
from coordinator.core.routing.shortlists import (
    Shortlist,
    ShortlistEntry,
    decide,
    duplicate_cost,
)


class RouteChooser(Protocol):
    """A routing rule. ``shortlist`` ranks ``candidates`` (and ``idle``) for ``request`` and
    returns those tied at the lowest rank (``core.routing.shortlists``); ``decide`` picks one
    from the shortlists of one or more shards; ``choose`` is both over one set of candidates.
    None of them mutates the arguments; randomness is drawn only from ``rng``, in ``decide``;
    ``decide`` and ``choose`` raise NoEligibleWorker when there is no candidate at all, and
    every method ValueError when a candidate claims more cached pages than the prompt has.

    ``idle`` holds further candidates that cache none of the prompt, in ascending
    ``load_floor`` order under the chooser's weights. A chooser may stop reading it once no
    later candidate can win (kv_aware does: a fleet's idle workers then cost O(few), not
    O(fleet), per route); the others read it all.

    ``after``: round robin's cursor, the last worker id chosen (a shard asked by another
    replica is given that replica's); None = the chooser's own.
    """

    name: str

    def shortlist(
        self,
        request: RoutingRequest,
        candidates: Sequence[Candidate],
        idle: Iterable[Candidate] = (),
        after: str | None = None,
    ) -> Shortlist: ...

    def decide(self, request: RoutingRequest, shortlists: Sequence[Shortlist],
               rng: random.Random) -> Decision: ...

    def choose(
        self,
        request: RoutingRequest,
        candidates: Sequence[Candidate],
        rng: random.Random,
        idle: Iterable[Candidate] = (),
    ) -> Decision: ...

    @property
    def cursor(self) -> str | None: ...


class _ShortlistChooser:
    """What every rule shares: ``choose`` is ``decide`` over the rule's own shortlist, and
    ``decide`` is ``shortlists.decide`` (round robin also moves its cursor there)."""

    name = ""

    def __init__(self, weights: KvAwareWeights) -> None:
        self.weights = weights

    @property
    def cursor(self) -> str | None:
        return None

    def shortlist(self, request: RoutingRequest, candidates: Sequence[Candidate],
                  idle: Iterable[Candidate] = (), after: str | None = None) -> Shortlist:
        raise NotImplementedError

    def decide(self, request: RoutingRequest, shortlists: Sequence[Shortlist],
               rng: random.Random) -> Decision:
        return decide(shortlists, request, self.weights, rng)

    def choose(
        self,
        request: RoutingRequest,
        candidates: Sequence[Candidate],
        rng: random.Random,
        idle: Iterable[Candidate] = (),
    ) -> Decision:
        return self.decide(request, [self.shortlist(request, candidates, idle)], rng)


def load_floor(load: WorkerLoad, weights: KvAwareWeights) -> float:
    """The load terms of ``kv_aware_cost`` (prefill backlog and running work): what a worker
    costs beyond the prompt's own prefill, and a lower bound on that for a worker caching none
    of it."""
    return weights.queued_token * load.prefill_backlog_tokens + (
        weights.running_request * (load.running_requests + load.inflight_routes)
    )


def prefill_work(request: RoutingRequest, cached_pages: int) -> int:
    """The prompt tokens a worker caching ``cached_pages`` leading pages computes for
    ``request``: its missing pages once (copies run back to back) and every copy's tail."""
    tail_tokens = request.prompt_tokens - request.prompt_pages * request.page_size
    return (request.prompt_pages - cached_pages) * request.page_size + request.copies * tail_tokens


def prefill_cost(request: RoutingRequest, cached_pages: int, load: WorkerLoad) -> float:
    """The prompt's own prefill on a worker caching ``cached_pages`` leading pages, in
    tokens at position 0: ``prefill_work`` plus what its tokens attend over, at the worker's
    learned ``attention_tokens`` (``prefill_backlog``: a hit saves a prompt's start, the
    cheaper part, and leaves its tail to compute)."""
    work = prefill_work(request, cached_pages)
    if load.attention_tokens == math.inf:
        return float(work)
    return work + attention_positions(work, request.prompt_tokens) / load.attention_tokens


def booked_work(request: RoutingRequest, cached_pages: int, lower_tier_pages: int,
                weights: KvAwareWeights) -> int:
    """The work, in whole prefill tokens, a route adds to the backlog of a worker caching
    ``cached_pages`` leading pages of which ``lower_tier_pages`` in CPU/disk: the tokens it
    computes and the copy back of its lower-tier hits, which holds the same prefill server
    (``TierCosts``: a copy the next prefill waits for)."""
    return prefill_work(request, cached_pages) + math.ceil(
        weights.lower_tier_token * lower_tier_pages * request.page_size)


def overflow_tokens(request: RoutingRequest, load: WorkerLoad) -> int:
    """How far the prompt's copies overflow the worker's KV pages beside what its routes in
    flight pin (0 when its capacity is unknown): an engine out of pages preempts a running
    sequence and recomputes it later (vLLM's default), or holds the prompt back until
    decodes end."""
    if load.total_pages == 0:
        return 0
    return max(0, load.active_tokens + request.copies * request.prompt_tokens
               - load.total_pages * request.page_size)


def own_cost(request: RoutingRequest, candidate: Candidate, weights: KvAwareWeights) -> float:
    """``kv_aware_cost`` without the duplicate term: every term that depends on the candidate
    alone (``shortlists``: what a shard can compute without knowing the others)."""
    if candidate.cached_pages > request.prompt_pages:
        raise ValueError(f"worker {candidate.worker_id!r} caches more pages than the prompt has")
    page, load = request.page_size, candidate.load
    tail_tokens = request.prompt_tokens - request.prompt_pages * page
    missing_pages = request.prompt_pages - candidate.cached_pages
    cost = (
        weights.prefill_token * prefill_cost(request, candidate.cached_pages, load)
        + weights.lower_tier_token * candidate.lower_tier_pages * page
        + load_floor(load, weights)
    )
    if load.total_pages > 0:
        needed = (
            missing_pages
            + candidate.lower_tier_pages
            + request.copies * math.ceil(tail_tokens / page)
        )
        cost += weights.memory_pressure * (max(0, needed - load.free_pages) * page
                                           + overflow_tokens(request, load))
    return cost


def kv_aware_cost(
    request: RoutingRequest,
    candidate: Candidate,
    weights: KvAwareWeights,
    best_cached_pages: int = 0,
) -> float:
    """The estimated cost of running ``request`` on ``candidate``, in prefill-token units,
    where the longest prefix any candidate caches is ``best_cached_pages`` pages.

    Copies share the indexed pages (computed once: siblings run back to back) and each computes
    its own tail past them. GPU pages needed are the uncached and lower-tier pages plus each
    copy's tail pages; only those beyond the free pages are charged, and so are the tokens that
    overflow what the routes in flight leave (``overflow_tokens``). The pages the best holder
    caches beyond this worker's are charged ``duplicate_token`` each (added last:
    ``own_cost`` is the rest).
    """
    return own_cost(request, candidate, weights) + duplicate_cost(
        weights, request.page_size, best_cached_pages, candidate.cached_pages)


def _entry(request: RoutingRequest, candidate: Candidate,
           weights: KvAwareWeights) -> ShortlistEntry:
    return ShortlistEntry(candidate.worker_id, candidate.cached_pages,
                          own_cost(request, candidate, weights))


def _best_cached(candidates: Iterable[Candidate]) -> int:
    """The longest prefix (pages) any of ``candidates`` caches; 0 for none."""
    return max((c.cached_pages for c in candidates), default=0)


class KvAwareChooser(_ShortlistChooser):
    """Lowest ``kv_aware_cost`` wins, with ``best_cached_pages`` the longest prefix any
    candidate caches; exact ties are broken at random. Ranks by the cost less
    ``duplicate_token`` x its own cached tokens: the cost less a constant, so the same order
    whoever knows the best holder. Stateless."""

    name = "kv_aware"

    def shortlist(self, request: RoutingRequest, candidates: Sequence[Candidate],
                  idle: Iterable[Candidate] = (), after: str | None = None) -> Shortlist:
        # own_cost with the request's constant terms hoisted out of the loop: this runs for
        # every eligible worker on every route. Same arithmetic, so costs (and ties) are
        # identical to own_cost's.
        w, page, pages = self.weights, request.page_size, request.prompt_pages
        tail = request.prompt_tokens - pages * page
        tail_pages = request.copies * math.ceil(tail / page)
        tail_cost = request.copies * tail
        prompt_tokens = request.prompt_tokens
        footprint = request.copies * request.prompt_tokens
        dup_per_page = w.duplicate_token * page
        # Any worker caching nothing ranks at least at the whole prefill plus its load floor.
        idle_base = w.prefill_token * (pages * page + tail_cost)
        best = math.inf
        tied: list[ShortlistEntry] = []
        holders = len(candidates)
        for i, c in enumerate(chain(candidates, idle)):
            if i >= holders and idle_base + load_floor(c.load, w) > best:
                break  # idle arrives cheapest floor first: no later one can win
            cached, lower, load = c.cached_pages, c.lower_tier_pages, c.load
            if cached > pages:
                raise ValueError(f"worker {c.worker_id!r} caches more pages than the prompt has")
            missing = pages - cached
            computed: float = missing * page + tail_cost
            if load.attention_tokens != math.inf and computed > 0:
                # prefill_cost: the positions the computed tokens attend over.
                start = max(0, prompt_tokens - computed)
                computed += ((prompt_tokens * prompt_tokens - start * start) / 2
                             / load.attention_tokens)
            cost = (
                w.prefill_token * computed
                + w.lower_tier_token * lower * page
                + (w.queued_token * load.prefill_backlog_tokens
                   + w.running_request * (load.running_requests + load.inflight_routes))
            )
            if load.total_pages > 0:
                cost += w.memory_pressure * (
                    max(0, missing + lower + tail_pages - load.free_pages) * page
                    + max(0, load.active_tokens + footprint - load.total_pages * page))
            rank = cost - dup_per_page * cached
            if rank < best:
                best, tied = rank, [ShortlistEntry(c.worker_id, cached, cost)]
            elif rank == best:
                tied.append(ShortlistEntry(c.worker_id, cached, cost))
        return Shortlist((best,) if tied else (), tuple(tied), _best_cached(candidates))


class RoundRobinChooser(_ShortlistChooser):
    """The first worker id after the last one chosen, wrapping to the smallest: a cursor over
    worker ids in sorted order that stays fair when workers come and go. Mutates only that
    cursor (in ``decide``); not thread-safe (the coordinator routes from one event loop)."""

    name = "round_robin"

    def __init__(self, weights: KvAwareWeights) -> None:
        super().__init__(weights)
        self._last: str | None = None

    @property
    def cursor(self) -> str | None:
        return self._last

    def shortlist(self, request: RoutingRequest, candidates: Sequence[Candidate],
                  idle: Iterable[Candidate] = (), after: str | None = None) -> Shortlist:
        everyone = [*candidates, *idle]
        if not everyone:
            return Shortlist((), (), 0, lowest_id_wins=True)
        last = self._last if after is None else after

        def order(c: Candidate) -> tuple[float, str]:  # after the cursor first, then wrapped
            return (0.0 if last is None or c.worker_id > last else 1.0), c.worker_id

        chosen = min(everyone, key=order)
        return Shortlist((order(chosen)[0],), (_entry(request, chosen, self.weights),),
                         _best_cached(everyone), lowest_id_wins=True)

    def decide(self, request: RoutingRequest, shortlists: Sequence[Shortlist],
               rng: random.Random) -> Decision:
        decision = super().decide(request, shortlists, rng)
        self._last = decision.worker_id
        return decision


class LeastLoadedChooser(_ShortlistChooser):
    """Fewest running + in-flight requests, then fewest queued + in-flight tokens; ties at
    random. Ignores the cache (a baseline). Stateless."""

    name = "least_loaded"

    def shortlist(self, request: RoutingRequest, candidates: Sequence[Candidate],
                  idle: Iterable[Candidate] = (), after: str | None = None) -> Shortlist:
        def load(c: Candidate) -> tuple[float, ...]:
            w = c.load
            return (w.running_requests + w.inflight_routes, w.queued_tokens + w.inflight_tokens)

        everyone = [*candidates, *idle]
        if not everyone:
            return Shortlist((), (), 0)
        best = min(load(c) for c in everyone)
        tied = tuple(_entry(request, c, self.weights) for c in everyone if load(c) == best)
        return Shortlist(best, tied, _best_cached(everyone))


CHOOSERS: Mapping[str, Callable[[KvAwareWeights], RouteChooser]] = MappingProxyType(
    {p.name: p for p in (KvAwareChooser, RoundRobinChooser, LeastLoadedChooser)}
)


def make_chooser(name: str, weights: KvAwareWeights | None = None) -> RouteChooser:
    """A fresh chooser of the routing rule named ``name`` (default weights when None);
    ValueError for an unknown name, listing the known ones."""
    factory = CHOOSERS.get(name)
    if factory is None:
        # NOTE: "routing policy" here is the wire's word (the request's ``routing_policy``
        # field; PROTOCOL.md §6 quotes this message), kept though the code says "routing rule".
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(sorted(CHOOSERS))}")
    return factory(weights if weights is not None else KvAwareWeights())
