"""The simulation: replay a trace's arrivals through a routing policy and simulated workers.

One run per (policy, seed), each from scratch (fresh index, workers, coordinator books and
``random.Random(seed)`` for tie-breaks), so a policy's numbers do not depend on which others
ran. The seed also jitters the arrivals (``arrivals``); under one seed every policy replays
the same arrivals. Events are processed in time order; at equal times a decode end comes
before a prefill end, then a delivered Sync message, then a heartbeat, then an arrival (a freed
server or page is visible to the request arriving at that instant), and arrivals keep their
order. The index's clock is the simulated clock, so pending entries expire after the
production TTL of simulated time.

What each router sees, and how late, is ``views``; what a worker costs is ``cost_model``.
A worker's page events reach the index as the production Sync events would: Stored and Moved
(``PrefixIndex.store(worker, keys, tier)``: a held key moves to that tier, so the index keeps
the one tier each worker holds it in) and Removed.

Determinism: no wall clock, no hash-order iteration; randomness only from the seeded rngs.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

from coordinator.core.fleet import WorkerLoad
from coordinator.core.hashing import Namespace, PageHasher
from coordinator.core.index import PageEvent, PagesStored, PrefixIndex
from coordinator.core.routing import KvAwareWeights
from kvcoord.simulate.arrivals import ARRIVAL_JITTER_MS, jittered_arrivals
from kvcoord.simulate.cost_model import CostModel
from kvcoord.simulate.peers import DynamoLikeRouter, SglangLikeRouter
from kvcoord.simulate.routers import ProductionRouter, RouterContext, SimRouter
from kvcoord.simulate.simworker import Job, SimWorker
from kvcoord.simulate.trace import TraceRequest
from kvcoord.simulate.views import SYNC_DELAY_S, CoordinatorLoads, HeartbeatClock

PENDING_TTL_S = 2.0  # the coordinator's default pending_ttl_ms, in simulated seconds
# Event kinds, in their order at equal times.
_DECODE_DONE, _PREFILL_DONE, _DELIVERY, _HEARTBEAT = range(4)

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
    of ``namespace.page_size``; at least one page) on the device and ``host_capacity_tokens``
    in host memory (an int >= 0; 0 = no host tier, else at least one page), the cost model,
    the router weights and the arrival jitter. ValueError otherwise."""

    workers: int
    capacity_tokens: int
    hasher: PageHasher
    namespace: Namespace
    cost: CostModel = field(default_factory=CostModel)
    weights: KvAwareWeights = field(default_factory=KvAwareWeights)
    arrival_jitter_ms: float = ARRIVAL_JITTER_MS
    host_capacity_tokens: int = 0

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.capacity_tokens < self.namespace.page_size:
            raise ValueError(
                f"--capacity-tokens must hold at least one page of {self.namespace.page_size} "
                f"tokens, got {self.capacity_tokens}"
            )
        if not (0 <= self.arrival_jitter_ms < math.inf):
            raise ValueError(f"--jitter-ms must be >= 0, got {self.arrival_jitter_ms}")
        check_host_capacity(self.host_capacity_tokens, self.namespace.page_size)

    @property
    def pages_per_worker(self) -> int:
        return self.capacity_tokens // self.namespace.page_size

    @property
    def host_pages_per_worker(self) -> int:
        return self.host_capacity_tokens // self.namespace.page_size


def check_host_capacity(tokens: object, page_size: int) -> None:
    """ValueError unless ``tokens`` is an int >= 0 that is 0 or holds at least one page."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(
            f"--host-capacity-tokens must be a whole number of tokens >= 0 (0: no host tier), "
            f"got {tokens!r}"
        )
    if 0 < tokens < page_size:
        raise ValueError(
            f"--host-capacity-tokens must be 0 or hold at least one page of {page_size} "
            f"tokens, got {tokens}"
        )


@dataclass(frozen=True, slots=True)
class PolicyRun:
    """One policy's raw outcome under one seed: per request (trace order) its cached tokens
    (either tier), prompt tokens, TTFT in seconds and the part of its cached tokens copied back
    from the host tier; per worker (position order) its computed prefill tokens."""

    name: str
    seed: int
    cached_tokens: tuple[int, ...]
    prompt_tokens: tuple[int, ...]
    ttft_s: tuple[float, ...]
    worker_prefill_tokens: tuple[int, ...]
    host_tokens: tuple[int, ...]


class _PrefillEnd(NamedTuple):
    """A prefill's scheduled end; stale once the job was re-timed (another generation)."""

    job: Job
    generation: int


class _Beat(NamedTuple):
    """A heartbeat on its way to the coordinator."""

    load: WorkerLoad
    completed_routes: int


class _Delivery(NamedTuple):
    """A worker's page event on its way to the index (after the Sync delay)."""

    worker_id: str
    event: PageEvent


def run_policy(
    name: str,
    requests: Sequence[TraceRequest],
    keys: Sequence[list[bytes]],
    config: SimConfig,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> PolicyRun:
    """Replay ``requests`` (with their page ``keys``) under policy ``name`` and ``seed``;
    ``progress(n)`` is called as arrivals are routed (n = how many since the last call)."""
    return _Replay(name, requests, keys, config, seed).run(progress)


class _Replay:
    """One (policy, seed) run's state; see the module docstring for the event order."""

    def __init__(self, name: str, requests: Sequence[TraceRequest],
                 keys: Sequence[list[bytes]], config: SimConfig, seed: int) -> None:
        self.name, self.requests, self.keys, self.config, self.seed = (
            name, requests, keys, config, seed)
        self.now = 0.0
        self.index = PrefixIndex(clock=lambda: self.now, pending_ttl=PENDING_TTL_S)
        width = len(str(config.workers - 1))
        self.workers = [
            SimWorker(f"w{i:0{width}d}", config.pages_per_worker, hasher=config.hasher,
                      namespace=config.namespace, cost=config.cost, publish=self._publish,
                      host_pages=config.host_pages_per_worker)
            for i in range(config.workers)
        ]
        self.position = {w.worker_id: i for i, w in enumerate(self.workers)}
        ids = [w.worker_id for w in self.workers]
        self.coordinator = CoordinatorLoads(ids, config.pages_per_worker)
        self.beats = HeartbeatClock(config.workers)
        ctx = RouterContext(ids, self.index, config.namespace.page_size, random.Random(seed),
                            config.weights, self.coordinator)
        self.router = ROUTERS[check_policies([name])[0]](ctx)
        self.events: list[tuple[float, int, int, int, object]] = []
        self.order = itertools.count()
        self.ttft = [0.0] * len(requests)
        self.cached = [0] * len(requests)
        self.host = [0] * len(requests)
        self.active = 0  # jobs routed and not finished

    def run(self, progress: Callable[[int], None] | None) -> PolicyRun:
        for w in range(len(self.workers)):
            self._push(0.0, _HEARTBEAT, w, self.beats.generation[w])
        arrivals = jittered_arrivals(self.requests, self.seed, self.config.arrival_jitter_ms)
        step = max(1, len(arrivals) // 100)
        for n, (arrival_s, i) in enumerate(arrivals, start=1):
            self._handle_until(arrival_s)
            self.now = arrival_s
            self._route(Job(self.requests[i], self.keys[i], arrival_s))
            if progress is not None and n % step == 0:
                progress(step)
        self._handle_until(math.inf)
        if progress is not None and len(arrivals) % step:
            progress(len(arrivals) % step)
        return PolicyRun(
            self.name, self.seed, tuple(self.cached),
            tuple(r.input_length for r in self.requests), tuple(self.ttft),
            tuple(w.computed_tokens for w in self.workers), tuple(self.host),
        )

    # ---- the event loop ---------------------------------------------------------------------

    def _push(self, at: float, kind: int, worker: int, payload: object) -> None:
        heapq.heappush(self.events, (at, kind, next(self.order), worker, payload))

    def _publish(self, worker_id: str, event: PageEvent) -> None:
        """A worker's page event, delivered to the index after the Sync delay."""
        self._push(self.now + SYNC_DELAY_S, _DELIVERY, self.position[worker_id],
                   _Delivery(worker_id, event))

    def _handle_until(self, limit: float) -> None:
        """Process every event up to ``limit``; with ``limit`` = inf, until no job is left
        (heartbeats would go on forever)."""
        events = self.events
        while events and events[0][0] <= limit and (limit < math.inf or self.active):
            self.now, kind, _, w, payload = heapq.heappop(events)
            if kind == _DECODE_DONE:
                assert isinstance(payload, Job)
                self._decode_done(w, payload)
            elif kind == _PREFILL_DONE:
                assert isinstance(payload, _PrefillEnd)
                job = payload.job
                if job.prefill_gen == payload.generation and job is self.workers[w].prefilling:
                    self._prefill_done(w, job)
            elif kind == _DELIVERY:
                self._deliver(w, payload)
            elif payload == self.beats.generation[w]:  # _HEARTBEAT, not superseded
                load, completed = self.workers[w].heartbeat()
                self._push(self.now + SYNC_DELAY_S, _DELIVERY, w, _Beat(load, completed))
                self._push(self.beats.sent(w, self.now), _HEARTBEAT, w, self.beats.generation[w])

    def _route(self, job: Job) -> None:
        details = self.index.match_detail(job.keys, include_pending=True) if job.keys else {}
        w = self.router.route(job, details, self.now)
        self.workers[w].enqueue(job)
        self.active += 1
        self._start(w)

    def _start(self, w: int) -> None:
        job = self.workers[w].start_next(self.now)
        if job is not None:
            self._push(job.prefill_end_s, _PREFILL_DONE, w, _PrefillEnd(job, job.prefill_gen))

    def _prefill_done(self, w: int, job: Job) -> None:
        self.workers[w].finish_prefill(job)
        self.router.on_prefill_done(w, job)
        self.ttft[job.request.index] = self.now - job.arrival_s
        self.cached[job.request.index] = job.cached_tokens
        self.host[job.request.index] = job.host_tokens
        done = self.now + self.config.cost.decode_s(job.request.output_length)
        self._push(done, _DECODE_DONE, w, job)
        self._start(w)

    def _decode_done(self, w: int, job: Job) -> None:
        running = self.workers[w].finish_decode(job, self.now)
        if running is not None:  # re-timed: its earlier end event is now stale
            self._push(running.prefill_end_s, _PREFILL_DONE, w,
                       _PrefillEnd(running, running.prefill_gen))
        self.router.on_finished(w, job)
        self.active -= 1
        sooner = self.beats.completed(w, self.now)
        if sooner is not None:
            self._push(sooner, _HEARTBEAT, w, self.beats.generation[w])
        self._start(w)

    def _deliver(self, w: int, message: object) -> None:
        if isinstance(message, _Delivery):
            # What the coordinator does with it: Stored or Moved keys are held in their tier now
            # (``store`` moves a held key), Removed keys are dropped.
            self.index.apply(message.worker_id, (message.event,))
            if type(message.event) is PagesStored:
                self.coordinator.stored(w, message.event.keys, self.now)
        else:
            assert isinstance(message, _Beat)
            self.coordinator.heartbeat(w, message.load, message.completed_routes)
