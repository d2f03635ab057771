"""The policy version and worker incarnations never go back, not even when the store forgets
them: a redis-server without persistence killed and restarted under a live fleet, and a
coordinator on the embedded store restarted with its workers reconnecting (issue 14, part 4).

The coordinator keeps a high-water mark (what it read from the store, what workers report at
Register and in heartbeats); a store behind it is restored, counted, and BeginPolicyUpdate is
refused for one lease after the restore."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import urllib.request
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import grpc
import pytest
from structlog.testing import capture_logs

from bench.scripted_worker import ScriptedWorker
from coordinator.client import AsyncCoordinatorClient, KvcoordError
from coordinator.config import CoordinatorConfig
from coordinator.control.policy import HighWater
from coordinator.core.policy_state import PolicyPhase, PolicyRecord
from coordinator.server.main import RunningCoordinator, start_coordinator
from coordinator.store.protocol import MetadataStore
from coordinator.wire import Reason
from tests.coordinator_fixtures import DEV_HASH, FAST_KNOBS, eventually, running_coordinator, target
from tests.redis_server import RedisServer, redis_server_available
from worker.config import WorkerConfig
from worker.main import RunningWorker, start_worker

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
            assert coord.service.policy_view.restores == 1

            # Two weight sets must never carry one version: a trainer starting over from 0 is
            # refused, and so is everyone until every live worker has reported (one lease).
            with pytest.raises(KvcoordError) as err:
                await client.begin_policy_update(0)
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert err.value.reason is Reason.POLICY_RESTORED
            assert err.value.retry_after_ms is not None
            assert 0 < err.value.retry_after_ms <= LEASE_MS
            assert "restored" in str(err.value)
            with pytest.raises(KvcoordError) as err:
                await client.begin_policy_update(2)
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
            # So does every replica, even one that never saw version 2 itself.
            async with running_coordinator(redis=server.url, page_size=PAGE, lease_ms=LEASE_MS,
                                           heartbeat_ms=150, replica_id="late") as late, \
                    AsyncCoordinatorClient(target(late)) as late_client:
                assert (await late_client.policy()).version == 2
                with pytest.raises(KvcoordError) as err:
                    await late_client.begin_policy_update(2)
                assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
                assert late.service.policy_view.restores == 0

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

    with capture_logs() as logs:
        async with coordinator_at(port) as second, \
                AsyncCoordinatorClient(target(second)) as client:
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
            with pytest.raises(KvcoordError) as refused:
                await client.begin_policy_update(0)
            assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
            route = await client.route(list(range(32)))
            assert route.policy_version == 3
            assert second.service.policy_view.restores == 1
        for w in workers:
            await w.close()
    # Said at start: the embedded store keeps no rollout records across restarts.
    [starting] = [e for e in logs if e["event"] == "coordinator.embedded_store_restarts"]
    assert "rollout records" in starting["detail"]
    [alarm] = [e for e in logs if e["event"] == "policy.version_restored"]
    assert (alarm["log_level"], alarm["stored_version"], alarm["restored_version"]) == (
        "error", 0, 3)


# ---------------------------------------------------------------------- the pure core

def test_high_water_takes_a_store_that_went_back_as_behind_and_restores_what_it_held() -> None:
    high = HighWater()
    held = PolicyRecord(version=4, phase=PolicyPhase.DRAINING, target_version=5, epoch=9,
                        weights_uri="s3://w/4", target_weights_uri="s3://w/5")
    high.saw(held)
    assert not high.behind(held)
    empty = PolicyRecord()  # Redis restarted without persistence
    assert high.behind(empty)
    # Same version, older epoch: an update in progress was lost with the data.
    assert high.behind(PolicyRecord(version=4, epoch=3))
    restored = high.restoration(empty, held, now_ms=123)
    assert restored == dataclasses.replace(held, epoch=10, restored_at_ms=123)


def test_a_worker_version_above_everything_seen_raises_the_floor_but_an_aborted_target_not() -> (
        None):
    high = HighWater()
    high.saw(PolicyRecord(version=2, epoch=3))
    high.saw(PolicyRecord(version=2, target_version=3, epoch=4))  # begun, then aborted
    aborted = PolicyRecord(version=2, epoch=5)
    high.saw(aborted)
    assert high.report(3) is False  # a worker still on the aborted target: never served
    assert not high.behind(aborted)
    assert high.report(7) is True  # a version this process never saw: the store forgot it
    assert high.behind(aborted)
    assert high.restoration(aborted, aborted, now_ms=5) == PolicyRecord(
        version=7, epoch=6, restored_at_ms=5)
    # An update to the reported version in progress explains it: not behind.
    assert not high.behind(PolicyRecord(version=6, target_version=7, epoch=6))


def test_incarnations_seen_are_kept_bounded_and_only_rise() -> None:
    high = HighWater(max_workers=2)
    high.saw_incarnation("a", 5)
    high.saw_incarnation("a", 3)
    high.saw_incarnation("b", 1)
    high.saw_incarnation("x", 2**60)  # no store hands that out: ignored
    assert (high.incarnation("a"), high.incarnation("b"), high.incarnation("x")) == (5, 1, 0)
    high.saw_incarnation("c", 1)
    assert (high.incarnation("a"), high.incarnation("c")) == (0, 1)  # oldest news dropped


# ---------------------------------------------------------------------- the store contract

async def test_register_takes_the_callers_incarnation_floor_and_keeps_counting_from_it(
    store: MetadataStore,
) -> None:
    first = await store.register_worker("w", address="h:1", policy_version=0, lease_ms=5_000)
    assert first.incarnation == 1
    floored = await store.register_worker("w", address="h:1", policy_version=0, lease_ms=5_000,
                                          min_incarnation=8)
    assert floored.incarnation == 8
    assert await store.current_incarnation("w") == 8
    after = await store.register_worker("w", address="h:1", policy_version=0, lease_ms=5_000,
                                        min_incarnation=2)
    assert after.incarnation == 9
    with pytest.raises(ValueError, match="min_incarnation"):
        await store.register_worker("w", address="h:1", policy_version=0, lease_ms=5_000,
                                    min_incarnation=0)


async def test_restore_policy_writes_the_record_exactly_when_the_store_holds_the_expected(
    store: MetadataStore,
) -> None:
    restored = PolicyRecord(version=5, epoch=12, weights_uri="s3://w/5")
    assert await store.restore_policy(PolicyRecord(version=1), restored) is False
    assert await store.restore_policy(PolicyRecord(), restored) is True
    assert await store.get_policy() == restored
    with pytest.raises(ValueError, match="higher epoch"):
        await store.restore_policy(restored, dataclasses.replace(restored, version=6))
    with pytest.raises(ValueError, match="never decreases"):
        await store.restore_policy(restored, PolicyRecord(version=4, epoch=13))


@pytest.mark.redis
async def test_a_worker_on_an_aborted_target_is_no_evidence_of_a_lost_version(
    redis_url: str,
) -> None:
    async with running_coordinator(redis=redis_url, replication=False) as first, \
            AsyncCoordinatorClient(target(first)) as client:
        member = ScriptedWorker(target(first), "m", hash_config=DEV_HASH)
        await member.start()
        await member.heartbeat()
        await client.begin_policy_update(0)  # m is a member: its ack is in the store
        await client.abort_policy_update(1)
        await member.close()
    # A coordinator that never saw that update meets a worker still holding version 1.
    async with running_coordinator(redis=redis_url, replication=False) as second, \
            AsyncCoordinatorClient(target(second)) as client:
        late = ScriptedWorker(target(second), "late", hash_config=DEV_HASH, policy_version=1)
        answer = await late.register()
        assert answer.policy_version == 0
        assert (await client.policy()).version == 0
        assert second.service.policy_view.restores == 0
        await late.close()
