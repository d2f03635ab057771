"""Coordinator work per Route, in process: proto prompt -> keys -> index walk -> routing decision
-> pending entries, with no transport. This is the "coordinator work" of the issue's latency
requirement; bench_rpc measures the same path behind gRPC. ``wrong_routes`` (must be 0): answers
naming a worker that is not READY, or a matched depth that is not the index's."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from bench.workload import conversation_pool, fresh_prompts, populate
from coordinator.config import CoordinatorConfig
from coordinator.core.fleet import WorkerStatus
from coordinator.core.hashing import Namespace
from coordinator.core.hashing.page_hasher import tokens_to_bytes
from coordinator.core.routing import Scope
from coordinator.replica import CoordinatorReplica
from coordinator.server.convert import prompt_from
from coordinator.store.memory import MemoryStore
from coordinator.v1 import coordinator_pb2 as pb


def _per_call_us(calls: list[Callable[[], object]], repeats: int = 3) -> float:
    """Median over ``repeats`` passes of the mean µs per call."""
    passes = []
    for _ in range(repeats):
        started = time.perf_counter()
        for call in calls:
            call()
        passes.append((time.perf_counter() - started) / len(calls) * 1e6)
    return statistics.median(passes)


def bench_route_work(workers: int, quick: bool = False) -> dict[str, Any]:
    config = CoordinatorConfig(log_level="error")
    service = CoordinatorReplica(config, MemoryStore(namespace="bench"))
    populate(service, workers, conversations=32 if quick else 256)
    scheduler = service.router
    pool = conversation_pool(32 if quick else 256)
    ns = Namespace()
    by_keys = [pb.Prompt(page_keys=b"".join(service.hasher.page_keys(t, ns)), token_count=len(t))
               for t in pool]
    by_bytes = [pb.Prompt(token_bytes=tokens_to_bytes(t)) for t in pool]
    by_ids = [pb.Prompt(token_ids=t) for t in pool]
    fresh = [
        pb.Prompt(token_bytes=tokens_to_bytes(t)) for t in fresh_prompts(50 if quick else 400)
    ]

    def route(prompt: pb.Prompt) -> Callable[[], object]:
        return lambda: scheduler.route(prompt_from(prompt, config), Scope())

    def batch(prompts: list[pb.Prompt]) -> Callable[[], object]:
        return lambda: scheduler.route_batch([prompt_from(p, config) for p in prompts], Scope())

    grpo = [[by_bytes[(start + i) % len(by_bytes)] for i in range(16)] * 4
            for start in range(0, len(by_bytes), 16)]
    timed = {
        "route_us.page_keys": _per_call_us([route(p) for p in by_keys] * 4),
        "route_us.token_bytes": _per_call_us([route(p) for p in by_bytes] * 4),
        "route_us.token_ids": _per_call_us([route(p) for p in by_ids] * 2),
        "route_us.token_bytes_fresh": _per_call_us([route(p) for p in fresh], repeats=1),
        "lookup_us.token_bytes": _per_call_us(
            [lambda p=p: scheduler.lookup(prompt_from(p, config), Scope()) for p in by_bytes]
        ),
        "route_batch_us_per_prompt": _per_call_us([batch(b) for b in grpo]) / 64,
    }
    return {**timed, "routes_checked": len(pool), "wrong_routes": _wrong_routes(service, pool)}


def _wrong_routes(service: CoordinatorReplica, pool: list[list[int]]) -> int:
    """Route every prompt once more and count the answers that are wrong: a worker that is not
    READY in the fleet, or ``matched_pages`` that is not that worker's confirmed depth in the
    index (the route claims a cache hit the worker does not hold, or misses one it does)."""
    config, now = service.config, service.clock()
    ns = Namespace(page_size=config.page_size)
    wrong = 0
    for tokens in pool:
        result = service.router.route(prompt_from(pb.Prompt(token_bytes=tokens_to_bytes(
            tokens)), config), Scope())
        session = service.fleet.get(result.worker_id)
        depth = service.index.match(service.hasher.page_keys(tokens, ns)).get(result.worker_id, 0)
        ready = session is not None and session.status(now) is WorkerStatus.READY
        wrong += not ready or result.matched_pages != depth
    return wrong
