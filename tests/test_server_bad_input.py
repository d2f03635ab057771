"""Hostile and malformed requests get a clear status, and the server keeps serving afterwards."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from bench.scripted_worker import ScriptedWorker
from coordinator.client import AsyncCoordinatorClient, CoordinatorClient, PageKeys
from coordinator.server.main import RunningCoordinator
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from tests.coordinator_fixtures import DEV_HASH, running_coordinator, target

LIMITS = {"max_prompt_tokens": 1024, "max_batch_prompts": 8, "max_message_bytes": 64 * 1024}


@pytest.fixture
async def coord() -> AsyncIterator[RunningCoordinator]:
    async with running_coordinator(**LIMITS) as running:
        worker = ScriptedWorker(target(running), "w", hash_config=DEV_HASH)
        await worker.start()
        yield running
        await worker.close()


def _prompt(**fields: object) -> pb.Prompt:
    return pb.Prompt(**fields)  # type: ignore[arg-type]


BAD_ROUTES = [
    (pb.RouteRequest(prompt=_prompt()), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    (pb.RouteRequest(), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    (pb.RouteRequest(prompt=_prompt(token_ids=range(1025))), grpc.StatusCode.INVALID_ARGUMENT,
     "1025 tokens is over the limit of 1024"),
    (pb.RouteRequest(prompt=_prompt(page_keys=b"x" * 17)), grpc.StatusCode.INVALID_ARGUMENT,
     "not a multiple of 16"),
    (pb.RouteRequest(prompt=_prompt(token_ids=[1], page_keys=b"x" * 16)),
     grpc.StatusCode.INVALID_ARGUMENT, "not both"),
    (pb.RouteRequest(prompt=_prompt(token_bytes=b"\x01\x00\x00\x00", page_keys=b"x" * 16)),
     grpc.StatusCode.INVALID_ARGUMENT, "not both"),
    (pb.RouteRequest(prompt=_prompt(token_ids=[1, 2], token_count=2)),
     grpc.StatusCode.INVALID_ARGUMENT, "token_count is only for prompts sent as page_keys"),
    (pb.RouteRequest(prompt=_prompt(token_bytes=b"\x01\x00\x00")),
     grpc.StatusCode.INVALID_ARGUMENT, "3 bytes of token_bytes is not a multiple of 4"),
    (pb.RouteRequest(prompt=_prompt(token_bytes=b"\x00" * 4 * 1025)),
     grpc.StatusCode.INVALID_ARGUMENT, "1025 tokens is over the limit of 1024"),
    (pb.RouteRequest(prompt=_prompt(page_keys=b"x" * 32, token_count=5)),
     grpc.StatusCode.INVALID_ARGUMENT, "does not fit"),
    (pb.RouteRequest(prompt=_prompt(token_ids=[1, 2]), scope=pb.Scope(cache_salt="s" * 1025)),
     grpc.StatusCode.INVALID_ARGUMENT, "scope.cache_salt: 1025 characters is over the limit"),
    (pb.RouteRequest(prompt=_prompt(token_ids=[1, 2]), routing_policy="nope"),
     grpc.StatusCode.INVALID_ARGUMENT, "unknown routing policy"),
    (pb.RouteRequest(protocol_version=99, prompt=_prompt(token_ids=[1])),
     grpc.StatusCode.FAILED_PRECONDITION, "protocol version 99"),
    (pb.RouteRequest(prompt=_prompt(token_ids=range(100_000, 140_000))),
     grpc.StatusCode.RESOURCE_EXHAUSTED, ""),  # over the 64 KiB message limit
]


@pytest.mark.parametrize(("request_", "code", "needle"), BAD_ROUTES)
async def test_bad_route_is_refused_with_a_message_and_server_keeps_serving(
    coord: RunningCoordinator, request_: pb.RouteRequest, code: grpc.StatusCode, needle: str
) -> None:
    async with grpc.aio.insecure_channel(target(coord)) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Route(request_)
        assert err.value.code() == code
        assert needle in (err.value.details() or "")
        ok = await stub.Route(pb.RouteRequest(prompt=_prompt(token_ids=range(64))))
        assert ok.worker_id == "w"


async def test_batch_over_the_limit_and_a_bad_member_are_refused(
    coord: RunningCoordinator,
) -> None:
    async with grpc.aio.insecure_channel(target(coord)) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        good = _prompt(token_ids=range(32))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.RouteBatch(pb.RouteBatchRequest(prompts=[good] * 9))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "9 prompts is over the limit of 8" in (err.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.RouteBatch(pb.RouteBatchRequest(prompts=[good, _prompt()]))
        assert "prompts[1] is empty" in (err.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.RouteBatch(pb.RouteBatchRequest())
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len((await stub.RouteBatch(pb.RouteBatchRequest(prompts=[good] * 8))).routes) == 8


async def test_bad_sync_messages_end_the_stream_with_a_clear_status(
    coord: RunningCoordinator,
) -> None:
    w = ScriptedWorker(target(coord), "bad", hash_config=DEV_HASH)
    await w.start()
    await w.send(pb.SyncRequest(events=pb.EventBatch(seq=1, events=[
        pb.PageEvent(kind=pb.PageEvent.KIND_STORED, page_keys=b"y" * 20)
    ])))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await w.next_message()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a multiple of 16" in (err.value.details() or "")
    await w.connect()
    await w.send(pb.SyncRequest())
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await w.next_message()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await w.close()


async def test_sdk_validates_before_sending(coord: RunningCoordinator) -> None:
    # The blocking client runs in a thread: the server lives on this test's event loop.
    await asyncio.to_thread(_check_sdk_validation, target(coord))


def _check_sdk_validation(address: str) -> None:
    with CoordinatorClient(address) as client:
        with pytest.raises(ValueError, match="empty prompt"):
            client.route([])
        with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
            client.route([1, 2**32])
        with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
            client.lookup([-1])
        with pytest.raises(ValueError, match="multiple of 16"):
            PageKeys(b"z" * 15)
        with pytest.raises(ValueError, match="HOST:PORT"):
            CoordinatorClient("nohostport")
        assert client.route(list(range(40))).worker_id == "w"


async def test_page_keys_prompt_matches_token_prompt(coord: RunningCoordinator) -> None:
    w = ScriptedWorker(target(coord), "keys", hash_config=DEV_HASH)
    await w.start()
    tokens = list(range(7, 7 + 64))
    keys = w.keys(tokens)
    await w.store(keys)
    async with AsyncCoordinatorClient(target(coord)) as client:
        by_tokens = await client.lookup(tokens)
        by_keys = await client.lookup(PageKeys(b"".join(keys), token_count=64))
    assert by_tokens.matches == by_keys.matches == {"keys": 64}
    await w.close()


async def test_health_serves_and_reflection_lists_the_service(coord: RunningCoordinator) -> None:
    async with grpc.aio.insecure_channel(target(coord)) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "coordinator.v1.Coordinator"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = set()
        async for response in call:
            names = {s.name for s in response.list_services_response.service}
            break
        assert "coordinator.v1.Coordinator" in names


async def test_bad_policy_requests_are_refused_with_a_clear_status(
    coord: RunningCoordinator,
) -> None:
    async with AsyncCoordinatorClient(target(coord)) as client:
        state = await client.policy()
        assert (state.version, state.phase) == (0, "serving")
    async with grpc.aio.insecure_channel(target(coord)) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        cases = [
            (stub.BeginPolicyUpdate(pb.BeginPolicyUpdateRequest(expected_version=3)),
             grpc.StatusCode.ABORTED, "stale expected_version"),
            (stub.CommitPolicyUpdate(pb.CommitPolicyUpdateRequest(version=1)),
             grpc.StatusCode.ABORTED, ""),
            (stub.AbortPolicyUpdate(pb.AbortPolicyUpdateRequest(version=1)),
             grpc.StatusCode.ABORTED, ""),
            (stub.ReportRollouts(pb.ReportRolloutsRequest(records=[
                pb.RolloutRecord(rollout_id="r", worker_id="nobody", prompt_tokens=1)])),
             grpc.StatusCode.FAILED_PRECONDITION, "unknown worker"),
        ]
        for call, code, needle in cases:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == code
            assert needle in (err.value.details() or "")
        assert (await stub.GetPolicy(pb.GetPolicyRequest())).version == 0
