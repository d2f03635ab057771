"""Authentication and authorization of the coordinator: every role against every RPC, workers
acting only as themselves, page keys only from key holders, health open, reflection admin-only."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from bench.scripted_worker import ScriptedWorker
from coordinator.client.outcomes import outcome_of
from coordinator.rpc.identities import COORDINATOR_PERMISSIONS, Role
from coordinator.server.main import RunningCoordinator
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from coordinator.wire import Reason
from tests.auth_fixtures import IDENTITIES, IdentityFile
from tests.coordinator_fixtures import DEV_HASH, running_coordinator, target

DENIED = grpc.StatusCode.PERMISSION_DENIED
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"]


def _requests(worker_id: str) -> dict[str, object]:
    """A small request per method (valid enough to pass validation where it matters)."""
    prompt = pb.Prompt(token_ids=list(range(32)))
    return {
        "Lookup": pb.LookupRequest(prompt=prompt),
        "Route": pb.RouteRequest(prompt=prompt),
        "RouteBatch": pb.RouteBatchRequest(prompts=[prompt]),
        "EndRoutes": pb.EndRoutesRequest(route_ids=["an-id-nobody-issued"]),
        "Register": pb.RegisterRequest(worker_id=worker_id, address="h:1"),
        "Sync": pb.SyncRequest(hello=pb.SyncHello(worker_id=worker_id, incarnation=1)),
        "Deregister": pb.DeregisterRequest(worker_id=worker_id),
        "ReportRollouts": pb.ReportRolloutsRequest(records=[pb.RolloutRecord(
            rollout_id="r1", worker_id=worker_id, prompt_tokens=1)]),
        "GetPolicy": pb.GetPolicyRequest(),
        "BeginPolicyUpdate": pb.BeginPolicyUpdateRequest(expected_version=99),
        "CommitPolicyUpdate": pb.CommitPolicyUpdateRequest(version=99, timeout_ms=10),
        "AbortPolicyUpdate": pb.AbortPolicyUpdateRequest(version=99),
        "WatchPolicy": pb.WatchPolicyRequest(),
        "ReadRollouts": pb.ReadRolloutsRequest(),
        "ListWorkers": pb.ListWorkersRequest(),
        "GetStats": pb.GetStatsRequest(),
        "Cordon": pb.CordonRequest(worker_id=worker_id, cordoned=True),
    }


async def _status(channel: grpc.aio.Channel, method: str, request: object,
                  metadata: tuple[tuple[str, str], ...]) -> grpc.StatusCode:
    """The status one call ends with (a stream: its first message or its end)."""
    stub = pb_grpc.CoordinatorStub(channel)
    descriptor = SERVICE.methods_by_name[method]
    try:
        if descriptor.client_streaming:
            call = stub.Sync(metadata=metadata, timeout=2)
            await call.write(request)
            await call.read()
            call.cancel()
        elif descriptor.server_streaming:
            call = getattr(stub, method)(request, metadata=metadata, timeout=2)
            await call.read()
            call.cancel()
        else:
            await getattr(stub, method)(request, metadata=metadata, timeout=2)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def test_every_role_is_allowed_exactly_what_the_permission_table_says(
    auth_coordinator: RunningCoordinator, identities: IdentityFile,
) -> None:
    assert {m.name for m in SERVICE.methods} == set(COORDINATOR_PERMISSIONS)
    async with grpc.aio.insecure_channel(target(auth_coordinator)) as channel:
        for name, (role, _, worker_id, _) in IDENTITIES.items():
            requests = _requests(worker_id or "w1")
            for method, request in requests.items():
                code = await _status(channel, method, request, identities.metadata(name))
                allowed = Role(role) in COORDINATOR_PERMISSIONS[method]
                if allowed:
                    assert code not in (DENIED, UNAUTHENTICATED), (name, method, code)
                else:
                    assert code == DENIED, (name, method, code)


async def test_a_call_without_a_known_token_is_unauthenticated(
    auth_coordinator: RunningCoordinator, identities: IdentityFile,
) -> None:
    async with grpc.aio.insecure_channel(target(auth_coordinator)) as channel:
        for metadata in ((), (("authorization", "Bearer not-a-real-token-at-all"),),
                         (("authorization", f"Basic {identities.tokens['admin']}"),)):
            for method, request in _requests("w1").items():
                assert await _status(channel, method, request, metadata) == UNAUTHENTICATED, (
                    metadata, method)


async def test_a_worker_cannot_act_as_another_worker(
    auth_coordinator: RunningCoordinator, identities: IdentityFile,
) -> None:
    w1 = identities.metadata("w1")
    async with grpc.aio.insecure_channel(target(auth_coordinator)) as channel:
        for method in ("Register", "Sync", "Deregister", "ReportRollouts", "Cordon"):
            code = await _status(channel, method, _requests("w2")[method], w1)
            assert code == DENIED, method
    # As itself it registers and syncs; an admin may act for any worker.
    own = ScriptedWorker(target(auth_coordinator), "w1", hash_config=DEV_HASH,
                         token=identities.tokens["w1"])
    await own.register()
    await own.connect()
    other = ScriptedWorker(target(auth_coordinator), "w2", hash_config=DEV_HASH,
                           token=identities.tokens["admin"])
    await other.register()
    async with grpc.aio.insecure_channel(target(auth_coordinator)) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ReportRollouts(pb.ReportRolloutsRequest(records=[
                pb.RolloutRecord(rollout_id="x", worker_id="w1", prompt_tokens=1),
                pb.RolloutRecord(rollout_id="y", worker_id="w2", prompt_tokens=1),
            ]), metadata=w1)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # one of them is w2's
        reply = await stub.ReportRollouts(pb.ReportRolloutsRequest(records=[
            pb.RolloutRecord(rollout_id="x", worker_id="w1", prompt_tokens=1)]), metadata=w1)
        assert reply.accepted == 1
        # A worker lists only itself (its preStop hook reads its incarnation there).
        listed = await stub.ListWorkers(pb.ListWorkersRequest(), metadata=w1)
        assert [w.worker_id for w in listed.workers] == ["w1"]
        listed = await stub.ListWorkers(pb.ListWorkersRequest(),
                                        metadata=identities.metadata("sched-a"))
        assert sorted(w.worker_id for w in listed.workers) == ["w1", "w2"]
    await own.close()
    await other.close()


async def test_page_keys_are_refused_from_schedulers_unless_trusted(
    identities: IdentityFile,
) -> None:
    keys = pb.Prompt(page_keys=bytes(32))
    for trusted, expected in ((False, DENIED), (True, grpc.StatusCode.UNAVAILABLE)):
        async with (
            running_coordinator(auth_file=str(identities.path),
                                trust_scheduler_page_keys=trusted) as running,
            grpc.aio.insecure_channel(target(running)) as channel,
        ):
            code = await _status(channel, "Route", pb.RouteRequest(prompt=keys),
                                 identities.metadata("sched-a"))
            assert code == expected  # trusted: refused only for want of a worker
            admin = await _status(channel, "Lookup", pb.LookupRequest(prompt=keys),
                                  identities.metadata("admin"))
            assert admin == grpc.StatusCode.OK


async def test_health_is_open_and_reflection_is_admin_only(
    auth_coordinator: RunningCoordinator, identities: IdentityFile,
) -> None:
    async with grpc.aio.insecure_channel(target(auth_coordinator)) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        for name, expected in (("sched-a", DENIED), (None, UNAUTHENTICATED)):
            metadata = identities.metadata(name) if name else ()
            call = reflect.ServerReflectionInfo(metadata=metadata, timeout=2)
            # The refusal may end the stream before the request is written (a loaded machine
            # lets the server answer first): it surfaces at the write or at the read.
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call.write(ask)
                await call.read()
            assert refused.value.code() == expected
        call = reflect.ServerReflectionInfo(metadata=identities.metadata("admin"), timeout=2)
        await call.write(ask)
        answer = await call.read()
        names = {s.name for s in answer.list_services_response.service}
        assert "coordinator.v1.Coordinator" in names
        call.cancel()


async def test_a_worker_past_its_page_limit_is_refused(identities: IdentityFile) -> None:
    async with running_coordinator(auth_file=str(identities.path),
                                   max_pages_per_worker=4) as running:
        worker = ScriptedWorker(target(running), "w1", hash_config=DEV_HASH,
                                token=identities.tokens["w1"], auto_resync=False)
        await worker.register()
        await worker.connect()
        await worker.store(worker.keys(list(range(64))))  # 4 pages: at the limit
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await worker.store(worker.keys(list(range(100, 116))))  # a fifth
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert outcome_of(refused.value).reason is Reason.PAGE_CAP
        assert "max_pages_per_worker" in (refused.value.details() or "")
        assert running.service.index.held_count("w1") == 4
        await worker.close()


async def test_a_rotated_token_takes_effect_without_a_restart(
    identities: IdentityFile,
) -> None:
    async with (
        running_coordinator(auth_file=str(identities.path), auth_reload_ms=20) as running,
        grpc.aio.insecure_channel(target(running)) as channel,
    ):
        stub = pb_grpc.CoordinatorStub(channel)
        old = identities.metadata("admin")
        await stub.GetPolicy(pb.GetPolicyRequest(), metadata=old)
        new_token = "rotated-admin-token-0123456789"
        text = identities.path.read_text().replace(identities.tokens["admin"], new_token)
        identities.path.write_text(text)
        new = (("authorization", f"Bearer {new_token}"),)
        deadline = time.monotonic() + 5
        while await _status(channel, "GetPolicy", pb.GetPolicyRequest(),
                            new) != grpc.StatusCode.OK:
            assert time.monotonic() < deadline, "the rotated token was never accepted"
            await asyncio.sleep(0.02)
        assert await _status(channel, "GetPolicy", pb.GetPolicyRequest(), old) == UNAUTHENTICATED
