"""Route ids and ``EndRoutes``: a route asked with ``report_end`` to an external worker (an
engine behind a bridge) is that worker's load until its caller ends it by id, or until
``route_end_ttl_ms``; the bridge's settle-everything heartbeats do not settle it; a reference
worker's routes are settled by its own heartbeats only; ending is idempotent. Real coordinator,
scripted workers on real Sync streams, the SDK."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from bench.scripted_worker import ScriptedWorker
from coordinator.client import AsyncCoordinatorClient, KvcoordError
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from tests.coordinator_fixtures import DEV_HASH, eventually, running_coordinator, target

PROMPT = list(range(64))
SETTLE_ALL = 1 << 30  # what a bridge's heartbeat reports (worker/bridge/bridge.py)


async def _inflight(client: AsyncCoordinatorClient, worker_id: str) -> int:
    (info,) = [w for w in await client.workers() if w.worker_id == worker_id]
    return info.inflight_routes


async def _worker(running: object, worker_id: str, *, external: bool) -> ScriptedWorker:
    worker = ScriptedWorker(target(running), worker_id, hash_config=DEV_HASH,  # type: ignore[arg-type]
                            external=external)
    await worker.start()
    await worker.heartbeat()
    return worker


async def test_an_external_workers_route_is_load_until_its_caller_ends_it_once() -> None:
    async with running_coordinator() as running, \
            AsyncCoordinatorClient(target(running)) as client:
        engine = await _worker(running, "engine", external=True)
        try:
            await eventually(lambda: _ready(client, "engine"), what="the engine routable")
            awaited = await client.route(PROMPT, report_end=True)
            plain = await client.route(PROMPT)
            assert awaited.worker_id == plain.worker_id == "engine"
            assert awaited.end_awaited and not plain.end_awaited
            assert awaited.route_id and plain.route_id and awaited.route_id != plain.route_id
            assert await _inflight(client, "engine") == 2
            # The bridge's heartbeat settles what it can: the plain route, not the awaited one.
            await engine.heartbeat(completed_routes=SETTLE_ALL)
            await eventually(lambda: _is(client, "engine", 1), what="the plain route settled")
            await asyncio.sleep(0.3)  # more heartbeats' worth: still held
            await engine.heartbeat(completed_routes=SETTLE_ALL)
            await asyncio.sleep(0.1)
            assert await _inflight(client, "engine") == 1
            ended = await client.end_routes([awaited.route_id])
            assert (ended.ended, ended.unknown) == (1, 0)
            assert await _inflight(client, "engine") == 0
            # Idempotent: the same id again, and ids this coordinator never awaited.
            again = await client.end_routes([awaited.route_id, plain.route_id, "made-up"])
            assert (again.ended, again.unknown) == (0, 3)
            assert await _inflight(client, "engine") == 0
        finally:
            await engine.close()


async def test_a_reference_workers_routes_are_settled_by_its_heartbeats_only() -> None:
    async with running_coordinator() as running, \
            AsyncCoordinatorClient(target(running)) as client:
        worker = await _worker(running, "w1", external=False)
        try:
            await eventually(lambda: _ready(client, "w1"), what="w1 routable")
            first = await client.route(PROMPT, report_end=True)
            await client.route(PROMPT, report_end=True)
            assert not first.end_awaited and first.route_id
            # Ending a route the worker reports itself changes nothing: no route settles twice.
            ended = await client.end_routes([first.route_id])
            assert (ended.ended, ended.unknown) == (0, 1)
            assert await _inflight(client, "w1") == 2
            await worker.heartbeat(completed_routes=1)
            await eventually(lambda: _is(client, "w1", 1), what="one route settled")
        finally:
            await worker.close()


async def test_an_awaited_route_never_ended_stops_counting_after_the_ttl() -> None:
    async with running_coordinator(route_end_ttl_ms=300) as running, \
            AsyncCoordinatorClient(target(running)) as client:
        engine = await _worker(running, "engine", external=True)
        try:
            await eventually(lambda: _ready(client, "engine"), what="the engine routable")
            route = await client.route(PROMPT, report_end=True)
            assert await _inflight(client, "engine") == 1
            await eventually(lambda: _is(client, "engine", 0), timeout=3.0,
                             what="the reaper releasing the expired route")
            ended = await client.end_routes([route.route_id])
            assert (ended.ended, ended.unknown) == (0, 1)  # expired: the late end is a no-op
        finally:
            await engine.close()


async def test_siblings_routed_as_one_group_share_one_id_and_end_together() -> None:
    async with running_coordinator() as running, \
            AsyncCoordinatorClient(target(running)) as client:
        engine = await _worker(running, "engine", external=True)
        try:
            await eventually(lambda: _ready(client, "engine"), what="the engine routable")
            batch = await client.route_batch([PROMPT] * 4 + [list(range(100, 140))],
                                             report_end=True)
            ids = {r.route_id for r in batch.routes}
            assert len(ids) == 2 and all(r.end_awaited for r in batch.routes)
            assert await _inflight(client, "engine") == 5
            ended = await client.end_routes(sorted(ids))
            assert (ended.ended, ended.unknown) == (2, 0)
            assert await _inflight(client, "engine") == 0
        finally:
            await engine.close()


@pytest.mark.parametrize("route_ids", [[], ["x"] * 1025, ["x" * 65], [""]])
async def test_end_routes_refuses_malformed_requests(route_ids: list[str]) -> None:
    async with running_coordinator() as running, \
            grpc.aio.insecure_channel(target(running)) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.EndRoutes(pb.EndRoutesRequest(route_ids=route_ids))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    async with running_coordinator() as running, \
            AsyncCoordinatorClient(target(running)) as client:
        with pytest.raises(KvcoordError):
            await client.end_routes(route_ids or [""])


async def _ready(client: AsyncCoordinatorClient, worker_id: str) -> bool:
    return any(w.worker_id == worker_id and w.state == "ready" for w in await client.workers())


async def _is(client: AsyncCoordinatorClient, worker_id: str, count: int) -> bool:
    return await _inflight(client, worker_id) == count


@pytest.mark.parametrize("ttl_ms", [0, -1])
def test_a_route_end_ttl_that_is_not_positive_is_refused(ttl_ms: int) -> None:
    from coordinator.config import ConfigError, CoordinatorConfig

    with pytest.raises(ConfigError, match="route_end_ttl_ms must be > 0"):
        CoordinatorConfig(route_end_ttl_ms=ttl_ms)
