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

from coordinator.core.errors import Unavailable
from coordinator.core.fleet import Candidate, WorkerLoad
from coordinator.core.routing.routing_values import Decision, KvAwareWeights, RoutingRequest


class NoEligibleWorker(Unavailable):
    """No candidate to choose from; the interceptor answers UNAVAILABLE."""


class RouteChooser(Protocol):
    """Chooses one of ``candidates`` (and ``idle``) for ``request``. Never mutates the
    arguments; draws randomness only from ``rng``; raises NoEligibleWorker when there is no
    candidate at all and ValueError when a candidate claims more cached pages than the prompt
    has.

    ``idle`` holds further candidates that cache none of the prompt, in ascending
    ``load_floor`` order under the chooser's weights. A chooser may stop reading it once no
    later candidate can win (kv_aware does: a fleet's idle workers then cost O(few), not
    O(fleet), per route); the others read it all.
    """

    name: str

    def choose(
        self,
        request: RoutingRequest,
        candidates: Sequence[Candidate],
        rng: random.Random,
        idle: Iterable[Candidate] = (),
    ) -> Decision: ...


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
    caches beyond this worker's are charged ``duplicate_token`` each.
    """
    if candidate.cached_pages > request.prompt_pages:
        raise ValueError(f"worker {candidate.worker_id!r} caches more pages than the prompt has")
    page, load = request.page_size, candidate.load
    tail_tokens = request.prompt_tokens - request.prompt_pages * page
    missing_pages = request.prompt_pages - candidate.cached_pages
    cost = (
        weights.prefill_token * prefill_work(request, candidate.cached_pages)
        + weights.lower_tier_token * candidate.lower_tier_pages * page
        + load_floor(load, weights)
        + weights.duplicate_token * max(0, best_cached_pages - candidate.cached_pages) * page
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


def _best_cached(candidates: Iterable[Candidate]) -> int:
    """The longest prefix (pages) any of ``candidates`` caches; 0 for none."""
    return max((c.cached_pages for c in candidates), default=0)


def _lowest(
    candidates: Sequence[Candidate],
    key: Callable[[Candidate], tuple[float, ...]],
    rng: random.Random,
) -> tuple[Candidate, tuple[float, ...]]:
    """The candidate with the smallest key, and that key; exact ties broken uniformly with
    ``rng`` (not drawn from without a tie). NoEligibleWorker when there is no candidate."""
    best: tuple[float, ...] = ()
    tied: list[Candidate] = []
    for candidate in candidates:
        k = key(candidate)
        if not tied or k < best:
            best, tied = k, [candidate]
        elif k == best:
            tied.append(candidate)
    if not tied:
        raise NoEligibleWorker("no eligible worker for this request")
    return (tied[0] if len(tied) == 1 else rng.choice(tied)), best


class KvAwareChooser:
    """Lowest ``kv_aware_cost`` wins, with ``best_cached_pages`` the longest prefix any
    candidate caches; exact ties are broken at random. Stateless."""

    name = "kv_aware"

    def __init__(self, weights: KvAwareWeights) -> None:
        self.weights = weights

    def choose(
        self,
        request: RoutingRequest,
        candidates: Sequence[Candidate],
        rng: random.Random,
        idle: Iterable[Candidate] = (),
    ) -> Decision:
        # kv_aware_cost with the request's constant terms hoisted out of the loop: this runs
        # for every eligible worker on every route. Same arithmetic, so costs (and ties) are
        # identical to kv_aware_cost's.
        w, page, pages = self.weights, request.page_size, request.prompt_pages
        tail = request.prompt_tokens - pages * page
        tail_pages = request.copies * math.ceil(tail / page)
        tail_cost = request.copies * tail
        footprint = request.copies * request.prompt_tokens
        best_cached = _best_cached(candidates)
        # Any worker caching nothing pays at least the whole prefill, the copy of the best
        # holder's prefix and its load floor.
        idle_base = (w.prefill_token * (pages * page + tail_cost)
                     + w.duplicate_token * best_cached * page)
        best = math.inf
        tied: list[Candidate] = []
        holders = len(candidates)
        for i, c in enumerate(chain(candidates, idle)):
            if i >= holders and idle_base + load_floor(c.load, w) > best:
                break  # idle arrives cheapest floor first: no later one can win
            cached, lower, load = c.cached_pages, c.lower_tier_pages, c.load
            if cached > pages:
                raise ValueError(f"worker {c.worker_id!r} caches more pages than the prompt has")
            missing = pages - cached
            cost = (
                w.prefill_token * (missing * page + tail_cost)
                + w.lower_tier_token * lower * page
                + (w.queued_token * load.prefill_backlog_tokens
                   + w.running_request * (load.running_requests + load.inflight_routes))
                + w.duplicate_token * (best_cached - cached) * page
            )
            if load.total_pages > 0:
                cost += w.memory_pressure * (
                    max(0, missing + lower + tail_pages - load.free_pages) * page
                    + max(0, load.active_tokens + footprint - load.total_pages * page))
            if cost < best:
                best, tied = cost, [c]
            elif cost == best:
                tied.append(c)
        if not tied:
            raise NoEligibleWorker("no eligible worker for this request")
        chosen = tied[0] if len(tied) == 1 else rng.choice(tied)
        return Decision(chosen.worker_id, best, chosen.cached_pages)


class RoundRobinChooser:
    """The first worker id after the last one chosen, wrapping to the smallest: a cursor over
    worker ids in sorted order that stays fair when workers come and go. Mutates only that
    cursor; not thread-safe (the coordinator routes from one event loop)."""

    name = "round_robin"

    def __init__(self, weights: KvAwareWeights) -> None:
        self.weights = weights
        self._last: str | None = None

    def choose(
        self,
        request: RoutingRequest,
        candidates: Sequence[Candidate],
        rng: random.Random,
        idle: Iterable[Candidate] = (),
    ) -> Decision:
        candidates = [*candidates, *idle]
        if not candidates:
            raise NoEligibleWorker("no eligible worker for this request")
        last = self._last
        later = [c for c in candidates if last is None or c.worker_id > last]
        chosen = min(later or candidates, key=lambda c: c.worker_id)
        cost = kv_aware_cost(request, chosen, self.weights, _best_cached(candidates))
        self._last = chosen.worker_id
        return Decision(chosen.worker_id, cost, chosen.cached_pages)


class LeastLoadedChooser:
    """Fewest running + in-flight requests, then fewest queued + in-flight tokens; ties at
    random. Ignores the cache (a baseline). Stateless."""

    name = "least_loaded"

    def __init__(self, weights: KvAwareWeights) -> None:
        self.weights = weights

    def choose(
        self,
        request: RoutingRequest,
        candidates: Sequence[Candidate],
        rng: random.Random,
        idle: Iterable[Candidate] = (),
    ) -> Decision:
        def load(c: Candidate) -> tuple[float, ...]:
            w = c.load
            return (w.running_requests + w.inflight_routes, w.queued_tokens + w.inflight_tokens)

        everyone = [*candidates, *idle]
        chosen, _ = _lowest(everyone, load, rng)
        cost = kv_aware_cost(request, chosen, self.weights, _best_cached(everyone))
        return Decision(chosen.worker_id, cost, chosen.cached_pages)


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
