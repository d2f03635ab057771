"""Replicas route as one (issue 17 §4): each routing decision's reservation (pending entries,
in-flight load) and each EndRoutes reach the other replicas through the events stream, so the
siblings of a GRPO group sent alternately to two replicas land as one replica would place them,
and a route ends through any replica. Real replicas on a real redis-server, scripted workers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import pytest

from bench.fleet_shared_routes import placement_ranks
from bench.scripted_worker import ScriptedWorker
from coordinator.client import AsyncCoordinatorClient
from coordinator.server.main import RunningCoordinator
from tests.coordinator_fixtures import DEV_HASH, eventually, running_coordinator, target

pytestmark = pytest.mark.redis

WORKERS = 8
SIBLINGS = 16
GROUPS = 5
GAP_S = 0.020  # between siblings: longer than the replication lag (a few ms)
PROMPT_TOKENS = 1024


@asynccontextmanager
async def fleet(url: str, share_routes: bool) -> AsyncIterator[
        tuple[RunningCoordinator, RunningCoordinator, list[ScriptedWorker]]]:
    """Replicas A and B; workers stream to A (B knows them only through A's events)."""
    async with AsyncExitStack() as stack:
        a, b = [await stack.enter_async_context(running_coordinator(
            redis=url, replica_id=name, bootstrap_timeout_ms=2_000, share_routes=share_routes))
            for name in ("A", "B")]
        workers = [ScriptedWorker(target(a), f"w{i}", hash_config=DEV_HASH)
                   for i in range(WORKERS)]
        for worker in workers:
            await worker.start()
            stack.push_async_callback(worker.close)
        beating = asyncio.create_task(heartbeats(workers))
        stack.callback(beating.cancel)
        async with AsyncCoordinatorClient(target(b)) as client:
            async def all_known() -> bool:
                return sum(w.state == "ready" for w in await client.workers()) == WORKERS
            await eventually(all_known, timeout=5.0, what="B to know every worker")
        yield a, b, workers


async def heartbeats(workers: list[ScriptedWorker]) -> None:
    """Keep the workers' leases (they finish nothing: in-flight routes stay counted)."""
    while True:
        for worker in workers:
            if worker.streaming:
                await worker.heartbeat()
        await asyncio.sleep(0.2)


def prompt(group: int, salt: int) -> list[int]:
    return [group * 100_000 + salt * 10_000 + i for i in range(PROMPT_TOKENS)]


async def place_siblings(targets: list[str], tokens: list[int]) -> list[str]:
    """Route one group's siblings one at a time, GAP_S apart, through ``targets`` in turn."""
    clients = [AsyncCoordinatorClient(t) for t in targets]
    try:
        chosen = []
        for i in range(SIBLINGS):
            chosen.append((await clients[i % len(clients)].route(tokens)).worker_id)
            await asyncio.sleep(GAP_S)
        return chosen
    finally:
        for client in clients:
            await client.close()


@pytest.mark.parametrize("share_routes", [True, False], ids=["shared", "not_shared"])
async def test_siblings_sent_alternately_to_two_replicas_land_as_one_replica_places_them(
        redis_url: str, share_routes: bool) -> None:
    async with fleet(redis_url, share_routes) as (a, b, _):
        one = [placement_ranks(await place_siblings([target(a)], prompt(g, 0)))
               for g in range(GROUPS)]
        two = [placement_ranks(await place_siblings([target(a), target(b)], prompt(g, 1)))
               for g in range(GROUPS)]
    # One replica keeps a group together: the first sibling's pages are pending on its worker,
    # so each later sibling costs there only its wait (1,024 tokens at most, drained at 15,000
    # tokens/s) and 8 per route in flight, against 1,024 to compute plus 1,024 copied anywhere
    # else.
    assert one == [list(range(SIBLINGS))] * GROUPS
    if share_routes:
        assert two == one
    else:
        # Without shared reservations B cannot see A's siblings: its first sibling goes to a
        # worker it thinks idle, which is A's by chance 1 in 8 per group (1 in 8**5 for all).
        assert two != one, "replicas that share nothing still placed like one replica"


async def test_a_route_held_for_its_end_ends_through_the_other_replica(redis_url: str) -> None:
    async with fleet(redis_url, share_routes=True) as (a, b, workers):
        external = ScriptedWorker(target(a), "ext", hash_config=DEV_HASH, external=True)
        await external.start()
        try:
            async with AsyncCoordinatorClient(target(a)) as ca, \
                    AsyncCoordinatorClient(target(b)) as cb:
                async def ready() -> bool:
                    return any(w.worker_id == "ext" and w.state == "ready"
                               for w in await cb.workers())
                await eventually(ready, timeout=5.0, what="B to know the external worker")
                for worker in workers:
                    await worker.close()  # only the external worker is left to route to

                async def only_external() -> bool:
                    return {w.worker_id for w in await cb.workers() if w.state == "ready"} == {
                        "ext"}
                await eventually(only_external, timeout=10.0, what="the others to leave")
                route = await ca.route(prompt(9, 0), report_end=True)
                assert (route.worker_id, route.end_awaited) == ("ext", True)

                async def inflight(client: AsyncCoordinatorClient) -> int:
                    info = {w.worker_id: w for w in await client.workers()}
                    return info["ext"].inflight_routes

                async def held_on_b() -> bool:
                    return await inflight(cb) == 1
                await eventually(held_on_b, timeout=2.0, what="B to count A's route")
                ended = await cb.end_routes([route.route_id])  # ended through B
                assert ended.ended == 1

                async def released_on_a() -> bool:
                    return await inflight(ca) == 0
                await eventually(released_on_a, timeout=2.0, what="A to release the route")
        finally:
            await external.close()
