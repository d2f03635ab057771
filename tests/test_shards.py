"""Shards: replica sets of one namespace on one Redis, each ingesting only its own workers.

In one process, against a real redis-server: shard ``a`` (replicas A1, A2) and shard ``b``
(replica B1). A worker's pages reach its own shard's replicas through ``events:<shard>`` and
never the other shard's; each shard lists only its own replicas.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import redis

from bench.scripted_worker import ScriptedWorker
from coordinator.client import AsyncCoordinatorClient
from coordinator.server.main import RunningCoordinator
from tests.coordinator_fixtures import DEV_HASH, eventually, running_coordinator, target

pytestmark = pytest.mark.redis

LAG_BOUND_S = 2.0
PROMPT = list(range(64))


@asynccontextmanager
async def sharded(url: str, **shards: tuple[str, ...]) -> AsyncIterator[
        dict[str, RunningCoordinator]]:
    """Replicas by id, ``shards`` naming each shard's replica ids (started in that order)."""
    async with AsyncExitStack() as stack:
        started = {}
        for shard, names in shards.items():
            for name in names:
                started[name] = await stack.enter_async_context(running_coordinator(
                    redis=url, replica_id=name, shard=shard, bootstrap_timeout_ms=2_000))
        yield started


async def matches(coordinator: RunningCoordinator) -> dict[str, int]:
    async with AsyncCoordinatorClient(target(coordinator)) as client:
        return (await client.lookup(PROMPT)).matches


async def test_pages_reach_their_own_shards_replicas_only(redis_url: str) -> None:
    async with sharded(redis_url, a=("A1", "A2"), b=("B1",)) as replicas:
        worker = ScriptedWorker(target(replicas["A1"]), "wa", hash_config=DEV_HASH)
        await worker.start()
        await worker.store(worker.keys(PROMPT))

        async def a2_has_them() -> bool:
            return await matches(replicas["A2"]) == {"wa": 64}

        await eventually(a2_has_them, timeout=LAG_BOUND_S, what="A2 to list wa's pages")
        assert await matches(replicas["A1"]) == {"wa": 64}
        assert await matches(replicas["B1"]) == {}
        async with AsyncCoordinatorClient(target(replicas["B1"])) as client:
            assert [w.worker_id for w in await client.workers()] == []
            stats = await client.stats()
            assert (stats.replica_id, stats.replicas) == ("B1", ("B1",))
        async with AsyncCoordinatorClient(target(replicas["A2"])) as client:
            assert (await client.stats()).replicas == ("A1", "A2")
        with redis.Redis.from_url(redis_url) as store:
            streams = sorted(k.decode() for k in store.keys("kvcoord:{default}:events*"))
        assert streams == ["kvcoord:{default}:events:a", "kvcoord:{default}:events:b"]
        await worker.close()
