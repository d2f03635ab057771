"""The worker service in-process with a real runtime (and a real coordinator for its agent):
bad input gets a clear status and the server keeps serving with no page leaked; LoadWeights
changes the version and the outputs; GetStats, health and reflection answer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.client import AsyncCoordinatorClient, KvcoordError
from coordinator.client.outcomes import outcome_of
from coordinator.wire import PROTOCOL_VERSION, Reason
from tests.coordinator_fixtures import eventually, running_coordinator, target
from worker.client import AsyncWorkerClient
from worker.config import WorkerConfig
from worker.main import DRAIN_RETRY_MS, SERVICE_NAME, RunningWorker, start_worker
from worker.v1 import worker_pb2 as wpb
from worker.v1 import worker_pb2_grpc as wpb_grpc

PAGE = 4
PAGES = 16
PROMPT = [5, 9, 13, 17, 21, 25, 29, 33, 37, 41]  # 2 full pages of 4 and a partial one


@pytest.fixture
async def worker() -> AsyncIterator[RunningWorker]:
    async with running_coordinator(page_size=PAGE) as coord:
        config = WorkerConfig(
            coordinator=target(coord), listen="127.0.0.1:0", pages=PAGES, page_size=PAGE,
            device="cpu", worker_id="svc", max_new_tokens=64,
        )
        running = await start_worker(config)
        await asyncio.wait_for(running.agent.synced.wait(), 5)
        yield running
        await running.stop(grace=0.5)


def _addr(worker: RunningWorker) -> str:
    return f"127.0.0.1:{worker.port}"


async def test_generate_reuses_the_prompt_pages_on_the_second_call(worker: RunningWorker) -> None:
    async with AsyncWorkerClient(_addr(worker)) as client:
        first = await client.generate(PROMPT, 3)
        second = await client.generate(PROMPT, 3)
    assert len(first.tokens) == 3 and first.policy_version == 0
    assert (first.cached_tokens, first.computed_tokens) == (0, len(PROMPT))
    assert (second.cached_tokens, second.computed_tokens) == (2 * PAGE, len(PROMPT) - 2 * PAGE)
    assert second.tokens == first.tokens


async def test_generate_at_another_protocol_version_is_told_naming_both(
    worker: RunningWorker,
) -> None:
    async with grpc.aio.insecure_channel(_addr(worker)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await wpb_grpc.WorkerStub(channel).Generate(
                wpb.GenerateRequest(protocol_version=1, token_ids=PROMPT, max_new_tokens=1))
    outcome = outcome_of(refused.value)
    assert (outcome.code, outcome.reason, outcome.metadata) == (
        grpc.StatusCode.FAILED_PRECONDITION, Reason.PROTOCOL_VERSION,
        {"peer_version": "1", "server_version": str(PROTOCOL_VERSION)})


async def test_generate_while_draining_is_told_draining_with_a_retry_delay(
    worker: RunningWorker,
) -> None:
    worker.gate.close()  # what a DRAIN command does
    async with grpc.aio.insecure_channel(_addr(worker)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await wpb_grpc.WorkerStub(channel).Generate(
                wpb.GenerateRequest(token_ids=PROMPT, max_new_tokens=1))
    worker.gate.open()
    outcome = outcome_of(refused.value)
    assert (outcome.code, outcome.reason, outcome.retry_after_ms) == (
        grpc.StatusCode.UNAVAILABLE, Reason.DRAINING, DRAIN_RETRY_MS)


BAD_GENERATES = [
    (wpb.GenerateRequest(token_ids=[1, 2, 512], max_new_tokens=1),
     grpc.StatusCode.INVALID_ARGUMENT, "token id 512 at position 2 is outside the vocabulary"),
    (wpb.GenerateRequest(token_ids=[1, 2], max_new_tokens=65),
     grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens must be 1..64, got 65"),
    (wpb.GenerateRequest(token_ids=[1, 2], max_new_tokens=0),
     grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens must be 1..64, got 0"),
    (wpb.GenerateRequest(max_new_tokens=1), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
    (wpb.GenerateRequest(token_ids=[1], token_bytes=b"\x01\x00\x00\x00", max_new_tokens=1),
     grpc.StatusCode.INVALID_ARGUMENT, "not both"),
    (wpb.GenerateRequest(token_bytes=b"\x01\x00\x00", max_new_tokens=1),
     grpc.StatusCode.INVALID_ARGUMENT, "3 bytes of token_bytes is not a multiple of 4"),
    (wpb.GenerateRequest(token_bytes=bytes(4 * 5000), max_new_tokens=1),
     grpc.StatusCode.INVALID_ARGUMENT, "prompt of 5000 tokens exceeds the model context of 4096"),
    (wpb.GenerateRequest(protocol_version=9, token_ids=[1], max_new_tokens=1),
     grpc.StatusCode.FAILED_PRECONDITION, "protocol version 9"),
    # 16 pages of 4 tokens hold 64 positions; this request needs 61 + 10 - 1 = 70.
    (wpb.GenerateRequest(token_ids=[3] * 61, max_new_tokens=10),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "request needs 18 pages"),
]


@pytest.mark.parametrize(("request_pb", "code", "message"), BAD_GENERATES)
async def test_bad_generate_is_refused_and_the_server_keeps_serving(
    worker: RunningWorker, request_pb: wpb.GenerateRequest, code: grpc.StatusCode, message: str,
) -> None:
    async with grpc.aio.insecure_channel(_addr(worker)) as channel:
        stub = wpb_grpc.WorkerStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Generate(request_pb)
        assert caught.value.code() == code
        assert message in (caught.value.details() or "")
        ok = await stub.Generate(wpb.GenerateRequest(token_ids=PROMPT, max_new_tokens=2))
    assert len(ok.tokens) == 2
    await asyncio.to_thread(worker.runtime.check_integrity)


async def test_client_validates_before_sending_and_maps_refusals(worker: RunningWorker) -> None:
    async with AsyncWorkerClient(_addr(worker)) as client:
        for tokens, count in (([], 1), ([-1], 1), ([1], 0), ("abc", 1)):
            with pytest.raises(ValueError):
                await client.generate(tokens, count)  # type: ignore[arg-type]
        with pytest.raises(KvcoordError) as caught:
            await client.generate([3] * 61, 10)
        assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_more_concurrent_requests_than_pages_queue_and_all_finish(
    worker: RunningWorker,
) -> None:
    prompts = [[(i * 31 + j) % 512 for j in range(40)] for i in range(12)]  # 10+ pages each
    async with AsyncWorkerClient(_addr(worker)) as client:
        results = await asyncio.gather(*(client.generate(p, 5) for p in prompts))
        stats = await client.stats()
    assert [len(r.tokens) for r in results] == [5] * 12
    assert stats.generated_requests == 12 and stats.running_requests == 0
    await asyncio.to_thread(worker.runtime.check_integrity)


async def test_load_weights_changes_version_and_outputs_and_drops_cached_pages(
    worker: RunningWorker,
) -> None:
    async with AsyncWorkerClient(_addr(worker)) as client:
        v0 = await client.generate(PROMPT, 4)
        loaded = await client.load_weights(1)
        v1 = await client.generate(PROMPT, 4)
        assert loaded.policy_version == 1 and loaded.freed_pages > 0
        assert v1.policy_version == 1 and v1.cached_tokens == 0
        assert v1.tokens != v0.tokens
        assert (await client.load_weights(0)).policy_version == 0
        back = await client.generate(PROMPT, 4)
        assert (back.tokens, back.policy_version) == (v0.tokens, 0)
        with pytest.raises(KvcoordError) as caught:
            await client.load_weights(2, "/nonexistent/weights.safetensors")
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert (await client.stats()).policy_version == 0


async def test_stats_health_and_the_coordinator_index_follow_generation(
    worker: RunningWorker,
) -> None:
    async with AsyncWorkerClient(_addr(worker)) as client:
        await client.generate(PROMPT, 2)
        stats = await client.stats()
    assert (stats.worker_id, stats.total_pages, stats.page_size) == ("svc", PAGES, PAGE)
    assert (stats.generated_requests, stats.generated_tokens) == (1, 2)
    assert stats.synced and stats.incarnation >= 1 and stats.device == "cpu"
    assert stats.free_pages + stats.cached_pages == PAGES
    async with AsyncCoordinatorClient(worker.config.coordinator) as coordinator:
        async def indexed() -> bool:
            return (await coordinator.lookup(PROMPT)).matches == {"svc": 2 * PAGE}

        await eventually(indexed, what="the worker's pages in Lookup")
    async with grpc.aio.insecure_channel(_addr(worker)) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_finished_generation_is_reported_long_before_the_next_heartbeat() -> None:
    # Heartbeats every 5 s: only the completion-triggered report can settle the route in time.
    async with running_coordinator(page_size=PAGE, heartbeat_ms=5000, lease_ms=20000) as coord:
        workers = []
        for name in ("a", "b"):
            config = WorkerConfig(coordinator=target(coord), listen="127.0.0.1:0", pages=64,
                                  page_size=PAGE, device="cpu", worker_id=name, max_new_tokens=8)
            workers.append(await start_worker(config))
        for w in workers:
            await asyncio.wait_for(w.agent.synced.wait(), 5)
        async with AsyncCoordinatorClient(target(coord)) as client:
            turn = [11, 12, 13, 14, 15, 16, 17, 18, 19]
            route = await client.route(turn)
            answer = await AsyncWorkerClient(route.address).generate(turn, 4)

            async def settled() -> bool:
                infos = {w.worker_id: w.inflight_routes for w in await client.workers()}
                return infos[route.worker_id] == 0

            await eventually(settled, timeout=1.0, what="the finished route to be reported")
            next_turn = turn + answer.tokens + [21, 22, 23, 24]
            follow_up = await client.route(next_turn)
            assert follow_up.worker_id == route.worker_id
            assert follow_up.matched_tokens >= 2 * PAGE
        for w in workers:
            await w.stop(grace=0.5)
