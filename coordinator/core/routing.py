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
from dataclasses import dataclass, fields
from itertools import chain
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

from coordinator.core.errors import Unavailable
from coordinator.core.tier_costs import TierCosts

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


def _require_non_negative(value: DataclassInstance) -> None:
    """Raise ValueError unless every numeric field of ``value`` is finite and >= 0."""
    for field in fields(value):
        v = getattr(value, field.name)
        # NaN or inf would make cost comparisons meaningless.
        if isinstance(v, int | float) and not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{type(value).__name__}.{field.name} must be >= 0, got {v!r}")


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's load as the router sees it: its last heartbeat plus the coordinator's count
    of routes issued since (so a burst between heartbeats does not pile onto one worker).

    ``running_requests``, ``queued_tokens`` (prefill + decode tokens queued), ``free_pages`` and
    ``total_pages`` come from the heartbeat; ``inflight_routes`` and ``inflight_tokens`` (their
    uncached prefill tokens) are routes issued and not yet reported finished.
    ``prefill_backlog_tokens`` is the coordinator's estimate of the prefill work queued at the
    worker when the route is chosen: the routes it issued there, drained at the worker's
    prefill rate (``RegisteredWorker.prefill_backlog``). ``active_tokens`` are the prompt
    tokens of the routes in flight there: KV they pin until they finish. All >= 0.
    ``total_pages == 0`` means the capacity is unknown (no heartbeat yet): no memory pressure
    is charged then, rather than treating the worker as full.
    """

    running_requests: int = 0
    queued_tokens: int = 0
    free_pages: int = 0
    total_pages: int = 0
    inflight_routes: int = 0
    inflight_tokens: int = 0
    prefill_backlog_tokens: float = 0.0
    active_tokens: int = 0

    def __post_init__(self) -> None:
        # Built for every eligible worker on every route: explicit comparisons, not the
        # generic field walk (which cost more than the routing decision itself).
        if min(self.running_requests, self.queued_tokens, self.free_pages, self.total_pages,
               self.inflight_routes, self.inflight_tokens, self.prefill_backlog_tokens,
               self.active_tokens) < 0:
            raise ValueError(f"WorkerLoad fields must be >= 0, got {self!r}")


@dataclass(frozen=True, slots=True)
class Candidate:
    """An eligible worker and what it holds of the prompt: ``cached_pages`` leading pages
    (confirmed + pending), of which ``lower_tier_pages`` sit in CPU/disk. Worker ids are unique
    among the candidates of one call. ValueError unless 0 <= lower_tier <= cached."""

    worker_id: str
    cached_pages: int
    lower_tier_pages: int
    load: WorkerLoad

    def __post_init__(self) -> None:
        if self.cached_pages < 0 or self.lower_tier_pages < 0:
            raise ValueError(f"Candidate page counts must be >= 0, got {self!r}")
        if self.lower_tier_pages > self.cached_pages:
            raise ValueError("Candidate.lower_tier_pages exceeds cached_pages")


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    """What is being routed: ``prompt_tokens`` tokens of which the first ``prompt_pages`` full
    pages are indexed (the partial last page is always computed), times ``copies`` identical
    prompts routed together (a RouteBatch group of GRPO siblings). ValueError unless
    page_size >= 1, copies >= 1 and prompt_pages <= prompt_tokens // page_size."""

    prompt_pages: int
    prompt_tokens: int
    page_size: int
    copies: int = 1

    def __post_init__(self) -> None:
        if self.prompt_pages < 0 or self.prompt_tokens < 0:
            raise ValueError(f"RoutingRequest counts must be >= 0, got {self!r}")
        if self.page_size < 1 or self.copies < 1:
            raise ValueError("RoutingRequest.page_size and copies must be >= 1")
        if self.prompt_pages > self.prompt_tokens // self.page_size:
            raise ValueError("RoutingRequest.prompt_pages exceeds the prompt's full pages")


@dataclass(frozen=True, slots=True)
class KvAwareWeights:
    """Exchange rates into prefill-token equivalents (config; all finite and >= 0, else
    ValueError). With the defaults, a worker's cost is its time to first token for the prompt
    plus what the route costs the fleet's cache afterwards, both in prefill tokens:

    - ``prefill_token``: per prompt token the worker must compute (not cached).
    - ``lower_tier_token``: per cached token that must first move up from CPU/disk: derived,
      not tuned: the copy back's time in prefill tokens (``TierCosts.lower_tier_token``; the
      coordinator derives it from its config, ``CoordinatorConfig.kv_weights``).
    - ``queued_token``: per token of prefill backlog the prompt would wait behind
      (``WorkerLoad.prefill_backlog_tokens``).
    - ``running_request``: per request decoding there or routed and in flight.
    - ``memory_pressure``: per token of pages the prompt needs beyond the worker's free pages,
      and per token its copies overflow the pages its routes in flight pin.
    - ``duplicate_token``: per token of the prompt that its best holder caches and this worker
      does not: the copy a move would make.
    """

    prefill_token: float = 1.0
    # A transfer over PCIe is cheaper than recomputing the page, not free: 0.079 by default.
    lower_tier_token: float = TierCosts().lower_tier_token
    # The backlog delays the prompt's first token by exactly its own prefill time, so 1.0 makes
    # the cost a TTFT estimate (Dynamo weighs overlap and load 1:1 by default too).
    queued_token: float = 1.0
    # A running request with a ~2k-token context adds one KV read (2k x 128 KiB = 256 MB, about
    # 0.08 ms on an H100) to every engine step: about one prefill token's time (~15k tok/s).
    # A prefill spans a few chunked steps and its decode competes afterwards, so ~8 tokens:
    # enough to split workers with equal queues, far below one cached page's saving.
    running_request: float = 8.0
    # A page short forces evicting a cached page; charging its tokens as if they will be
    # recomputed once is the upper bound (LRU evicts the coldest page). A token beyond what the
    # running sequences leave preempts one of them, recomputed later: the same price.
    memory_pressure: float = 1.0
    # Locality's future value. Sending a prompt away from the worker holding its prefix
    # recomputes the prefix now (prefill_token) and leaves the fleet holding it twice: the
    # copy displaces as many tokens of other prefixes from the fleet's memory as it holds, the
    # same loss memory_pressure prices for one worker's eviction, charged the same way (as
    # recomputed once). Without it the cost is one request's TTFT alone, which moves a
    # prefix whenever its holder is a little busier and halves what the fleet can hold.
    duplicate_token: float = 1.0

    def __post_init__(self) -> None:
        _require_non_negative(self)


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen worker, its ``kv_aware`` cost under the policy's weights (whatever the
    policy, so policies compare on one scale) and its cached pages of the prompt."""

    worker_id: str
    cost: float
    cached_pages: int


class NoEligibleWorker(Unavailable):
    """No candidate to choose from; the interceptor answers UNAVAILABLE."""


class RouteChooser(Protocol):
    """Chooses one of ``candidates`` (and ``idle``) for ``request``. Never mutates the
    arguments; draws randomness only from ``rng``; raises NoEligibleWorker when there is no
    candidate at all and ValueError when a candidate claims more cached pages than the prompt
    has.

    ``idle`` holds further candidates that cache none of the prompt, in ascending
    ``load_floor`` order under the policy's weights. A policy may stop reading it once no
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


POLICIES: Mapping[str, Callable[[KvAwareWeights], RouteChooser]] = MappingProxyType(
    {p.name: p for p in (KvAwareChooser, RoundRobinChooser, LeastLoadedChooser)}
)


def make_chooser(name: str, weights: KvAwareWeights | None = None) -> RouteChooser:
    """A fresh policy named ``name`` (default weights when None); ValueError for an unknown
    name, listing the known ones."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    return factory(weights if weights is not None else KvAwareWeights())


@dataclass(frozen=True, slots=True)
class BatchGroup:
    """Indices into a batch of prompts that are identical for routing, ascending."""

    members: tuple[int, ...]


def group_identical(
    prompt_keys: Sequence[Sequence[bytes]], prompt_tokens: Sequence[Sequence[int] | int]
) -> list[BatchGroup]:
    """Group prompts with the same page keys and the same token count (token ids or a count).

    Such prompts (GRPO siblings) share every cacheable page and cost the same, so the server
    routes each group once. A prompt with no full page is a group of its own: there is nothing
    to share, and lumping every short prompt onto one worker would hot-spot it. Groups come in
    order of their first member. ValueError when the two sequences differ in length.
    """
    if len(prompt_keys) != len(prompt_tokens):
        raise ValueError("prompt_keys and prompt_tokens differ in length")
    groups: dict[object, list[int]] = {}
    for i, (keys, tokens) in enumerate(zip(prompt_keys, prompt_tokens, strict=True)):
        n_tokens = tokens if isinstance(tokens, int) else len(tokens)
        identity: object = (tuple(keys), n_tokens) if keys else i
        groups.setdefault(identity, []).append(i)
    return [BatchGroup(tuple(members)) for members in groups.values()]


def execution_order(prompt_keys: Sequence[Sequence[bytes]], assigned: Sequence[str]) -> list[int]:
    """A permutation of ``range(n)``: prompts by page-key sequence, lexicographically.

    That is a depth-first walk of the batch's prefix trie, so every set of prompts sharing a
    prefix is contiguous, siblings run back to back, and each worker's own subsequence is a
    depth-first walk too (its second prompt with a prefix finds the pages cached). Equal key
    sequences go by ``assigned`` worker (a group split over workers stays together per worker),
    then by input position. ValueError when the two sequences differ in length.
    """
    if len(prompt_keys) != len(assigned):
        raise ValueError("prompt_keys and assigned differ in length")
    # sorted() is stable, so equal (keys, worker) pairs keep their input order.
    return sorted(range(len(prompt_keys)), key=lambda i: (tuple(prompt_keys[i]), assigned[i]))
