"""Policy updates through a real coordinator and real in-process workers (runtime, agent, gRPC):
sync barrier, fencing, abort, async rolling updates, waiting routes, rollout attribution."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import grpc
import pytest

from coordinator.client import AsyncCoordinatorClient, KvcoordError
from coordinator.server.main import RunningCoordinator
from coordinator.wire import Reason
from tests.coordinator_fixtures import eventually, running_coordinator, target
from worker.client import AsyncWorkerClient
from worker.config import WorkerConfig
from worker.main import RunningWorker, start_worker

PAGE = 4
PROMPT = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5]


@pytest.fixture
async def fleet() -> AsyncIterator[tuple[RunningCoordinator, list[RunningWorker]]]:
    async with running_coordinator(page_size=PAGE, barrier_timeout_ms=3000,
                                   route_wait_ms=3000) as coord, AsyncExitStack() as stack:
        workers = []
        for i in range(3):
            config = WorkerConfig(
                coordinator=target(coord), listen="127.0.0.1:0", pages=64, page_size=PAGE,
                device="cpu", worker_id=f"w{i}", max_new_tokens=16,
            )
            running = await start_worker(config)
            stack.push_async_callback(running.stop, 0.5)
            workers.append(running)
        for w in workers:
            await asyncio.wait_for(w.agent.synced.wait(), 5)
        yield coord, workers


def _addr(worker: RunningWorker) -> str:
    return f"127.0.0.1:{worker.port}"


async def test_sync_update_drains_applies_commits_and_outputs_follow_the_version(
    fleet: tuple[RunningCoordinator, list[RunningWorker]],
) -> None:
    coord, workers = fleet
    async with AsyncCoordinatorClient(target(coord)) as client:
        before = [await AsyncWorkerClient(_addr(w)).generate(PROMPT, 4) for w in workers]
        assert {g.policy_version for g in before} == {0}
        async with client.policy_update(0) as update:
            assert update.version == 1
            state = await client.policy()
            assert (state.phase, state.target_version) == ("draining", 1)
            # No route while the fleet drains: a short deadline gets UNAVAILABLE + retry-after.
            with pytest.raises(KvcoordError) as err:
                await AsyncCoordinatorClient(target(coord), timeout=0.3).route(PROMPT)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert update.result is not None
        assert (update.result.version, update.result.phase) == (1, "serving")
        assert sorted(update.result.acked_workers) == ["w0", "w1", "w2"]
        assert update.result.fenced_workers == ()
        route = await client.route(PROMPT)
        assert route.policy_version == 1
        after = await AsyncWorkerClient(route.address).generate(PROMPT, 4)
        assert after.policy_version == 1
        assert after.cached_tokens == 0  # nothing computed under version 0 is reused
        assert after.tokens != before[0].tokens  # other weights, other tokens
        infos = {w.worker_id: (w.policy_version, w.state) for w in await client.workers()}
        assert infos == {f"w{i}": (1, "ready") for i in range(3)}


async def test_stale_expected_version_is_aborted_and_never_double_bumps(
    fleet: tuple[RunningCoordinator, list[RunningWorker]],
) -> None:
    coord, _ = fleet
    async with AsyncCoordinatorClient(target(coord)) as a, \
            AsyncCoordinatorClient(target(coord)) as b:
        await a.begin_policy_update(0)
        with pytest.raises(KvcoordError) as err:
            await b.begin_policy_update(0)
        assert err.value.code == grpc.StatusCode.ABORTED
        state = await a.commit_policy_update(1, timeout=3)
        assert state.version == 1
        with pytest.raises(KvcoordError) as err:
            await b.begin_policy_update(0)
        assert err.value.code == grpc.StatusCode.ABORTED
        assert "stale expected_version" in err.value.details
        assert (await a.policy()).version == 1


async def test_abort_returns_to_the_current_version_and_routes_resume(
    fleet: tuple[RunningCoordinator, list[RunningWorker]],
) -> None:
    coord, workers = fleet
    async with AsyncCoordinatorClient(target(coord)) as client:
        with pytest.raises(RuntimeError, match="trainer failed"):
            async with client.policy_update(0):
                raise RuntimeError("trainer failed")
        state = await client.policy()
        assert (state.version, state.phase, state.target_version) == (0, "serving", None)

        async def all_back() -> bool:
            # Every command the abort caused (DRAIN, maybe APPLY(1), APPLY(0), RESUME) handled.
            await asyncio.gather(*(w.agent.commands_idle() for w in workers))
            seen = {w.policy_version for w in await client.workers()}
            return (seen == {0} and {w.runtime.policy_version for w in workers} == {0}
                    and not any(w.gate.closed for w in workers))

        await eventually(all_back, what="workers back at version 0 and serving")
        route = await client.route(PROMPT)
        assert route.policy_version == 0
        generation = await AsyncWorkerClient(route.address).generate(PROMPT, 2)
        assert generation.policy_version == 0


async def test_a_worker_that_never_acks_is_fenced_then_rejoins_at_the_new_version(
    fleet: tuple[RunningCoordinator, list[RunningWorker]],
) -> None:
    coord, workers = fleet
    stuck = workers[2]
    # Simulate a worker that cannot load the new weights: its APPLY fails, so it never acks.
    original = stuck.runtime.load_weights
    calls = {"n": 0}

    def failing_load(version: int, path: str | None = None) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError("weights store unreachable")
        return original(version, path)

    stuck.runtime.load_weights = failing_load  # type: ignore[method-assign]
    async with AsyncCoordinatorClient(target(coord)) as client:
        await client.begin_policy_update(0)
        state = await client.commit_policy_update(1, timeout=1.5)
        assert sorted(state.acked_workers) == ["w0", "w1"]
        assert state.fenced_workers == ("w2",)
        for _ in range(6):
            assert (await client.route(PROMPT)).worker_id in {"w0", "w1"}

        async def rejoined() -> bool:
            infos = {w.worker_id: (w.policy_version, w.state) for w in await client.workers()}
            return infos.get("w2") == (1, "ready")

        await eventually(rejoined, timeout=10, what="fenced worker to rejoin at version 1")
        assert stuck.runtime.policy_version == 1


async def test_async_update_moves_workers_one_by_one_while_routes_flow(
    fleet: tuple[RunningCoordinator, list[RunningWorker]],
) -> None:
    coord, _ = fleet
    async with AsyncCoordinatorClient(target(coord)) as client:
        state = await client.begin_policy_update(0, mode="async")
        assert (state.phase, state.target_version, state.mode) == ("serving", 1, "async")
        versions_seen = set()
        while True:
            route = await client.route(PROMPT)
            generation = await AsyncWorkerClient(route.address).generate(PROMPT, 1)
            versions_seen.add(generation.policy_version)
            if {w.policy_version for w in await client.workers()} == {1}:
                break
        committed = await client.commit_policy_update(1, timeout=3)
        assert committed.version == 1 and committed.fenced_workers == ()
        assert versions_seen <= {0, 1}
        newest = await client.route(PROMPT, min_policy_version=1)
        assert newest.policy_version == 1


async def test_every_generation_is_reported_with_the_version_that_produced_it(
    fleet: tuple[RunningCoordinator, list[RunningWorker]],
) -> None:
    coord, workers = fleet
    async with AsyncCoordinatorClient(target(coord)) as client:
        for w in workers:
            await AsyncWorkerClient(_addr(w)).generate(PROMPT, 2)
        async with client.policy_update(0):
            pass
        for w in workers:
            await AsyncWorkerClient(_addr(w)).generate(PROMPT, 2)

        async def all_reported() -> bool:
            return len([r async for r in client.rollouts()]) == 6

        await eventually(all_reported, what="six rollout records")
        records = [r async for r in client.rollouts()]
        assert sorted((r.worker_id, r.policy_version) for r in records) == sorted(
            [(f"w{i}", 0) for i in range(3)] + [(f"w{i}", 1) for i in range(3)]
        )
        assert all(r.cursor for r in records)
        later = [r async for r in client.rollouts(since=records[2].cursor)]
        assert later == records[3:]


async def test_watch_policy_streams_the_state_then_every_change(
    fleet: tuple[RunningCoordinator, list[RunningWorker]],
) -> None:
    coord, _ = fleet
    async with AsyncCoordinatorClient(target(coord)) as client:
        seen: list[tuple[int, str, int | None]] = []

        async def watch() -> None:
            async for state in client.watch_policy():
                seen.append((state.version, state.phase, state.target_version))
                if state.version == 1 and state.phase == "serving":
                    return

        watcher = asyncio.create_task(watch())
        await eventually(lambda: _async(bool(seen)), what="the first state")
        async with client.policy_update(0):
            pass
        await asyncio.wait_for(watcher, 5)
        assert seen == [(0, "serving", None), (0, "draining", 1), (1, "serving", None)]


async def _async(value: bool) -> bool:
    return value


async def test_an_update_nobody_commits_is_aborted_after_the_timeout() -> None:
    async with running_coordinator(page_size=PAGE, update_timeout_ms=300) as coord:
        config = WorkerConfig(coordinator=target(coord), listen="127.0.0.1:0", pages=32,
                              page_size=PAGE, device="cpu", worker_id="w", max_new_tokens=8)
        worker = await start_worker(config)
        await asyncio.wait_for(worker.agent.synced.wait(), 5)
        async with AsyncCoordinatorClient(target(coord)) as client:
            await client.begin_policy_update(0)  # ...and the trainer dies

            async def aborted() -> bool:
                state = await client.policy()
                return (state.version, state.phase, state.target_version) == (0, "serving", None)

            await eventually(aborted, what="the abandoned update to be aborted")
            route = await client.route(PROMPT)
            assert (route.worker_id, route.policy_version) == ("w", 0)
        await worker.stop(grace=0.5)


@pytest.mark.redis
async def test_a_redis_crash_right_after_begin_fences_nobody() -> None:
    from tests.conftest import skip_without_redis
    from tests.redis_server import RedisServer

    skip_without_redis()
    with RedisServer(appendonly=True, appendfsync="always") as redis_server:
        async with running_coordinator(page_size=PAGE, redis=redis_server.url) as coord, \
                AsyncExitStack() as stack:
            workers = []
            for i in range(2):
                config = WorkerConfig(
                    coordinator=target(coord), listen="127.0.0.1:0", pages=32, page_size=PAGE,
                    device="cpu", worker_id=f"w{i}", max_new_tokens=8,
                )
                running = await start_worker(config)
                stack.push_async_callback(running.stop, 0.5)
                workers.append(running)
            for w in workers:
                await asyncio.wait_for(w.agent.synced.wait(), 5)
            async with AsyncCoordinatorClient(target(coord), timeout=20) as client:
                await client.begin_policy_update(0)
                # Acks and heartbeats fail while Redis is down; streams break and come back.
                redis_server.restart(hard=True)
                state = await client.commit_policy_update(1, timeout=8)
                assert sorted(state.acked_workers) == ["w0", "w1"]
                assert state.fenced_workers == ()
                assert (await client.policy()).version == 1


async def test_a_command_lost_with_a_broken_stream_is_resent_when_the_worker_reconnects(
    fleet: tuple[RunningCoordinator, list[RunningWorker]],
) -> None:
    coord, _ = fleet
    streams = coord.service.streams
    original_send = streams.send
    dropped: list[str] = []

    def lossy_send(worker_id: str, message: object) -> bool:
        if worker_id == "w0" and not dropped:  # fault injection: the DRAIN to w0 is lost
            dropped.append(worker_id)
            return True
        return original_send(worker_id, message)  # type: ignore[arg-type]

    streams.send = lossy_send  # type: ignore[method-assign]
    async with AsyncCoordinatorClient(target(coord)) as client:
        await client.begin_policy_update(0)
        assert dropped == ["w0"]
        # w0 reconnects under the same incarnation, as after any stream the coordinator ends
        # with LEASE_LAPSED.
        streams.close("w0", "injected stream failure", Reason.LEASE_LAPSED)
        state = await client.commit_policy_update(1, timeout=5)
        assert sorted(state.acked_workers) == ["w0", "w1", "w2"]
        assert state.fenced_workers == ()


async def test_a_drain_that_aborts_running_generation_stops_it_at_once() -> None:
    async with running_coordinator(page_size=PAGE) as coord:
        config = WorkerConfig(coordinator=target(coord), listen="127.0.0.1:0", pages=512,
                              page_size=PAGE, device="cpu", worker_id="w", max_new_tokens=1500)
        worker = await start_worker(config)
        await asyncio.wait_for(worker.agent.synced.wait(), 5)
        async with AsyncCoordinatorClient(target(coord)) as client, \
                AsyncWorkerClient(_addr(worker)) as generator:
            long_one = asyncio.create_task(generator.generate(PROMPT, 1500))

            async def running() -> bool:
                return worker.runtime.stats().running_requests == 1

            await eventually(running, what="the long generation to start")
            await client.begin_policy_update(0, abort_running=True)
            with pytest.raises(KvcoordError) as err:
                await long_one
            assert err.value.code == grpc.StatusCode.ABORTED
            assert "aborted by a policy drain" in err.value.details
            state = await client.commit_policy_update(1, timeout=5)
            assert state.acked_workers == ("w",)
            after = await generator.generate(PROMPT, 2)
            assert after.policy_version == 1
            worker.runtime.check_integrity()
        await worker.stop(grace=0.5)
