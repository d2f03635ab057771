"""Coordinator replicas on one real redis-server, in one process: worker events reach every
replica through the events stream, a new replica bootstraps before SERVING, a worker moves
between replicas without a resync, gaps and a lost stream are repaired by snapshots, a Redis
crash is reconciled, and policy updates reach workers attached to any replica."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.scripted_worker import ScriptedWorker
from coordinator.client import AsyncCoordinatorClient, CoordinatorClient
from coordinator.client.outcomes import outcome_of
from coordinator.core.index import PagesRemoved
from coordinator.core.rollout_records import Rollout
from coordinator.replication.events import Pages, encode
from coordinator.server.main import RunningCoordinator
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.wire import Reason
from tests.coordinator_fixtures import DEV_HASH, eventually, running_coordinator, target
from tests.redis_server import RedisServer, free_port
from worker.client import AsyncWorkerClient
from worker.config import WorkerConfig
from worker.main import RunningWorker, start_worker

pytestmark = pytest.mark.redis

LAG_BOUND_S = 2.0  # replicas must agree within this (the measured p99 is a few ms)
PROMPTS = [list(range(64)), list(range(100, 148)), [5] * 32]


@asynccontextmanager
async def replicas(url: str, *names: str, **knobs: object) -> AsyncIterator[
        list[RunningCoordinator]]:
    async with AsyncExitStack() as stack:
        started = []
        for name in names:
            started.append(await stack.enter_async_context(running_coordinator(
                redis=url, replica_id=name, bootstrap_timeout_ms=2_000, **knobs)))
        yield started


async def lookups(coordinator: RunningCoordinator) -> list[dict[str, int]]:
    async with AsyncCoordinatorClient(target(coordinator)) as client:
        return [(await client.lookup(prompt)).matches for prompt in PROMPTS]


async def agree(*coordinators: RunningCoordinator, expect: Callable[[list[dict[str, int]]],
                                                                      bool] = bool) -> None:
    """Wait (within the lag bound) until every replica gives the same lookups, and they pass
    ``expect``; fail showing each replica's answers."""
    answers: list[list[dict[str, int]]] = []

    async def same() -> bool:
        answers[:] = [await lookups(c) for c in coordinators]
        return all(a == answers[0] for a in answers) and expect(answers[0])

    try:
        await eventually(same, timeout=LAG_BOUND_S, what="replicas to agree")
    except AssertionError:
        raise AssertionError(f"replicas disagree: {answers}") from None


async def scripted(coordinator: RunningCoordinator, worker_id: str = "w1") -> ScriptedWorker:
    worker = ScriptedWorker(target(coordinator), worker_id, hash_config=DEV_HASH)
    await worker.start()
    return worker


async def test_page_events_at_one_replica_reach_the_others(redis_url: str) -> None:
    async with replicas(redis_url, "A", "B") as (a, b):
        worker = await scripted(a)
        first, second = (worker.keys(p) for p in PROMPTS[:2])
        await worker.store(first)
        await worker.store(second)
        await worker.remove(second[1:])
        await agree(a, b, expect=lambda got: got == [{"w1": 64}, {"w1": 16}, {}])
        async with AsyncCoordinatorClient(target(b)) as client:
            info = {w.worker_id: w for w in await client.workers()}
            assert (info["w1"].owner_replica, info["w1"].state) == ("A", "ready")
            assert (await client.route(PROMPTS[0])).worker_id == "w1"
            stats = await client.stats()
            assert (stats.replica_id, stats.replicas) == ("B", ("A", "B"))
            assert stats.replication_applied > 0
        await worker.send_events([pb.PageEvent(kind=pb.PageEvent.KIND_CLEARED)])
        await agree(a, b, expect=lambda got: got == [{}, {}, {}])
        await worker.close()


async def test_a_new_replica_holds_the_fleet_when_it_reports_serving(redis_url: str) -> None:
    async with replicas(redis_url, "A", "B") as (a, b):
        worker = await scripted(b, "w2")
        await worker.store(worker.keys(PROMPTS[0]))
        await agree(a, b, expect=lambda got: got[0] == {"w2": 64})
        async with running_coordinator(redis=redis_url, replica_id="C") as c:
            # No waiting: start_coordinator returned after the bootstrap, so C answers as the
            # others do on its very first lookup, and its health says SERVING.
            assert await lookups(c) == await lookups(a)
            async with grpc.aio.insecure_channel(target(c)) as channel:
                health = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""))
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            assert c.service.replicator is not None
            assert c.service.replicator.peers == ["A", "B"]
        await worker.close()


async def test_bootstrap_waits_for_a_silent_peer_at_most_the_timeout(redis_url: str) -> None:
    with redis.Redis.from_url(redis_url) as client:  # a replica that died a moment ago
        client.zadd("kvcoord:{default}:replicas", {"ghost": int(time.time() * 1000) + 60_000})
    started = time.monotonic()
    async with running_coordinator(redis=redis_url, replica_id="A",
                                   bootstrap_timeout_ms=700):
        waited = time.monotonic() - started
    assert 0.7 <= waited < 5.0


async def test_a_worker_moving_to_another_replica_resumes_from_its_acked_sequence(
    redis_url: str,
) -> None:
    async with replicas(redis_url, "A", "B") as (a, b):
        worker = await scripted(a)
        await worker.store(worker.keys(PROMPTS[0]))
        await worker.store(worker.keys(PROMPTS[1]))
        # A has published them (it does so within 5 ms of acking; batches acked and never
        # published are the resync case). No waiting for B to have applied them: at the
        # hello, B catches up with the stream first.
        assert a.service.replicator is not None
        await a.service.replicator.flush()
        await worker.move_to(target(b))
        welcome = await worker.connect()
        assert welcome.welcome.next_seq == 3
        await worker.store(worker.keys(PROMPTS[2]))  # acked by B: no resync was asked for
        assert b.service.worker_sync.counters.resyncs == 0
        await agree(a, b, expect=lambda got: got == [{"w1": 64}, {"w1": 48}, {"w1": 32}])
        async with AsyncCoordinatorClient(target(a)) as client:
            assert [w.owner_replica for w in await client.workers()] == ["B"]
        await worker.close()


async def test_a_stale_stream_ends_when_its_worker_attaches_to_another_replica(
    redis_url: str,
) -> None:
    async with replicas(redis_url, "A", "B") as (a, b):
        old = await scripted(a)
        await agree(a, b, expect=lambda _: len(b.service.fleet) == 1)
        new = ScriptedWorker(target(b), "w1", hash_config=DEV_HASH)
        new.incarnation = old.incarnation
        await new.move_to(target(b))
        await new.connect()
        with pytest.raises(grpc.RpcError) as ended:
            while True:
                await old.next_message(timeout=LAG_BOUND_S)
        assert ended.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert outcome_of(ended.value).reason is Reason.SUPERSEDED
        assert "attached to coordinator replica B" in (ended.value.details() or "")
        await old.close()
        await new.close()


async def test_a_replica_that_missed_a_batch_takes_the_owners_snapshot(redis_url: str) -> None:
    async with replicas(redis_url, "A", "B") as (a, b):
        worker = await scripted(a)
        keys = worker.keys(PROMPTS[0])
        await worker.store(keys)
        await agree(a, b, expect=lambda got: got[0] == {"w1": 64})
        # A batch B never saw the one before: seq 3 after 1. B must not guess; it asks A.
        fake = Pages("w1", worker.incarnation, 3, (PagesRemoved(tuple(keys)),))
        with redis.Redis.from_url(redis_url) as client:
            client.xadd("kvcoord:{default}:events", encode("X", int(time.time() * 1000), fake))
        assert b.service.replicator is not None
        await eventually(
            lambda: _true(b.service.replicator.counters.applied >= 1
                          and b.service.replicator._applier.counters.gaps == 1),
            what="B to see the gap")
        await agree(a, b, expect=lambda got: got[0] == {"w1": 64})
        await worker.close()


async def _true(value: bool) -> bool:
    return value


async def test_replication_goes_on_after_the_events_stream_is_deleted(redis_url: str) -> None:
    async with replicas(redis_url, "A", "B") as (a, b):
        worker = await scripted(a)
        await worker.store(worker.keys(PROMPTS[0]))
        await agree(a, b, expect=lambda got: got[0] == {"w1": 64})
        with redis.Redis.from_url(redis_url) as client:
            client.delete("kvcoord:{default}:events")
        await worker.store(worker.keys(PROMPTS[1]))
        await agree(a, b, expect=lambda got: got[:2] == [{"w1": 64}, {"w1": 48}])
        await worker.close()


@pytest.mark.parametrize("persistent", [True, False], ids=["aof", "no-persistence"])
async def test_a_redis_crash_is_reconciled_once_redis_is_back(persistent: bool) -> None:
    with RedisServer(appendonly=persistent, appendfsync="always") as server:
        async with replicas(server.url, "A", "B") as (a, b):
            worker = await scripted(a)
            await worker.store(worker.keys(PROMPTS[0]))
            await agree(a, b, expect=lambda got: got[0] == {"w1": 64})
            server.stop(hard=True)
            # A applies what its worker says meanwhile (lookups keep answering from memory)...
            await worker.store(worker.keys(PROMPTS[1]))
            assert (await lookups(a))[1] == {"w1": 48}
            replicator = a.service.replicator
            assert replicator is not None
            await eventually(lambda: _true(replicator.counters.publish_failures >= 1),
                             what="A to fail publishing the batch")
            server.start()
            # ...and B has it once A re-published its view (B re-asks for everything when the
            # stream it was reading is gone).
            await agree(a, b, expect=lambda got: got[:2] == [{"w1": 64}, {"w1": 48}])
            assert b.service.replicator is not None
            if not persistent:
                assert b.service.replicator.counters.resnapshots >= 1
            await worker.close()


# ---------------------------------------------------------------- policy updates and failover

PAGE = 4
PROMPT = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5]


@asynccontextmanager
async def workers_on(coordinators: dict[str, str]) -> AsyncIterator[list[RunningWorker]]:
    """Real in-process workers, worker id -> its TARGETS."""
    async with AsyncExitStack() as stack:
        started = []
        for worker_id, targets in coordinators.items():
            running = await start_worker(WorkerConfig(
                coordinator=targets, listen="127.0.0.1:0", pages=64, page_size=PAGE,
                device="cpu", worker_id=worker_id, max_new_tokens=8, backoff_max_ms=200,
            ))
            stack.push_async_callback(running.stop, 0.5)
            started.append(running)
        for running in started:
            await asyncio.wait_for(running.agent.synced.wait(), 10)
        yield started


@pytest.mark.parametrize(("mode", "begin_at", "commit_at"), [("sync", 0, 0), ("async", 1, 0)])
async def test_a_policy_update_through_one_replica_reaches_every_replicas_workers(
    redis_url: str, mode: str, begin_at: int, commit_at: int,
) -> None:
    async with replicas(redis_url, "A", "B", page_size=PAGE, barrier_timeout_ms=5_000,
                        route_wait_ms=3_000) as coordinators:
        a, b = coordinators
        async with workers_on({"wa": target(a), "wb": target(b)}):
            async with AsyncCoordinatorClient(target(a)) as client:
                await eventually(lambda: _routable(client, 2), what="both workers on A")
            begin = AsyncCoordinatorClient(target(coordinators[begin_at]))
            commit = AsyncCoordinatorClient(target(coordinators[commit_at]))
            async with begin, commit:
                record = await begin.begin_policy_update(0, mode=mode)
                assert record.target_version == 1
                result = await commit.commit_policy_update(1, timeout=5.0)
            assert (sorted(result.acked_workers), result.fenced_workers) == (["wa", "wb"], ())
            for coordinator in coordinators:
                async with AsyncCoordinatorClient(target(coordinator)) as client:
                    await eventually(lambda c=client: _all_at(c, 1), what="v1 everywhere")
                    assert (await client.route(PROMPT)).policy_version == 1


async def _routable(client: AsyncCoordinatorClient, n: int) -> bool:
    return sum(w.state == "ready" for w in await client.workers()) == n


async def _all_at(client: AsyncCoordinatorClient, version: int) -> bool:
    workers = await client.workers()
    return (await client.policy()).version == version and all(
        (w.policy_version, w.state) == (version, "ready") for w in workers)


async def test_workers_of_a_stopped_replica_move_to_the_survivor_with_their_pages(
    redis_url: str,
) -> None:
    async with AsyncExitStack() as stack:
        b = await stack.enter_async_context(
            running_coordinator(redis=redis_url, replica_id="B", page_size=PAGE))
        a_running = running_coordinator(redis=redis_url, replica_id="A", page_size=PAGE)
        a = await a_running.__aenter__()
        stack.push_async_exit(a_running)
        worker, = await stack.enter_async_context(workers_on({"w1": f"{target(a)},{target(b)}"}))
        client = await stack.enter_async_context(AsyncCoordinatorClient(target(b)))
        await eventually(lambda: _owned_by(client, "A"), what="w1 on A, seen from B")
        cached = await _generate(worker)
        await eventually(lambda: _cached(client), what="w1's pages on B")
        incarnation = worker.agent.incarnation
        await a.stop(grace=0.2)
        await eventually(lambda: _owned_by(client, "B"), timeout=10,
                         what="w1 to re-attach to B")
        assert worker.agent.incarnation == incarnation  # resumed there, not re-registered
        assert (await client.lookup(PROMPT)).matches == {"w1": cached}


async def _generate(worker: RunningWorker) -> int:
    async with AsyncWorkerClient(f"127.0.0.1:{worker.port}") as client:
        await client.generate(PROMPT, 2)
    return len(PROMPT) // PAGE * PAGE


async def _cached(client: AsyncCoordinatorClient) -> bool:
    return bool((await client.lookup(PROMPT)).matches)


async def _owned_by(client: AsyncCoordinatorClient, replica: str) -> bool:
    return [(w.owner_replica, w.state) for w in await client.workers()] == [(replica, "ready")]


# ---------------------------------------------------------------- the SDK's streams fail over


async def test_a_following_rollout_reader_resumes_on_another_replica_from_its_cursor(
    redis_url: str,
) -> None:
    async with AsyncExitStack() as stack:
        b = await stack.enter_async_context(running_coordinator(redis=redis_url, replica_id="B"))
        a_running = running_coordinator(redis=redis_url, replica_id="A")
        a = await a_running.__aenter__()
        stack.push_async_exit(a_running)
        log = b.service.rollouts
        await log.append("w1", {3}, [Rollout(f"r{i}", 3, "w1", 40, 32, 8) for i in range(3)])
        client = await stack.enter_async_context(
            AsyncCoordinatorClient(f"{target(a)},{target(b)}"))
        seen: list[str] = []

        async def follow() -> None:
            async for record in client.rollouts(follow=True):
                seen.append(record.rollout_id)

        reader = asyncio.create_task(follow())
        await eventually(lambda: _true(len(seen) == 3), what="the first records through A")
        await a.stop(grace=0.1)
        await log.append("w1", {3}, [Rollout(f"r{i}", 3, "w1", 40, 32, 8) for i in (3, 4)])
        await eventually(lambda: _true(len(seen) == 5), what="the rest through B")
        reader.cancel()
        assert seen == ["r0", "r1", "r2", "r3", "r4"]  # none twice, none lost


def test_the_blocking_sdk_reads_streams_through_the_first_live_target(redis_url: str) -> None:
    async def scenario() -> None:
        async with running_coordinator(redis=redis_url, replica_id="B") as b:
            await b.service.rollouts.append("w1", {0}, [Rollout("r0", 0, "w1", 4, 0, 1)])
            dead = f"127.0.0.1:{free_port()}"
            with CoordinatorClient(f"{dead},{target(b)}", timeout=5) as client:
                records = await asyncio.to_thread(lambda: list(client.rollouts()))
                assert [r.rollout_id for r in records] == ["r0"]
                state = await asyncio.to_thread(lambda: next(iter(client.watch_policy())))
                assert state.version == 0

    asyncio.run(scenario())
