"""The simulation: replay a trace's arrivals through a routing policy and simulated workers.

One run per policy, each from scratch (fresh index, workers, and ``random.Random(seed)``), so
a policy's numbers do not depend on which others ran. Events are processed in time order; at
equal times a decode end comes before a prefill end, which comes before an arrival (a freed
server or page is visible to the request arriving at that instant), and arrivals keep trace
order. The index's clock is the simulated clock, so pending entries expire after the
production TTL of simulated time.

Bounds (hit ratio = cached prompt tokens / all prompt tokens, page granularity):

- ``infinite``: every page ever computed stays cached somewhere reachable.
- ``pooled``: one LRU cache of ``workers x capacity`` pages serving every request in arrival
  order, i.e. what perfect routing over the fleet's pooled memory could reach.

Determinism: no wall clock, no hash-order iteration; randomness only from the seeded rng.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from coordinator.hashing import Namespace, PageHasher
from coordinator.index import PrefixIndex
from coordinator.routing import KvAwareWeights
from kvcoord.simulate.cost_model import CostModel
from kvcoord.simulate.peers import DynamoLikeRouter, SglangLikeRouter
from kvcoord.simulate.routers import ProductionRouter, RouterContext, SimRouter
from kvcoord.simulate.simworker import Job, SimWorker
from kvcoord.simulate.trace import TraceRequest

PENDING_TTL_S = 2.0  # the coordinator's default pending_ttl_ms, in simulated seconds
_DECODE_DONE, _PREFILL_DONE = 0, 1  # event order at equal times

ROUTERS: Mapping[str, Callable[[RouterContext], SimRouter]] = MappingProxyType({
    "round_robin": lambda ctx: ProductionRouter("round_robin", ctx),
    "least_loaded": lambda ctx: ProductionRouter("least_loaded", ctx),
    "kv_aware": lambda ctx: ProductionRouter("kv_aware", ctx),
    "sglang_like": SglangLikeRouter,
    "dynamo_like": DynamoLikeRouter,
})


def check_policies(names: Sequence[str]) -> list[str]:
    """``names`` without duplicates (first kept); ValueError naming an unknown one."""
    for name in names:
        if name not in ROUTERS:
            raise ValueError(f"unknown policy {name!r}; known: {', '.join(ROUTERS)}")
    return list(dict.fromkeys(names))


@dataclass(frozen=True, slots=True)
class SimConfig:
    """A fleet: ``workers`` >= 1 workers of ``capacity_tokens`` KV tokens each (whole pages
    of ``namespace.page_size``; at least one page), the cost model, the router weights and the
    seed. ValueError otherwise."""

    workers: int
    capacity_tokens: int
    hasher: PageHasher
    namespace: Namespace
    cost: CostModel = field(default_factory=CostModel)
    weights: KvAwareWeights = field(default_factory=KvAwareWeights)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.capacity_tokens < self.namespace.page_size:
            raise ValueError(
                f"--capacity-tokens must hold at least one page of {self.namespace.page_size} "
                f"tokens, got {self.capacity_tokens}"
            )

    @property
    def pages_per_worker(self) -> int:
        return self.capacity_tokens // self.namespace.page_size


@dataclass(frozen=True, slots=True)
class PolicyRun:
    """One policy's raw outcome: per request (trace order) its cached and prompt tokens and
    TTFT in seconds; per worker (position order) its computed prefill tokens."""

    name: str
    cached_tokens: tuple[int, ...]
    prompt_tokens: tuple[int, ...]
    ttft_s: tuple[float, ...]
    worker_prefill_tokens: tuple[int, ...]


def run_policy(
    name: str,
    requests: Sequence[TraceRequest],
    keys: Sequence[list[bytes]],
    config: SimConfig,
    progress: Callable[[int], None] | None = None,
) -> PolicyRun:
    """Replay ``requests`` (arrival order, with their page ``keys``) under policy ``name``;
    ``progress(n)`` is called as arrivals are routed (n = how many since the last call)."""
    clock = [0.0]
    index = PrefixIndex(clock=lambda: clock[0], pending_ttl=PENDING_TTL_S)
    width = len(str(config.workers - 1))
    workers = [
        SimWorker(f"w{i:0{width}d}", config.pages_per_worker, hasher=config.hasher,
                  namespace=config.namespace, cost=config.cost, index=index)
        for i in range(config.workers)
    ]
    ctx = RouterContext(workers, index, config.namespace.page_size,
                        random.Random(config.seed), config.weights)
    router = ROUTERS[check_policies([name])[0]](ctx)
    events: list[tuple[float, int, int, int, Job]] = []
    order = itertools.count()
    ttft = [0.0] * len(requests)
    cached = [0] * len(requests)

    def start(w: int, now: float) -> None:
        job = workers[w].start_next(now)
        if job is not None:
            heapq.heappush(events, (job.prefill_end_s, _PREFILL_DONE, next(order), w, job))

    def handle_until(limit: float) -> None:
        while events and events[0][0] <= limit:
            now, kind, _, w, job = heapq.heappop(events)
            clock[0] = now
            if kind == _PREFILL_DONE:
                workers[w].finish_prefill(job)
                router.on_prefill_done(w, job)
                ttft[job.request.index] = now - job.arrival_s
                cached[job.request.index] = job.cached_tokens
                done = now + config.cost.decode_s(job.request.output_length)
                heapq.heappush(events, (done, _DECODE_DONE, next(order), w, job))
            else:
                workers[w].finish_decode(job)
                router.on_finished(w, job)
            start(w, now)

    step = max(1, len(requests) // 100)
    for i, request in enumerate(requests):
        now = request.timestamp_ms / 1000.0
        handle_until(now)
        clock[0] = now
        job = Job(request, keys[i], now)
        details = index.match_detail(job.keys, include_pending=True) if job.keys else {}
        w = router.route(job, details, now)
        detail = details.get(workers[w].worker_id)
        expected = detail.pages * config.namespace.page_size if detail is not None else 0
        job.expected_uncached = max(0, request.input_length - expected)
        workers[w].enqueue(job)
        start(w, now)
        if progress is not None and (i + 1) % step == 0:
            progress(step)
    handle_until(math.inf)
    if progress is not None and len(requests) % step:
        progress(len(requests) % step)
    return PolicyRun(
        name, tuple(cached), tuple(r.input_length for r in requests), tuple(ttft),
        tuple(w.computed_tokens for w in workers),
    )


def infinite_bound(requests: Sequence[TraceRequest], keys: Sequence[list[bytes]],
                   page_size: int) -> float:
    """Hit ratio if every computed page stayed cached forever (an upper bound for any fleet)."""
    seen: set[bytes] = set()
    hit = total = 0
    for request, prompt_keys in zip(requests, keys, strict=True):
        depth = 0
        for key in prompt_keys:
            if key not in seen:
                break
            depth += 1
        hit += min(depth * page_size, request.input_length)
        total += request.input_length
        seen.update(prompt_keys)
    return hit / total if total else 0.0


def pooled_bound(requests: Sequence[TraceRequest], keys: Sequence[list[bytes]],
                 config: SimConfig) -> float:
    """Hit ratio of one LRU cache of the whole fleet's pages (``workers x capacity``),
    requests served one at a time in arrival order by the production allocator and prefix
    cache. A prompt larger than the pool streams through uncached."""
    page = config.namespace.page_size
    pool = SimWorker("pooled", config.pages_per_worker * config.workers, hasher=config.hasher,
                     namespace=config.namespace, cost=config.cost)
    cache, allocator = pool.cache, pool.allocator
    hit = total = 0
    for request, prompt_keys in zip(requests, keys, strict=True):
        found = cache.lookup(prompt_keys)
        hit += min(len(found.pages) * page, request.input_length)
        total += request.input_length
        need = math.ceil(request.input_length / page) - len(found.pages)
        if len(found.pages) + need > allocator.n_pages:
            cache.release(found.pages)
            continue
        pages = found.pages + allocator.alloc(need)
        new_keys = prompt_keys[len(found.pages):]
        cache.record(new_keys, pages[len(found.pages): len(found.pages) + len(new_keys)])
        cache.release(pages)
    return hit / total if total else 0.0
