"""Typed outcomes (issue 15 §2): each way a real coordinator ends a Sync stream or refuses a call
is decoded by ``outcome_of`` as exactly one ``Reason`` of domain ``kvcoord``, with ``RetryInfo``
where a retry may succeed; protocol versions other than the server's are told, not misread."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from bench.scripted_worker import ScriptedWorker
from coordinator.client import AsyncCoordinatorClient, KvcoordError
from coordinator.client.outcomes import Outcome, outcome_of
from coordinator.core.hashing import HashConfig
from coordinator.server.main import RunningCoordinator
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from coordinator.wire import ERROR_DOMAIN, PROTOCOL_VERSION, Reason
from tests.coordinator_fixtures import DEV_HASH, running_coordinator, target

PROMPT = list(range(64))  # 4 full pages


async def stream_end(worker: ScriptedWorker) -> Outcome:
    """How the coordinator ended ``worker``'s Sync stream (messages before the end skipped)."""
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        while True:
            await worker.next_message()
    return outcome_of(ended.value)


async def refusal(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    """The error a raw stub call ended with."""
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call
    return refused.value


def route_request(version: int = 0) -> pb.RouteRequest:
    return pb.RouteRequest(protocol_version=version, prompt=pb.Prompt(token_ids=PROMPT))


# ------------------------------------------------------------------------ the Sync stream


async def test_a_hello_under_a_stale_or_unknown_incarnation_is_told_to_register_again() -> None:
    async with running_coordinator() as coord:
        w = ScriptedWorker(target(coord), "w", hash_config=DEV_HASH)
        first = await w.register()
        await w.register()
        w.incarnation = first.incarnation
        with pytest.raises(grpc.aio.AioRpcError) as stale:
            await w.connect()
        w.worker_id = "never-registered"
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await w.connect()
        await w.close()
    for error in (stale.value, unknown.value):
        outcome = outcome_of(error)
        assert (outcome.code, outcome.reason, outcome.retry_after_ms) == (
            grpc.StatusCode.FAILED_PRECONDITION, Reason.REREGISTER, None)


async def test_a_re_registration_ends_the_old_incarnations_stream_with_reregister() -> None:
    async with running_coordinator() as coord:
        w = ScriptedWorker(target(coord), "w", hash_config=DEV_HASH)
        await w.start()
        again = ScriptedWorker(target(coord), "w", hash_config=DEV_HASH)
        await again.register()
        outcome = await stream_end(w)
        assert (outcome.code, outcome.reason) == (
            grpc.StatusCode.FAILED_PRECONDITION, Reason.REREGISTER)
        await w.close()
        await again.close()


async def test_deregister_ends_the_stream_as_final() -> None:
    async with running_coordinator() as coord, grpc.aio.insecure_channel(target(coord)) as ch:
        w = ScriptedWorker(target(coord), "w", hash_config=DEV_HASH)
        await w.start()
        await pb_grpc.CoordinatorStub(ch).Deregister(
            pb.DeregisterRequest(worker_id="w", incarnation=w.incarnation))
        outcome = await stream_end(w)
        assert (outcome.code, outcome.reason) == (
            grpc.StatusCode.FAILED_PRECONDITION, Reason.DEREGISTERED)
        await w.close()


async def test_a_second_stream_of_the_same_worker_supersedes_the_first() -> None:
    async with running_coordinator() as coord:
        first = ScriptedWorker(target(coord), "w", hash_config=DEV_HASH)
        await first.start()
        second = ScriptedWorker(target(coord), "w", hash_config=DEV_HASH)
        second.incarnation = first.incarnation
        second._channel = grpc.aio.insecure_channel(target(coord))
        assert (await second.connect()).WhichOneof("body") == "welcome"
        outcome = await stream_end(first)
        assert (outcome.code, outcome.reason) == (
            grpc.StatusCode.FAILED_PRECONDITION, Reason.SUPERSEDED)
        await second.heartbeat()  # the newer stream carries on
        await first.close()
        await second.close()


async def test_a_worker_silent_past_its_lease_is_told_to_reconnect_and_may() -> None:
    async with running_coordinator(lease_ms=300, heartbeat_ms=100) as coord:
        w = ScriptedWorker(target(coord), "w", hash_config=DEV_HASH)
        await w.start()
        await w.store(w.keys(PROMPT))
        outcome = await stream_end(w)  # no heartbeat: the reaper ends the stream
        assert (outcome.code, outcome.reason) == (
            grpc.StatusCode.FAILED_PRECONDITION, Reason.LEASE_LAPSED)
        # Within drop_grace_ms the same incarnation is welcome, its pages still indexed.
        assert (await w.connect()).welcome.next_seq == 2
        assert coord.service.index.held_count("w") == 4
        await w.close()


async def test_a_worker_that_misses_the_barrier_is_fenced() -> None:
    async with running_coordinator() as coord, AsyncCoordinatorClient(target(coord)) as client:
        w = ScriptedWorker(target(coord), "w", hash_config=DEV_HASH)
        await w.start()
        await client.begin_policy_update(0)
        drain = await w.next_message()
        assert drain.command.kind == pb.PolicyCommand.KIND_DRAIN  # and never acked
        state = await client.commit_policy_update(1, timeout=0.2)
        assert state.fenced_workers == ("w",)
        outcome = await stream_end(w)
        assert (outcome.code, outcome.reason) == (
            grpc.StatusCode.FAILED_PRECONDITION, Reason.FENCED)
        await w.close()


async def test_a_batch_over_the_page_cap_is_refused_with_page_cap_and_its_limit() -> None:
    async with running_coordinator(max_pages_per_worker=4) as coord:
        w = ScriptedWorker(target(coord), "w", hash_config=DEV_HASH)
        await w.start()
        await w.send_events([pb.PageEvent(kind=pb.PageEvent.KIND_STORED,
                                          page_keys=b"".join(w.keys(list(range(80)))))])
        outcome = await stream_end(w)
        assert outcome == Outcome(grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.PAGE_CAP, None,
                                  outcome.message, {"limit": "4"})
        await w.close()


async def test_a_hello_at_another_protocol_version_ends_the_stream_naming_both() -> None:
    async with running_coordinator() as coord, grpc.aio.insecure_channel(target(coord)) as ch:
        w = ScriptedWorker(target(coord), "w", hash_config=DEV_HASH)
        await w.register()
        call = pb_grpc.CoordinatorStub(ch).Sync()
        await call.write(pb.SyncRequest(protocol_version=1, hello=pb.SyncHello(
            worker_id="w", incarnation=w.incarnation)))
        outcome = outcome_of(await refusal(call.read()))
        assert (outcome.code, outcome.reason) == (
            grpc.StatusCode.FAILED_PRECONDITION, Reason.PROTOCOL_VERSION)
        assert outcome.metadata == {"peer_version": "1", "server_version": "2"}
        await w.close()


# ------------------------------------------------------------------------ unary refusals


async def drain_started(
    coord: RunningCoordinator, client: AsyncCoordinatorClient
) -> ScriptedWorker:
    """A sync update begun over one scripted worker (returned) that never acks its DRAIN."""
    w = ScriptedWorker(target(coord), "w", hash_config=DEV_HASH)
    await w.start()
    await w.store(w.keys(PROMPT))
    await client.begin_policy_update(0)
    return w


async def test_a_route_during_a_sync_drain_is_told_draining_with_the_configured_delay() -> None:
    async with (
        running_coordinator(route_wait_ms=20, route_retry_ms=321) as coord,
        AsyncCoordinatorClient(target(coord)) as trainer,
        AsyncCoordinatorClient(target(coord), timeout=0.2) as client,
        grpc.aio.insecure_channel(target(coord)) as ch,
    ):
        w = await drain_started(coord, trainer)
        outcome = outcome_of(await refusal(pb_grpc.CoordinatorStub(ch).Route(route_request())))
        assert (outcome.code, outcome.reason, outcome.retry_after_ms, outcome.metadata) == (
            grpc.StatusCode.UNAVAILABLE, Reason.DRAINING, 321, {"target_version": "1"})
        # The SDK reads the same: 321 ms is past its 0.2 s deadline, so it gives up at once.
        with pytest.raises(KvcoordError) as refused:
            await client.route(PROMPT)
        assert (refused.value.code, refused.value.reason, refused.value.retry_after_ms) == (
            grpc.StatusCode.UNAVAILABLE, Reason.DRAINING, 321)
        await w.close()


async def test_a_route_with_no_routable_worker_is_told_no_worker() -> None:
    async with running_coordinator() as coord, grpc.aio.insecure_channel(target(coord)) as ch:
        error = await refusal(pb_grpc.CoordinatorStub(ch).Route(route_request()))
    outcome = outcome_of(error)
    assert (outcome.code, outcome.reason, outcome.retry_after_ms) == (
        grpc.StatusCode.UNAVAILABLE, Reason.NO_WORKER, 500)


async def test_register_with_another_hash_key_is_told_hash_config() -> None:
    async with running_coordinator() as coord:
        w = ScriptedWorker(target(coord), "w", hash_config=HashConfig(key=b"k" * 32))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await w.register()
        await w.close()
    outcome = outcome_of(refused.value)
    assert (outcome.code, outcome.reason) == (
        grpc.StatusCode.FAILED_PRECONDITION, Reason.HASH_CONFIG)


async def test_rollouts_of_an_unknown_worker_are_told_to_register_again() -> None:
    async with running_coordinator() as coord, grpc.aio.insecure_channel(target(coord)) as ch:
        report = pb.ReportRolloutsRequest(records=[pb.RolloutRecord(
            rollout_id="r1", worker_id="ghost", prompt_tokens=4, completion_tokens=1)])
        error = await refusal(pb_grpc.CoordinatorStub(ch).ReportRollouts(report))
    outcome = outcome_of(error)
    assert (outcome.code, outcome.reason) == (
        grpc.StatusCode.FAILED_PRECONDITION, Reason.REREGISTER)


async def test_begin_right_after_a_restore_is_told_policy_restored_with_the_wait() -> None:
    lease_ms = 2_000
    async with running_coordinator(lease_ms=lease_ms) as coord, \
            AsyncCoordinatorClient(target(coord)) as client:
        # A worker holding version 3 of a fresh coordinator: the store forgot it, and is
        # restored to it.
        w = ScriptedWorker(target(coord), "w", hash_config=DEV_HASH, policy_version=3)
        await w.register()
        with pytest.raises(KvcoordError) as refused:
            await client.begin_policy_update(3)
        await w.close()
    error = refused.value
    assert (error.code, error.reason) == (
        grpc.StatusCode.FAILED_PRECONDITION, Reason.POLICY_RESTORED)
    assert error.retry_after_ms is not None and 0 < error.retry_after_ms <= lease_ms


@pytest.mark.parametrize(("version", "relation"), [(1, "older"), (99, "newer")])
async def test_a_request_at_another_protocol_version_is_told_naming_both(
    version: int, relation: str,
) -> None:
    async with running_coordinator() as coord, grpc.aio.insecure_channel(target(coord)) as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        error = await refusal(stub.Route(route_request(version)))
        # 0 (unset) and the current version are read as the current one.
        for current in (0, PROTOCOL_VERSION):
            await stub.GetPolicy(pb.GetPolicyRequest(protocol_version=current))
    outcome = outcome_of(error)
    assert (outcome.code, outcome.reason, outcome.retry_after_ms) == (
        grpc.StatusCode.FAILED_PRECONDITION, Reason.PROTOCOL_VERSION, None)
    assert outcome.metadata == {"peer_version": str(version), "server_version": "2"}
    assert (f"protocol version {version} is {relation} than this server's {PROTOCOL_VERSION}"
            in outcome.message)


# ------------------------------------------------------------------------ the encoding


async def test_reasons_travel_as_google_rpc_status_details_not_a_home_made_trailer() -> None:
    async with running_coordinator(route_retry_ms=250, route_wait_ms=20) as coord, \
            AsyncCoordinatorClient(target(coord)) as trainer, \
            grpc.aio.insecure_channel(target(coord)) as ch:
        w = await drain_started(coord, trainer)
        error = await refusal(pb_grpc.CoordinatorStub(ch).Route(route_request()))
        await w.close()
    trailers = dict(error.trailing_metadata() or ())
    assert "retry-after-ms" not in trailers
    status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
    assert (status.code, status.message) == (grpc.StatusCode.UNAVAILABLE.value[0],
                                             error.details())
    info, retry = error_details_pb2.ErrorInfo(), error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info) and status.details[1].Unpack(retry)
    assert (info.domain, info.reason) == (ERROR_DOMAIN, "DRAINING") == ("kvcoord", "DRAINING")
    assert retry.retry_delay.ToMilliseconds() == 250


async def test_outcome_of_reads_a_blocking_stubs_error_the_same() -> None:
    def blocking_route(address: str) -> grpc.RpcError:
        with grpc.insecure_channel(address) as channel:
            try:
                pb_grpc.CoordinatorStub(channel).Route(route_request(), timeout=5)
            except grpc.RpcError as exc:
                return exc
        raise AssertionError("the route was answered")

    async with running_coordinator() as coord:
        error = await asyncio.to_thread(blocking_route, target(coord))
    outcome = outcome_of(error)
    assert (outcome.code, outcome.reason, outcome.retry_after_ms) == (
        grpc.StatusCode.UNAVAILABLE, Reason.NO_WORKER, 500)


async def test_a_refusal_without_a_reason_reads_as_its_code_alone() -> None:
    async with running_coordinator() as coord, grpc.aio.insecure_channel(target(coord)) as ch:
        empty = pb.RouteRequest(prompt=pb.Prompt())
        error = await refusal(pb_grpc.CoordinatorStub(ch).Route(empty))
    outcome = outcome_of(error)
    assert outcome == Outcome(grpc.StatusCode.INVALID_ARGUMENT, None, None, error.details(), {})
    assert "prompt is empty" in outcome.message


class _Refused(grpc.RpcError):
    """A refusal as another server (or a newer kvcoord) might write it."""

    def __init__(self, info: error_details_pb2.ErrorInfo) -> None:
        status = status_pb2.Status(code=grpc.StatusCode.FAILED_PRECONDITION.value[0], message="m")
        status.details.add().Pack(info)
        self._trailers = (("grpc-status-details-bin", status.SerializeToString()),)

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.FAILED_PRECONDITION

    def details(self) -> str:
        return "m"

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        return self._trailers


@pytest.mark.parametrize("info", [
    error_details_pb2.ErrorInfo(reason="REREGISTER", domain="example.com"),
    error_details_pb2.ErrorInfo(reason="SOMETHING_NEWER", domain=ERROR_DOMAIN),
])
def test_a_reason_of_another_domain_or_unknown_here_reads_as_none(
    info: error_details_pb2.ErrorInfo,
) -> None:
    outcome = outcome_of(_Refused(info))
    assert (outcome.code, outcome.reason, outcome.metadata) == (
        grpc.StatusCode.FAILED_PRECONDITION, None, {})
