"""The policy version and worker incarnations never go back, not even when the store forgets
them: a redis-server without persistence killed and restarted under a live fleet, and a
coordinator on the embedded store restarted with its workers reconnecting (issue 14, part 4).

The coordinator keeps a high-water mark (what it read from the store, what workers report at
Register and in heartbeats); a store behind it is restored, counted, and BeginPolicyUpdate is
refused for one lease after the restore."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import grpc
import pytest

from coordinator.client import AsyncCoordinatorClient, KvcoordError
from coordinator.config import CoordinatorConfig
from coordinator.server import RunningCoordinator, start_coordinator
from kvcoord.scripted_worker import ScriptedWorker
from tests.coordinator_fixtures import DEV_HASH, FAST_KNOBS, eventually, running_coordinator, target
from tests.redis_server import RedisServer, redis_server_available
from worker.config import WorkerConfig
from worker.server import RunningWorker, start_worker

PAGE = 4
LEASE_MS = 1_500


@asynccontextmanager
async def real_workers(coordinator: str, n: int) -> AsyncIterator[list[RunningWorker]]:
    async with AsyncExitStack() as stack:
        started = []
        for i in range(n):
            running = await start_worker(WorkerConfig(
                coordinator=coordinator, listen="127.0.0.1:0", pages=64, page_size=PAGE,
                device="cpu", worker_id=f"w{i}", max_new_tokens=4, backoff_max_ms=200,
            ))
            stack.push_async_callback(running.stop, 0.5)
            started.append(running)
        for running in started:
            await asyncio.wait_for(running.agent.synced.wait(), 10)
        yield started


@pytest.mark.redis
@pytest.mark.skipif(not redis_server_available(), reason="redis-server not installed")
async def test_redis_losing_its_data_under_a_live_fleet_never_takes_versions_back() -> None:
    with RedisServer(appendonly=False) as server:
        async with running_coordinator(redis=server.url, page_size=PAGE, lease_ms=LEASE_MS,
                                       heartbeat_ms=150, barrier_timeout_ms=5_000,
                                       metrics_port=0) as coord, \
                real_workers(target(coord), 2) as workers, \
                AsyncCoordinatorClient(target(coord)) as client:
            for expected in (0, 1):
                async with client.policy_update(expected):
                    pass
            assert (await client.policy()).version == 2
            await eventually(lambda: _all_at(client, 2), what="workers at version 2")
            before = {w.worker_id: w.incarnation for w in await client.workers()}
            assert before == {"w0": 1, "w1": 1}

            server.restart(hard=True)  # no AOF, no RDB: Redis comes back empty
            # The first answer after the loss is already the version served before it.
            state = await client.policy()
            assert (state.version, state.phase) == (2, "serving")
            assert coord.service.updates.restores == 1

            # Two weight sets must never carry one version: a trainer starting over from 0 is
            # refused, and so is everyone until every live worker has reported (one lease).
            with pytest.raises(KvcoordError) as err:
                await client.begin_policy_update(0)
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "restored" in str(err.value)
            with pytest.raises(KvcoordError) as err:
                await client.begin_policy_update(2)
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION

            # The workers' leases went with the data: they register again, under
            # incarnations above every one handed out before.
            async def re_registered() -> bool:
                infos = await client.workers()
                return len(infos) == 2 and all(
                    w.incarnation != before[w.worker_id] and w.state == "ready" for w in infos)

            await eventually(re_registered, timeout=10, what="workers to re-register")
            for info in await client.workers():
                assert info.incarnation > before[info.worker_id]
                assert info.policy_version == 2
            assert [w.runtime.policy_version for w in workers] == [2, 2]

            # One lease after the restore, updates go on from the restored version.
            restored_at = time.monotonic()

            async def begin_allowed() -> bool:
                try:
                    await client.begin_policy_update(2)
                except KvcoordError as exc:
                    assert exc.code == grpc.StatusCode.FAILED_PRECONDITION, exc
                    return False
                return True

            await eventually(begin_allowed, timeout=LEASE_MS / 1000 + 5,
                             what="BeginPolicyUpdate allowed again")
            assert time.monotonic() - restored_at < LEASE_MS / 1000 + 5
            done = await client.commit_policy_update(3, timeout=5)
            assert (done.version, sorted(done.acked_workers)) == (3, ["w0", "w1"])
            assert coord.metrics_port is not None
            metrics = await asyncio.to_thread(_scrape, coord.metrics_port)
            assert "kvcoord_policy_version_restored_total 1.0" in metrics.splitlines()


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


async def _all_at(client: AsyncCoordinatorClient, version: int) -> bool:
    infos = await client.workers()
    return bool(infos) and all(w.policy_version == version and w.state == "ready"
                               for w in infos)


@asynccontextmanager
async def coordinator_at(port: int) -> AsyncIterator[RunningCoordinator]:
    """A coordinator on the embedded store, on a fixed port (so it can be restarted there)."""
    running = await start_coordinator(CoordinatorConfig(
        listen=f"127.0.0.1:{port}", **{**FAST_KNOBS, "lease_ms": LEASE_MS}))
    try:
        yield running
    finally:
        await running.stop(grace=0.2)


async def test_an_embedded_store_coordinator_restarted_keeps_version_and_incarnations() -> None:
    async with coordinator_at(0) as first:
        port = first.port
        addr = target(first)
        async with AsyncCoordinatorClient(addr) as client:
            for expected in (0, 1, 2):  # no workers yet: each update commits at once
                async with client.policy_update(expected):
                    pass
            assert (await client.policy()).version == 3
        workers = [ScriptedWorker(addr, f"s{i}", hash_config=DEV_HASH) for i in range(2)]
        for w in workers:
            answer = await w.register()
            assert answer.policy_version == 3
            w.policy_version = 3
            await w.connect()
            await w.heartbeat()
        for w in workers:  # a second incarnation each, so the numbers to keep are 2
            await w.disconnect()
            await w.register()
            await w.connect()
            await w.heartbeat()
        old = {w.worker_id: w.incarnation for w in workers}
        assert old == {"s0": 2, "s1": 2}
        for w in workers:
            await w.disconnect()

    async with coordinator_at(port) as second:
        async with AsyncCoordinatorClient(target(second)) as client:
            for w in workers:
                # The stream comes back to a coordinator that forgot the worker: it says which
                # incarnation it had, and must register again.
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await w.connect()
                assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                answer = await w.register()
                assert answer.incarnation > old[w.worker_id]
                assert answer.policy_version >= 3
                await w.connect()
                await w.heartbeat()
            state = await client.policy()
            assert state.version >= 3
            with pytest.raises(KvcoordError) as err:
                await client.begin_policy_update(0)
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
            route = await client.route(list(range(32)))
            assert route.policy_version == 3
        for w in workers:
            await w.close()
