"""Tenant isolation in Lookup/Route, and the per-identity limits: a rate-limited flood, stream
slots, and a paced (not torn down) Sync stream."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from bench.scripted_worker import ScriptedWorker
from coordinator.client.outcomes import outcome_of
from coordinator.server.main import RunningCoordinator
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from coordinator.wire import Reason
from tests.auth_fixtures import IdentityFile
from tests.coordinator_fixtures import DEV_HASH, running_coordinator, target

PROMPT = list(range(1000, 1064))  # 4 pages of 16


def _smuggled_scope(tenant: str) -> pb.Scope:
    """A scope naming ``tenant`` every way a client could: as the adapter, and as an unknown
    field (number 15) appended to the wire bytes."""
    data = tenant.encode()
    wire = pb.Scope(adapter=tenant).SerializeToString() + bytes([15 << 3 | 2, len(data)]) + data
    return pb.Scope.FromString(wire)


async def test_tenant_b_gets_no_hit_on_tenant_a_prompt(
    auth_coordinator: RunningCoordinator, identities: IdentityFile,
) -> None:
    worker = ScriptedWorker(target(auth_coordinator), "w1", hash_config=DEV_HASH,
                            token=identities.tokens["w1"])
    await worker.start()
    await worker.store(worker.keys(PROMPT, tenant="tenant-a"))  # tenant A's prompt, served
    async with grpc.aio.insecure_channel(target(auth_coordinator)) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        prompt = pb.Prompt(token_ids=PROMPT)

        async def lookup(who: str, scope: pb.Scope | None = None) -> dict[str, int]:
            reply = await stub.Lookup(pb.LookupRequest(prompt=prompt, scope=scope),
                                      metadata=identities.metadata(who))
            return {m.worker_id: m.matched_tokens for m in reply.matches}

        assert await lookup("sched-a") == {"w1": 64}
        assert await lookup("sched-b") == {}
        assert await lookup("sched-b", _smuggled_scope("tenant-a")) == {}
        assert await lookup("admin") == {}  # the admin's tenant is the default one
        route = await stub.Route(pb.RouteRequest(prompt=prompt, scope=_smuggled_scope("tenant-a")),
                                 metadata=identities.metadata("sched-b"))
        assert (route.worker_id, route.matched_tokens) == ("w1", 0)
        route = await stub.Route(pb.RouteRequest(prompt=prompt),
                                 metadata=identities.metadata("sched-a"))
        assert route.matched_tokens == 64
        # B's own copy of the same tokens is B's alone.
        await worker.store(worker.keys(PROMPT, tenant="tenant-b"))
        assert await lookup("sched-b") == {"w1": 64}
        # A's route left pending entries under A's keys only: B's routed depth is its own.
        stats = auth_coordinator.service.stats()
        assert stats.index_keys == 8
    await worker.close()


async def test_a_flood_from_one_identity_is_throttled_while_another_is_served(
    identities: IdentityFile,
) -> None:
    rate, burst, flood = 20.0, 20, 200
    async with (
        running_coordinator(auth_file=str(identities.path), rate_limit_per_s=rate,
                            rate_limit_burst=burst) as running,
        grpc.aio.insecure_channel(target(running)) as channel,
    ):
        stub = pb_grpc.CoordinatorStub(channel)
        started = time.monotonic()

        async def call(who: str) -> grpc.aio.AioRpcError | None:
            try:
                await stub.GetPolicy(pb.GetPolicyRequest(), metadata=identities.metadata(who))
            except grpc.aio.AioRpcError as exc:
                return exc
            return None

        results = await asyncio.gather(*[call("sched-a") for _ in range(flood)],
                                       *[call("sched-b") for _ in range(5)])
        elapsed = time.monotonic() - started
    flooded, other = results[:flood], results[flood:]
    assert other == [None] * 5  # the other identity was served throughout
    served = sum(r is None for r in flooded)
    refused = [r for r in flooded if r is not None]
    assert burst <= served <= burst + rate * elapsed + 1
    assert all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused)
    outcome = outcome_of(refused[0])
    assert outcome.reason is Reason.RATE_LIMITED
    assert outcome.retry_after_ms is not None and 0 < outcome.retry_after_ms <= 1000 / rate + 1
    assert "rate limit" in outcome.message


async def test_open_streams_per_identity_are_limited(identities: IdentityFile) -> None:
    async with (
        running_coordinator(auth_file=str(identities.path), max_streams_per_identity=2) as running,
        grpc.aio.insecure_channel(target(running)) as channel,
    ):
        stub = pb_grpc.CoordinatorStub(channel)
        trainer = identities.metadata("trainer")
        watches = [stub.WatchPolicy(pb.WatchPolicyRequest(), metadata=trainer)
                   for _ in range(2)]
        for watch in watches:
            await watch.read()  # open and counted
        third = stub.WatchPolicy(pb.WatchPolicyRequest(), metadata=trainer)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await third.read()
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        outcome = outcome_of(refused.value)
        assert (outcome.reason, outcome.retry_after_ms) == (Reason.STREAM_LIMIT, None)
        other = stub.WatchPolicy(pb.WatchPolicyRequest(), metadata=identities.metadata("admin"))
        await other.read()  # another identity's slots are its own
        watches[0].cancel()
        deadline = time.monotonic() + 5
        while True:  # the slot comes back once the server has seen the cancel
            again = stub.WatchPolicy(pb.WatchPolicyRequest(), metadata=trainer)
            try:
                await again.read()
                break
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert time.monotonic() < deadline, "the cancelled stream's slot never freed"
                await asyncio.sleep(0.05)
        for call in (watches[1], other, again):
            call.cancel()


async def test_a_fast_sync_stream_is_paced_not_torn_down(identities: IdentityFile) -> None:
    rate, burst, batches = 20.0, 5, 30
    async with running_coordinator(auth_file=str(identities.path), rate_limit_per_s=rate,
                                   rate_limit_burst=burst) as running:
        worker = ScriptedWorker(target(running), "w1", hash_config=DEV_HASH,
                                token=identities.tokens["w1"])
        await worker.register()  # one token
        started = time.monotonic()
        await worker.connect()  # the hello: one more
        for i in range(batches):
            await worker.store(worker.keys([i] * 16))
        elapsed = time.monotonic() - started
        assert running.service.index.held_count("w1") == batches
        assert worker.stream_error is None
        # 31 stream messages from a bucket of 4 left: at least (31 - 4) / rate seconds.
        assert elapsed >= (batches + 1 - (burst - 1)) / rate - 0.05
        await worker.close()


async def test_the_sdk_waits_out_the_rate_limit_within_its_deadline(
    identities: IdentityFile,
) -> None:
    from coordinator.client import AsyncCoordinatorClient, KvcoordError

    rate = 10.0
    async with running_coordinator(auth_file=str(identities.path), rate_limit_per_s=rate,
                                   rate_limit_burst=1) as running:
        token = identities.tokens["sched-a"]
        async with AsyncCoordinatorClient(target(running), token=token) as patient:
            started = time.monotonic()
            for _ in range(3):  # the first from the burst, then one per 1/rate
                assert (await patient.policy()).version == 0
            assert time.monotonic() - started >= 2 / rate - 0.02
        async with AsyncCoordinatorClient(target(running), token=token,
                                          timeout=0.05) as hurried:
            await asyncio.sleep(1 / rate)  # a token is back
            await hurried.policy()
            with pytest.raises(KvcoordError) as refused:  # the next is 100 ms away: past 50
                await hurried.policy()
            assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
