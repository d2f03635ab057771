"""Routes over shards (issue 29): two shards on one redis-server, each replica ingesting only
its own workers and asking the other for its shortlist, decide exactly as one coordinator
holding every worker does; lookups and route ends span the shards; a shard that cannot answer
leaves its workers out instead of failing the route. Real coordinators, real Redis, scripted
workers."""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from bench.scripted_worker import ScriptedWorker
from coordinator.client import AsyncCoordinatorClient
from coordinator.client.outcomes import outcome_of
from coordinator.server.main import RunningCoordinator
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from coordinator.wire import PROTOCOL_VERSION, Reason
from kvcoord import child_process
from kvcoord.fleet_procs import free_port
from tests.auth_fixtures import write_identities
from tests.coordinator_fixtures import DEV_HASH, eventually, running_coordinator, target

pytestmark = pytest.mark.redis

SHARD_WORKERS = {"a": [f"w{i}" for i in range(4)], "b": [f"w{i}" for i in range(4, 8)]}
FAMILIES = 6
PAGE = 16
# Decisions must not move with the clock: leases and pending entries outlive the test, and
# a prefill backlog drains too slowly to reorder two costs (ties stay ties: none drains).
STILL = {"lease_ms": 60_000, "pending_ttl_ms": 60_000, "prefill_tokens_per_s": 1e-6,
         "routing_seed": 29}


def family(f: int) -> list[int]:
    return [f * 1_000 + i for i in range(16 * PAGE)]


def prompt(rng: random.Random, f: int) -> list[int]:
    return family(f) + [50_000 + rng.randrange(10_000) for _ in range(4 * PAGE + 3)]


async def seed_caches(workers: Sequence[ScriptedWorker]) -> None:
    """Worker i holds family i % 6 whole and the first half of family (i + 3) % 6."""
    for i, worker in enumerate(workers):
        await worker.store(worker.keys(family(i % FAMILIES)))
        await worker.store(worker.keys(family((i + 3) % FAMILIES))[:8])


@asynccontextmanager
async def two_shards(url: str, **knobs: Any) -> AsyncIterator[
        tuple[RunningCoordinator, RunningCoordinator, list[ScriptedWorker]]]:
    """Shard a's replica A and shard b's replica B, each naming the other as its peer, each
    with its own four workers."""
    ports = {"a": free_port(), "b": free_port()}
    async with AsyncExitStack() as stack:
        replicas = {}
        for shard, other in (("a", "b"), ("b", "a")):
            replicas[shard] = await stack.enter_async_context(running_coordinator(
                listen=f"127.0.0.1:{ports[shard]}", redis=url, replica_id=shard.upper(),
                shard=shard, peer_shards=f"{other}=127.0.0.1:{ports[other]}",
                bootstrap_timeout_ms=1_000, **knobs))
        workers = []
        for shard, ids in SHARD_WORKERS.items():
            for worker_id in ids:
                worker = ScriptedWorker(target(replicas[shard]), worker_id, hash_config=DEV_HASH)
                await worker.start()
                stack.push_async_callback(worker.close)
                workers.append(worker)
        yield replicas["a"], replicas["b"], workers


@asynccontextmanager
async def one_coordinator(**knobs: Any) -> AsyncIterator[
        tuple[RunningCoordinator, list[ScriptedWorker]]]:
    """The same eight workers on one coordinator (the embedded store)."""
    async with AsyncExitStack() as stack:
        whole = await stack.enter_async_context(running_coordinator(**knobs))
        workers = []
        for worker_id in [w for ids in SHARD_WORKERS.values() for w in ids]:
            worker = ScriptedWorker(target(whole), worker_id, hash_config=DEV_HASH)
            await worker.start()
            stack.push_async_callback(worker.close)
            workers.append(worker)
        yield whole, workers


async def decisions(clients: Sequence[AsyncCoordinatorClient]) -> list[str]:
    """A fixed workload through ``clients`` in turn: single routes of prompts sharing the
    cached families (some repeated: each route's pending entries steer the next), and batches
    of siblings. The chosen worker ids in order."""
    rng = random.Random(1)
    chosen: list[str] = []
    for step in range(48):
        client = clients[step % len(clients)]
        if step % 8 == 7:
            siblings = [prompt(rng, rng.randrange(FAMILIES))] * 4
            batch = await client.route_batch([*siblings, prompt(rng, rng.randrange(FAMILIES))])
            chosen.extend(r.worker_id for r in batch.routes)
        else:
            tokens = prompt(rng, rng.randrange(FAMILIES + 2))  # some families nobody caches
            chosen.append((await client.route(tokens)).worker_id)
    return chosen


async def test_two_shards_decide_every_route_as_one_coordinator_holding_every_worker(
        redis_url: str) -> None:
    async with two_shards(redis_url, **STILL) as (a, b, sharded_workers):
        await seed_caches(sharded_workers)
        async with AsyncCoordinatorClient(target(a)) as via_a, \
                AsyncCoordinatorClient(target(b)) as via_b:
            # Each shard ingests only its own workers.
            assert a.service.fleet.get("w4") is None and b.service.fleet.get("w0") is None
            # Through one replica: its rng draws every tie, as the one coordinator's does
            # (through both, each draws from its own: the same odds, not the same draws).
            sharded = await decisions([via_a])
            assert (await via_b.route([*family(1), 1])).worker_id in {"w1", "w4"}
    async with one_coordinator(**STILL) as (whole, whole_workers):
        await seed_caches(whole_workers)
        async with AsyncCoordinatorClient(target(whole)) as client:
            reference = await decisions([client])
    assert sharded == reference
    assert set(sharded) & set(SHARD_WORKERS["a"]) and set(sharded) & set(SHARD_WORKERS["b"])


async def test_a_route_reserved_on_the_other_shard_ends_through_either(redis_url: str) -> None:
    async with two_shards(redis_url, **STILL) as (a, b, workers):
        await seed_caches(workers)
        # An engine behind a bridge on shard b holds family 7, which nobody else caches: a
        # route asked of A lands there, reserved (and awaited) by B.
        bridged = ScriptedWorker(target(b), "x7", hash_config=DEV_HASH, external=True)
        await bridged.start()
        try:
            await bridged.store(bridged.keys(family(7)))
            tokens = [*family(7), 7, 8, 9]
            async with AsyncCoordinatorClient(target(a)) as via_a:
                route = await via_a.route(tokens, report_end=True)
                assert (route.worker_id, route.end_awaited) == ("x7", True)
                assert a.service.fleet.get("x7") is None  # A never ingested it
                # B holds the reservation: a sibling through B sees it as load on x7.
                held = b.service.fleet.get("x7")
                assert held is not None and held.current_load(0.0).inflight_routes == 1
                ended = await via_a.end_routes([route.route_id, "no-such-route"])
                assert (ended.ended, ended.unknown) == (1, 1)
                assert held.current_load(0.0).inflight_routes == 0
                # Lookups span the shards: both holders of family 0's pages are listed.
                matches = (await via_a.lookup([*family(0), 1])).matches
                assert {"w0", "w6"} <= set(matches)
        finally:
            await bridged.close()


async def test_a_shard_that_cannot_answer_leaves_its_workers_out(redis_url: str) -> None:
    ports = {"a": free_port(), "b": free_port()}  # nothing listens on b's port
    async with running_coordinator(listen=f"127.0.0.1:{ports['a']}", redis=redis_url,
                                   shard="a", peer_shards=f"b=127.0.0.1:{ports['b']}",
                                   bootstrap_timeout_ms=1_000, **STILL) as a:
        worker = ScriptedWorker(target(a), "w0", hash_config=DEV_HASH)
        await worker.start()
        try:
            await worker.store(worker.keys(family(0)))
            async with AsyncCoordinatorClient(target(a)) as client:
                assert (await client.route([*family(0), 1])).worker_id == "w0"
                assert set((await client.lookup([*family(0), 1])).matches) == {"w0"}

            async def counted() -> bool:
                return sum(a.shards.unanswered.values()) >= 2 if a.shards else False
            await eventually(counted, what="the unanswered shard to be counted")
        finally:
            await worker.close()


async def test_a_shard_asks_the_other_with_the_callers_identity_and_tenant(
        redis_url: str, tmp_path: Path) -> None:
    identities = write_identities(tmp_path)
    ports = {"a": free_port(), "b": free_port()}
    async with AsyncExitStack() as stack:
        replicas = {}
        for shard, other in (("a", "b"), ("b", "a")):
            replicas[shard] = await stack.enter_async_context(running_coordinator(
                listen=f"127.0.0.1:{ports[shard]}", redis=redis_url, shard=shard,
                peer_shards=f"{other}=127.0.0.1:{ports[other]}", bootstrap_timeout_ms=1_000,
                auth_file=str(identities.path), **STILL))
        workers = {}
        for name, shard in (("w1", "a"), ("w2", "b")):
            worker = ScriptedWorker(target(replicas[shard]), name, hash_config=DEV_HASH,
                                    token=identities.tokens[name])
            await worker.start()
            stack.push_async_callback(worker.close)
            workers[name] = worker
        # w2, on shard b, caches the prompt as tenant-a's scheduler hashes it.
        keys = workers["w2"].keys(family(2), tenant="tenant-a")
        await workers["w2"].store(keys)
        async with AsyncCoordinatorClient(target(replicas["a"]),
                                          token=identities.tokens["sched-a"]) as sched_a:
            route = await sched_a.route([*family(2), 1])
        # Shard b hashed the prompt under tenant-a (the forwarded identity's), saw the hit
        # and reserved it; without the token it would have refused, leaving only w1.
        assert (route.worker_id, route.matched_pages) == ("w2", len(keys))
        assert sum(replicas["a"].shards.unanswered.values()) == 0


def test_the_shard_flags_refuse_bad_input_at_start_naming_it() -> None:
    for flags, needle in ((["--shard", "a"], "shard needs redis"),
                          (["--peer-shards", "b=h:1"], "peer_shards needs shard"),
                          (["--shard", "A_1", "--redis", "redis://127.0.0.1:1"],
                           "shard must be 1..32 of")):
        done = child_process.run([sys.executable, "-m", "kvcoord.cli", "coordinator", "--listen",
                               "127.0.0.1:0", *flags], capture_output=True, text=True,
                              timeout=60, stdin=subprocess.DEVNULL)
        assert done.returncode == 2, done.stderr[-2000:]
        assert needle in done.stderr


async def test_the_shard_rpcs_refuse_bad_requests_with_a_status_and_reason() -> None:
    async with running_coordinator() as coordinator:
        worker = ScriptedWorker(target(coordinator), "w0", hash_config=DEV_HASH)
        await worker.start()
        channel = grpc.aio.insecure_channel(target(coordinator))
        stub = pb_grpc.CoordinatorStub(channel)
        route = pb.RouteRequest(protocol_version=PROTOCOL_VERSION,
                                prompt=pb.Prompt(token_ids=family(0)))
        try:
            async def refusal(call: Any) -> tuple[grpc.StatusCode, Reason | None]:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call
                outcome = outcome_of(refused.value)
                return outcome.code, outcome.reason

            reserve = pb.ShardReserveRequest(protocol_version=PROTOCOL_VERSION, route=route)
            assert await refusal(stub.ShardReserve(reserve)) == (
                grpc.StatusCode.INVALID_ARGUMENT, None)
            reserve.worker_id = "no-such-worker"
            assert await refusal(stub.ShardReserve(reserve)) == (
                grpc.StatusCode.UNAVAILABLE, Reason.NO_WORKER)
            shortlist = pb.ShardShortlistRequest(protocol_version=PROTOCOL_VERSION, route=route)
            shortlist.route.routing_policy = "fastest"
            assert await refusal(stub.ShardShortlist(shortlist)) == (
                grpc.StatusCode.INVALID_ARGUMENT, None)
            shortlist.route.routing_policy = ""
            shortlist.route.prompt.Clear()
            assert await refusal(stub.ShardShortlist(shortlist)) == (
                grpc.StatusCode.INVALID_ARGUMENT, None)
            shortlist.protocol_version = PROTOCOL_VERSION + 1
            assert await refusal(stub.ShardShortlist(shortlist)) == (
                grpc.StatusCode.FAILED_PRECONDITION, Reason.PROTOCOL_VERSION)
            # A well-formed one is answered: the worker, idle, is this shard's best.
            shortlist.protocol_version = PROTOCOL_VERSION
            shortlist.route.prompt.token_ids.extend(family(0))
            answer = await stub.ShardShortlist(shortlist)
            assert [c.worker_id for c in answer.tied] == ["w0"]
        finally:
            await channel.close()
            await worker.close()
