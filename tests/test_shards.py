"""Shards: replica sets of one namespace on one Redis, each ingesting only its own workers,
with one policy barrier across them.

In one process, against a real redis-server: shard ``a`` (replicas A1, A2) and shard ``b``
(replica B1). A worker's pages reach its own shard's replicas through ``events:<shard>`` and
never the other shard's; each shard lists only its own replicas. A policy update begun through
shard a's replica waits for shard b's worker too (its members are read from the workers'
records in the store), which B1 drains, reloads and resumes; one that never acks is fenced by
its own shard's replica; an abort through B1 reaches A1's.

Across hosts (``tests/multihost_cluster.py``'s ``SHARDED`` layout: Redis, shard a's replicas
a1 and a2, shard b's b1 and the workers w1, w2 (shard a) and w3 (shard b), each in its own
network namespace, every worker pointed at its own shard's replicas only), with real workers:
pages are indexed by their own shard only, a shard's two replicas replicate to each other, a
sync update begun and committed through a1 moves w3 too, and a stopped w3 holds the commit back
until its deadline and is fenced.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager

import grpc
import pytest
import redis

from bench.scripted_worker import ScriptedWorker
from coordinator.client import AsyncCoordinatorClient
from coordinator.client.outcomes import outcome_of
from coordinator.control.shard_members import members_elsewhere
from coordinator.core.hashing import DEV_HASH_KEY, HashConfig
from coordinator.server.main import RunningCoordinator
from coordinator.store.protocol import WorkerRecord
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.wire import Reason
from tests.conftest import skip_without_redis
from tests.coordinator_fixtures import DEV_HASH, eventually, running_coordinator, target
from tests.multihost_cluster import PAGE as HOST_PAGE
from tests.multihost_cluster import (
    PROMPTS,
    SHARDED,
    WAIT_S,
    Cluster,
    all_ready,
    holdings,
    infos,
    owners,
    replicas_agree,
    running_cluster,
    serve_and_index,
)
from tests.multihost_cluster import eventually as polled
from tests.test_replication import PAGE, workers_on

pytestmark = pytest.mark.redis

LAG_BOUND_S = 2.0
PROMPT = list(range(64))


@asynccontextmanager
async def sharded(url: str, shards: dict[str, tuple[str, ...]], **knobs: object
                  ) -> AsyncIterator[dict[str, RunningCoordinator]]:
    """Replicas by id, ``shards`` naming each shard's replica ids (started in that order)."""
    async with AsyncExitStack() as stack:
        started = {}
        for shard, names in shards.items():
            for name in names:
                started[name] = await stack.enter_async_context(running_coordinator(
                    redis=url, replica_id=name, shard=shard, bootstrap_timeout_ms=2_000,
                    **knobs))
        yield started


@asynccontextmanager
async def two_shards_two_workers(url: str) -> AsyncIterator[
        tuple[RunningCoordinator, RunningCoordinator]]:
    """A1 (shard a) with worker wa and B1 (shard b) with wb, both workers ready at version 0."""
    async with sharded(url, {"a": ("A1",), "b": ("B1",)}, page_size=PAGE,
                       barrier_timeout_ms=5_000, route_wait_ms=3_000) as replicas:
        a1, b1 = replicas["A1"], replicas["B1"]
        async with workers_on({"wa": target(a1), "wb": target(b1)}):
            await listed(a1, {"wa": (0, "ready")})
            await listed(b1, {"wb": (0, "ready")})
            yield a1, b1


async def states(coordinator: RunningCoordinator) -> dict[str, tuple[int, str]]:
    """Worker -> (version, state), as ``coordinator`` lists its workers."""
    async with AsyncCoordinatorClient(target(coordinator)) as client:
        return {w.worker_id: (w.policy_version, w.state) for w in await client.workers()}


async def listed(coordinator: RunningCoordinator, expected: dict[str, tuple[int, str]]) -> None:
    async def done() -> bool:
        return await states(coordinator) == expected

    await eventually(done, what=f"{expected} listed")


async def matches(coordinator: RunningCoordinator) -> dict[str, int]:
    async with AsyncCoordinatorClient(target(coordinator)) as client:
        return (await client.lookup(PROMPT)).matches


def test_members_in_other_shards_are_attached_unfenced_internal_workers_at_the_version() -> None:
    def record(worker_id: str, *, version: int = 3, external: bool = False,
               **info: str) -> WorkerRecord:
        return WorkerRecord(worker_id, 1, "addr", version, external, 0, info)

    records = [
        record("b-ready", shard="b", status="ready"),
        record("c-ready", shard="c", status="ready"),
        record("unsharded", status="ready"),
        record("a-own", shard="a", status="ready"),  # this replica's shard: its fleet says
        record("b-fenced", shard="b", status="fenced"),
        record("b-gone", shard="b", status="disconnected"),
        record("b-new", shard="b"),  # registered, no stream attached yet
        record("b-old", shard="b", status="ready", version=2),
        record("b-bridge", shard="b", status="ready", external=True),
    ]
    assert members_elsewhere(records, shard="a", version=3) == ["b-ready", "c-ready",
                                                                 "unsharded"]


async def test_pages_reach_their_own_shards_replicas_only(redis_url: str) -> None:
    async with sharded(redis_url, {"a": ("A1", "A2"), "b": ("B1",)}) as replicas:
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


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_an_update_begun_in_one_shard_waits_for_and_moves_the_other_shards_worker(
    redis_url: str, mode: str,
) -> None:
    async with two_shards_two_workers(redis_url) as (a1, b1):
        async with AsyncCoordinatorClient(target(a1)) as trainer:
            assert (await trainer.begin_policy_update(0, mode=mode)).target_version == 1
            result = await trainer.commit_policy_update(1, timeout=5.0)
        assert (result.acked_workers, result.fenced_workers) == (("wa", "wb"), ())
        await listed(a1, {"wa": (1, "ready")})
        await listed(b1, {"wb": (1, "ready")})


async def test_an_update_begun_in_one_shard_is_aborted_through_another(redis_url: str) -> None:
    async with two_shards_two_workers(redis_url) as (a1, b1):
        async with AsyncCoordinatorClient(target(a1)) as begin:
            await begin.begin_policy_update(0)
        async def drained() -> bool:  # B1 relayed A1's DRAIN (and, as wb drained, its APPLY)
            return await states(b1) == {"wb": (1, "draining")}

        await eventually(drained, what="wb drained and at version 1 on B1")
        async with AsyncCoordinatorClient(target(b1)) as abort:
            assert (await abort.abort_policy_update(1)).version == 0
        await listed(a1, {"wa": (0, "ready")})
        await listed(b1, {"wb": (0, "ready")})


async def test_a_member_in_another_shard_that_never_acks_is_fenced_by_its_own_replica(
    redis_url: str,
) -> None:
    async with sharded(redis_url, {"a": ("A1",), "b": ("B1",)}, page_size=PAGE,
                       barrier_timeout_ms=5_000) as replicas:
        a1, b1 = replicas["A1"], replicas["B1"]
        mute = ScriptedWorker(target(b1), "wb", hash_config=HashConfig(key=DEV_HASH_KEY,
                                                                        page_size=PAGE))
        await mute.start()  # it heartbeats only when told, and never acks a command
        async with workers_on({"wa": target(a1)}):
            await mute.heartbeat()

            def record_ready() -> bool:  # B1 writes wb's record a round trip after the attach
                with redis.Redis.from_url(redis_url) as store:
                    record = store.hgetall("kvcoord:{default}:worker:wb")
                return (record.get(b"info:shard"), record.get(b"info:status")) == (
                    b"b", b"ready")

            await eventually(lambda: asyncio.to_thread(record_ready), what="wb's record")
            async with AsyncCoordinatorClient(target(a1)) as trainer:
                await trainer.begin_policy_update(0)
                drain = (await mute.next_message()).command
                assert (drain.kind, drain.version) == (pb.PolicyCommand.KIND_DRAIN, 1)
                result = await trainer.commit_policy_update(1, timeout=1.0)
            assert (result.acked_workers, result.fenced_workers) == (("wa",), ("wb",))
            with pytest.raises(grpc.RpcError) as ended:
                await mute.next_message()
            assert outcome_of(ended.value).reason is Reason.FENCED
            await listed(a1, {"wa": (1, "ready")})
        await mute.close()


# ---------------------------------------------------------------------- across hosts

SHARD_A, SHARD_B = ("a1", "a2"), ("b1",)
WAIT_UPDATE_S = 5.0  # a sync update's DRAIN/APPLY/RESUME relayed to every worker, on 2 cores


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    skip_without_redis()
    with running_cluster(tmp_path_factory.mktemp("shards-logs"), SHARDED) as cluster:
        yield cluster


def every_replica_at(cluster: Cluster, version: int) -> None:
    """Wait until each replica lists its own shard's workers, all ready at ``version``."""
    for replica in SHARDED.replicas:
        workers = SHARDED.workers_of(replica)
        with cluster.client(replica, timeout=2.0) as client:
            polled(lambda c=client, w=workers: all_ready(c, version, w),
                   f"{workers} ready at {version} on {replica}", timeout=WAIT_UPDATE_S)


@pytest.mark.slow
def test_hosts_pages_are_indexed_by_their_own_shard_only(cluster: Cluster) -> None:
    with cluster.client(*SHARD_A) as shard_a, cluster.client(*SHARD_B) as shard_b:
        keys_b = shard_b.stats().index_keys
        serve_and_index(cluster, shard_a, "w1")
        assert shard_b.stats().index_keys == keys_b  # shard b ingested none of w1's pages
        keys_a = shard_a.stats().index_keys
        serve_and_index(cluster, shard_b, "w3")
        assert shard_a.stats().index_keys == keys_a
        held = {w: {w: 3 * HOST_PAGE} for w in ("w1", "w3")}
        # Lookups span the shards (each replica asks the other shard): every replica lists
        # both holders.
        assert {w: replicas_agree(cluster)[w] for w in held} == held
        assert sorted(infos(shard_b)) == ["w3"]


@pytest.mark.slow
def test_hosts_routes_through_either_shard_reach_the_other_shards_holder(
        cluster: Cluster) -> None:
    with cluster.client(*SHARD_A) as shard_a, cluster.client(*SHARD_B) as shard_b:
        serve_and_index(cluster, shard_b, "w3")
        serve_and_index(cluster, shard_a, "w1")
        # Decided on shard a, reserved on shard b (and the other way round); the worker then
        # serves the prompt from its cache.
        for client, holder in ((shard_a, "w3"), (shard_b, "w1")):
            route = client.route(PROMPTS[holder])
            assert (route.worker_id, route.matched_pages) == (holder, 3)
            with cluster.worker(holder) as worker:
                assert worker.generate(PROMPTS[holder], 2).cached_tokens == 3 * HOST_PAGE


@pytest.mark.slow
def test_hosts_two_replicas_of_one_shard_replicate_to_each_other(cluster: Cluster) -> None:
    with cluster.client("a1") as a1, cluster.client("a2") as a2:
        assert owners(a1) == owners(a2) == {"w1": "a1", "w2": "a2"}
        serve_and_index(cluster, a2, "w2")  # indexed on a2, which owns it
        polled(lambda: holdings(a1)["w2"] == {"w2": 3 * HOST_PAGE}, "a1 to list w2's pages")
        assert a1.stats().replicas == a2.stats().replicas == SHARD_A
    with cluster.client("b1") as b1:
        assert b1.stats().replicas == SHARD_B
        assert "w2" not in infos(b1)  # shard b never heard of shard a's worker


@pytest.mark.slow
def test_hosts_sync_update_through_shard_a_moves_shard_bs_worker_too(cluster: Cluster) -> None:
    with cluster.client("a1") as trainer:
        version = trainer.policy().version
        every_replica_at(cluster, version)
        trainer.begin_policy_update(version)
        result = trainer.commit_policy_update(version + 1, timeout=5.0)
    assert (result.version, result.phase) == (version + 1, "serving")
    assert (result.acked_workers, result.fenced_workers) == (("w1", "w2", "w3"), ())
    every_replica_at(cluster, version + 1)
    for worker_id in SHARDED.workers:
        with cluster.worker(worker_id) as worker:
            assert worker.generate(PROMPTS[worker_id], 2).policy_version == version + 1


@pytest.mark.slow
def test_hosts_stopped_worker_of_shard_b_holds_the_commit_back_and_is_fenced(
    cluster: Cluster,
) -> None:
    victim = "w3"
    process = cluster.workers[victim][1]
    with cluster.client("a1") as trainer, cluster.client("b1") as b1:
        version = trainer.policy().version
        every_replica_at(cluster, version)
        incarnation = infos(b1)[victim].incarnation
        os.killpg(process.pid, signal.SIGSTOP)  # alive to its lease, deaf to commands
        try:
            trainer.begin_policy_update(version)
            started = time.monotonic()
            result = trainer.commit_policy_update(version + 1, timeout=2.0)
            waited = time.monotonic() - started
            assert (result.acked_workers, result.fenced_workers) == (("w1", "w2"), (victim,))
            assert waited >= 1.9, waited  # it waited out the deadline for w3
            assert infos(b1)[victim].state != "ready"
        finally:
            os.killpg(process.pid, signal.SIGCONT)
        # Fenced (its lease gone as well): it re-registers and serves the new version.
        polled(lambda: infos(b1)[victim].incarnation > incarnation
               and all_ready(b1, version + 1, (victim,)),
               f"{victim} to rejoin at version {version + 1}", timeout=WAIT_S)
    with cluster.worker(victim) as worker:
        assert worker.generate(PROMPTS[victim], 2).policy_version == version + 1
