"""What the fuzzing campaign found, pinned: status details are bounded, a batch's tokens are
capped before conversion, a worker cannot grow the index past 4x its pages, and a Sync message
that does not parse is the caller's error, not ours."""

from __future__ import annotations

import grpc
import pytest

from bench.scripted_worker import ScriptedWorker
from coordinator.client.outcomes import outcome_of
from coordinator.rpc.interceptor import MAX_DETAILS_CHARS
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from coordinator.wire import Reason
from tests.coordinator_fixtures import DEV_HASH, running_coordinator, target

SYNC = "/coordinator.v1.Coordinator/Sync"


async def test_status_details_are_cut_to_a_bound_and_control_characters_escaped() -> None:
    async with running_coordinator() as coord, grpc.aio.insecure_channel(target(coord)) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        prompt = pb.Prompt(token_ids=[1] * 16)
        with pytest.raises(grpc.aio.AioRpcError) as long:
            await stub.Route(pb.RouteRequest(prompt=prompt, routing_policy="x" * 70_000))
        assert long.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # not a lost trailer
        details = long.value.details() or ""
        assert "unknown routing policy" in details
        assert len(details) <= MAX_DETAILS_CHARS + 40 and "more characters)" in details
        with pytest.raises(grpc.aio.AioRpcError) as control:
            await stub.Route(pb.RouteRequest(prompt=prompt, routing_policy="a\nb\x00"))
        assert "a\\nb\\x00" in (control.value.details() or "")


async def test_a_batch_over_the_token_limit_is_refused() -> None:
    async with (
        running_coordinator(max_batch_tokens=100) as coord,
        grpc.aio.insecure_channel(target(coord)) as channel,
    ):
        stub = pb_grpc.CoordinatorStub(channel)
        batch = pb.RouteBatchRequest(prompts=[pb.Prompt(token_ids=[1] * 64),
                                              pb.Prompt(token_bytes=bytes(4 * 64))])
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.RouteBatch(batch)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "batch of 128 tokens is over the limit of 100" in (refused.value.details() or "")


async def test_a_worker_cannot_index_more_than_4x_its_pages() -> None:
    async with running_coordinator() as coord:
        worker = ScriptedWorker(target(coord), "w", hash_config=DEV_HASH, total_pages=2)
        await worker.start()
        await worker.store(worker.keys(list(range(8 * 16))))  # 8 pages: 4x its 2
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await worker.store(worker.keys(list(range(1000, 1016))))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        refusal = outcome_of(refused.value)
        assert (refusal.reason, refusal.metadata) == (Reason.PAGE_CAP, {"limit": "8"})
        assert "4x its 2 device and 0 host pages" in (refused.value.details() or "")
        assert coord.service.index.held_count("w") == 8
        await worker.close()


async def test_a_sync_message_that_does_not_parse_is_invalid_argument() -> None:
    async with running_coordinator() as coord, grpc.aio.insecure_channel(target(coord)) as channel:
        call = channel.stream_stream(SYNC)()  # raw bytes both ways
        await call.write(b"\xff\xff\xff")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call.read()
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "Error parsing message" in (refused.value.details() or "")
        policy = await pb_grpc.CoordinatorStub(channel).GetPolicy(pb.GetPolicyRequest())
        assert policy.version == 0  # and the server keeps serving
