"""A replica cut from Redis stops routing once it has not read the policy state for
``policy_stale_ms``, so no route answered that long after a commit carries the old version;
it routes again once Redis answers it (issue 14, part 3's rule).

Two real coordinator replicas on one real redis-server; replica B logs in as its own Redis
user, so disabling that user (``ACL SETUSER b off`` and ``CLIENT KILL USER b``) cuts B alone
while the worker, replica A and the trainer keep their Redis."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest
import redis

from coordinator.client import AsyncCoordinatorClient, CoordinatorClient, KvcoordError
from coordinator.config import CoordinatorConfig
from coordinator.server.main import RunningCoordinator
from coordinator.wire import Reason
from kvcoord import child_process
from tests.coordinator_fixtures import eventually, running_coordinator, target
from tests.redis_server import RedisServer, redis_server_available
from worker.config import WorkerConfig
from worker.main import RunningWorker, start_worker

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(not redis_server_available(), reason="redis-server not installed"),
]

PAGE = 4
PROMPT = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 1, 2]
STALE_MS = 600
B_RETRY_MS = 2_000  # replica B's route_retry_ms: longer than any client deadline here
# Leases far longer than the test's cut: B's view of the worker stays routable throughout, so
# only the staleness rule can make B refuse.
KNOBS: dict[str, object] = {
    "page_size": PAGE, "lease_ms": 20_000, "heartbeat_ms": 300, "policy_stale_ms": STALE_MS,
    "barrier_timeout_ms": 5_000, "bootstrap_timeout_ms": 2_000,
}


@asynccontextmanager
async def a_worker(coordinator: str) -> AsyncIterator[RunningWorker]:
    running = await start_worker(WorkerConfig(
        coordinator=coordinator, listen="127.0.0.1:0", pages=64, page_size=PAGE, device="cpu",
        worker_id="w", max_new_tokens=4, backoff_max_ms=200,
    ))
    try:
        await asyncio.wait_for(running.agent.synced.wait(), 10)
        yield running
    finally:
        await running.stop(0.5)


async def route_or_refusal(coordinator: RunningCoordinator) -> int | KvcoordError:
    """The version a route is answered with, or the refusal."""
    async with AsyncCoordinatorClient(target(coordinator), timeout=0.5) as client:
        try:
            return (await client.route(PROMPT)).policy_version
        except KvcoordError as exc:
            return exc


def is_stale_refusal(answer: int | KvcoordError) -> bool:
    return (isinstance(answer, KvcoordError) and answer.code == grpc.StatusCode.UNAVAILABLE
            and answer.reason is Reason.POLICY_STALE and answer.retry_after_ms == B_RETRY_MS
            and "policy_stale_ms" in str(answer))


async def test_a_replica_cut_from_redis_refuses_routes_after_policy_stale_ms() -> None:
    with RedisServer() as server, redis.Redis(port=server.port) as admin:
        admin.execute_command("ACL", "SETUSER", "b", "on", ">b-secret", "~*", "&*", "+@all")
        url_b = f"redis://b:b-secret@127.0.0.1:{server.port}/0"
        async with running_coordinator(redis=server.url, replica_id="A", **KNOBS) as a, \
                running_coordinator(redis=url_b, replica_id="B", route_retry_ms=B_RETRY_MS,
                                    **KNOBS) as b, \
                a_worker(target(a)), AsyncCoordinatorClient(target(a)) as trainer:

            async def b_routes_at(version: int) -> bool:
                return await route_or_refusal(b) == version

            await eventually(lambda: b_routes_at(0), timeout=10, what="B routing to A's worker")

            admin.execute_command("ACL", "SETUSER", "b", "off")
            admin.execute_command("CLIENT", "KILL", "USER", "b")
            cut_at = time.monotonic()

            async def b_refuses() -> bool:
                return is_stale_refusal(await route_or_refusal(b))

            await eventually(b_refuses, timeout=5, what="B refusing routes as stale")
            assert time.monotonic() - cut_at < STALE_MS / 1000 + 3  # far below the lease
            assert await route_or_refusal(a) == 0
            async with AsyncCoordinatorClient(target(b), timeout=0.5) as client:
                with pytest.raises(KvcoordError) as err:
                    await client.route_batch([PROMPT, PROMPT])
                assert is_stale_refusal(err.value)

            # A client given both replicas, the stale one first, is served by A at once: it
            # does not wait out B's RetryInfo delay (2 s, longer than its whole deadline).
            both = f"{target(b)},{target(a)}"
            async with AsyncCoordinatorClient(both, timeout=1.5) as failover:
                assert (await failover.route(PROMPT)).policy_version == 0
                assert len((await failover.route_batch([PROMPT, PROMPT])).routes) == 2

            def route_blocking() -> int:  # the blocking client, off the servers' event loop
                with CoordinatorClient(both, timeout=1.5) as blocking:
                    return blocking.route(PROMPT).policy_version

            assert await asyncio.to_thread(route_blocking) == 0

            # A sync update committed through A while B cannot read the policy state.
            async with trainer.policy_update(0) as update:
                pass
            assert update.result is not None and update.result.acked_workers == ("w",)
            committed_at = time.monotonic()
            answers: list[tuple[float, str, int | KvcoordError]] = []
            while time.monotonic() < committed_at + STALE_MS / 1000 + 1.0:
                for name, replica in (("A", a), ("B", b)):
                    answers.append((time.monotonic(), name, await route_or_refusal(replica)))
                await asyncio.sleep(0.05)
            late = [(name, answer) for at, name, answer in answers
                    if at - committed_at > STALE_MS / 1000 and isinstance(answer, int)]
            assert late and all(answer >= 1 for _, answer in late), late
            assert all(is_stale_refusal(answer) for _, name, answer in answers if name == "B")

            # Redis answers B again: it reads the committed state and routes under it.
            admin.execute_command("ACL", "SETUSER", "b", "on")
            await eventually(lambda: b_routes_at(1), timeout=10, what="B routing at version 1")


@pytest.mark.parametrize(("value", "needle"), [
    ("0", "policy_stale_ms must be > 0, got 0"),
    ("soon", "KVCOORD_POLICY_STALE_MS='soon' is not a valid int"),
])
def test_a_bad_policy_stale_ms_stops_the_coordinator_at_start_naming_it(
    value: str, needle: str,
) -> None:
    env = {**os.environ, "KVCOORD_POLICY_STALE_MS": value}
    done = child_process.run([sys.executable, "-m", "kvcoord.cli", "coordinator", "--listen",
                           "127.0.0.1:0"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert needle in done.stderr


def test_policy_stale_ms_defaults_to_one_lease_and_reads_run_four_times_within_it() -> None:
    config = CoordinatorConfig.from_sources({}, {"KVCOORD_LEASE_MS": "800",
                                                 "KVCOORD_HEARTBEAT_MS": "200"})
    assert (config.policy_stale_ms, config.policy_stale_s, config.policy_read_s) == (
        None, 0.8, 0.2)
    config = CoordinatorConfig.from_sources({}, {"KVCOORD_POLICY_STALE_MS": "5000"})
    assert (config.policy_stale_s, config.policy_read_s) == (5.0, 0.25)  # policy_poll_ms
