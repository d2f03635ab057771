"""Shared routes on replicas that hear of them late (issue 29): an ``EndRoutes`` that reaches a
replica before the route's ``Routed`` event settles the route there at once, and a replica that
joins after routes were made counts them as the replica that made them does, until an
``EndRoutes`` through any replica settles them on all. Real replicas on a real redis-server,
scripted workers; the late ``Routed`` is written to the events stream through the store's own
API, after the end."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager

import pytest

from bench.scripted_worker import ScriptedWorker
from coordinator.client import AsyncCoordinatorClient, Route
from coordinator.core.routing import RouteReservation
from coordinator.replication.events import Routed, encode
from coordinator.replication.replicator import STREAM
from coordinator.server.main import RunningCoordinator
from coordinator.store import open_store
from tests.coordinator_fixtures import DEV_HASH, eventually, running_coordinator, target

pytestmark = pytest.mark.redis

TTL_MS = 60_000  # far past every wait here: a route counted 0 was ended, not expired


def replica(url: str, name: str) -> AbstractAsyncContextManager[RunningCoordinator]:
    return running_coordinator(redis=url, replica_id=name, bootstrap_timeout_ms=2_000,
                               route_end_ttl_ms=TTL_MS)


async def heartbeats(workers: list[ScriptedWorker]) -> None:
    """Keep the workers' leases; they report no finished route, so nothing settles by itself."""
    while True:
        for worker in workers:
            if worker.streaming:
                await worker.heartbeat()
        await asyncio.sleep(0.2)


@asynccontextmanager
async def streaming(stack: AsyncExitStack, placement: dict[str, RunningCoordinator],
                    external: set[str]) -> AsyncIterator[list[ScriptedWorker]]:
    """Workers named in ``placement``, each streaming to its replica, heartbeating."""
    workers = [ScriptedWorker(target(r), name, hash_config=DEV_HASH, external=name in external)
               for name, r in placement.items()]
    for worker in workers:
        await worker.start()
        stack.push_async_callback(worker.close)
    beating = asyncio.create_task(heartbeats(workers))
    try:
        yield workers
    finally:
        beating.cancel()


async def inflight(client: AsyncCoordinatorClient) -> dict[str, int]:
    return {w.worker_id: w.inflight_routes for w in await client.workers()}


async def know_all(client: AsyncCoordinatorClient, names: set[str]) -> None:
    async def ready() -> bool:
        return {w.worker_id for w in await client.workers() if w.state == "ready"} == names
    await eventually(ready, timeout=5.0, what=f"the replica to know {sorted(names)}")


async def test_a_route_whose_end_arrives_first_is_settled_at_once_on_a_third_replica(
        redis_url: str) -> None:
    async with AsyncExitStack() as stack:
        a, b, c = [await stack.enter_async_context(replica(redis_url, n)) for n in "ABC"]
        async with streaming(stack, {"ext": a}, {"ext"}) as (ext,), \
                AsyncCoordinatorClient(target(b)) as cb, \
                AsyncCoordinatorClient(target(c)) as cc:
            for client in (cb, cc):
                await know_all(client, {"ext"})
            # A caller ends through B a route A chose, before A's Routed reached anyone: B does
            # not know the id yet (and says so), and publishes the end.
            ended = await cb.end_routes(["A-late"])
            assert (ended.ended, ended.unknown) == (0, 1)
            assert b.service.replicator is not None
            await b.service.replicator.flush()
            # Then A's Routed for it lands in the stream, and one more route after it.
            store = await open_store(redis_url, namespace="default")
            try:
                now_ms = int(time.time() * 1000)
                await store.append_many(STREAM, [
                    encode("A", now_ms, Routed(RouteReservation(
                        "ext", ext.incarnation, "A-late", (), 64, 2, True, 0, 64))),
                    encode("A", now_ms, Routed(RouteReservation(
                        "ext", ext.incarnation, "A-next", (), 64, 1, True, 0, 64))),
                ], maxlen=10_000)
            finally:
                await store.close()

            async def counted_the_next(client: AsyncCoordinatorClient) -> bool:
                return (await inflight(client))["ext"] > 0
            for client in (cb, cc):
                # "A-next" is counted, so "A-late", before it in the stream, was applied.
                await eventually(lambda client=client: counted_the_next(client), timeout=2.0,
                                 what="the routes to arrive")
                assert (await inflight(client))["ext"] == 1  # "A-late" ended at once
            ended = await cc.end_routes(["A-next"])
            assert (ended.ended, ended.unknown, (await inflight(cc))["ext"]) == (1, 0, 0)


async def routes_made(a: RunningCoordinator, b: RunningCoordinator) -> list[tuple[Route, int]]:
    """Routes with ``report_end`` through A and B in turn, round robin over the workers, and a
    group of three siblings through A; each with its number of copies."""
    made: list[tuple[Route, int]] = []
    async with AsyncCoordinatorClient(target(a)) as ca, AsyncCoordinatorClient(target(b)) as cb:
        for i in range(6):
            client = (ca, cb)[i % 2]
            tokens = [i * 1000 + t for t in range(64)]
            made.append((await client.route(tokens, routing_policy="round_robin",
                                            report_end=True), 1))
        batch = await ca.route_batch([list(range(7000, 7064))] * 3,
                                     routing_policy="round_robin", report_end=True)
        made.append((batch.routes[0], 3))
    return made


async def test_a_replica_that_joins_later_counts_the_routes_in_flight_as_the_others_do(
        redis_url: str) -> None:
    async with AsyncExitStack() as stack:
        a, b = [await stack.enter_async_context(replica(redis_url, n)) for n in "AB"]
        placement = {"w0": a, "e0": a, "e1": b}
        async with streaming(stack, placement, {"e0", "e1"}), \
                AsyncCoordinatorClient(target(a)) as ca, \
                AsyncCoordinatorClient(target(b)) as cb:
            for client in (ca, cb):
                await know_all(client, set(placement))
            made = await routes_made(a, b)
            expected: Counter[str] = Counter()
            for route, copies in made:
                expected[route.worker_id] += copies
            assert set(expected) == set(placement)  # both kinds: heartbeats settle w0's
            assert {r.end_awaited for r, _ in made if r.worker_id == "w0"} == {False}
            awaited = sorted({r.route_id for r, _ in made if r.end_awaited})
            assert len(awaited) == sum(1 for r, _ in made if r.worker_id != "w0")

            async def a_and_b_agree() -> bool:
                return await inflight(ca) == await inflight(cb) == dict(expected)
            await eventually(a_and_b_agree, timeout=2.0, what="A and B to count every route")

            # C starts now: its bootstrap (done when it serves) carries the routes in flight.
            c = await stack.enter_async_context(replica(redis_url, "C"))
            async with AsyncCoordinatorClient(target(c)) as cc:
                assert await inflight(cc) == await inflight(ca) == dict(expected)
                # Awaited routes end through any replica: half through C, half through B.
                half = len(awaited) // 2
                assert (await cc.end_routes(awaited[:half])).ended == half
                assert (await cb.end_routes(awaited[half:])).ended == len(awaited) - half
                settled = {"w0": expected["w0"], "e0": 0, "e1": 0}

                async def all_settled() -> bool:
                    return all([await inflight(x) == settled for x in (ca, cb, cc)])
                await eventually(all_settled, timeout=2.0, what="every replica to settle them")
