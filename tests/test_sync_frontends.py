"""Sync frontends (``--sync-frontends``): worker streams terminated in processes of their own
and relayed to the replica, which serves them as it serves its own (server.sync_relay)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from contextlib import AsyncExitStack
from pathlib import Path

import grpc
import pytest

from bench.scripted_worker import ScriptedWorker
from coordinator.client import AsyncCoordinatorClient
from coordinator.client.outcomes import outcome_of
from coordinator.server.main import RunningCoordinator
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.wire import Reason
from tests.auth_fixtures import write_identities
from tests.coordinator_fixtures import DEV_HASH, eventually, running_coordinator, target
from worker.client import AsyncWorkerClient
from worker.config import WorkerConfig
from worker.main import start_worker

PAGE = 4
PROMPT = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5]


def _frontends(running: RunningCoordinator):  # type: ignore[no-untyped-def]
    assert running.sync_frontends is not None
    return running.sync_frontends


async def test_real_workers_sync_through_frontends_and_the_policy_barrier_holds() -> None:
    async with running_coordinator(page_size=PAGE, sync_frontends=2, barrier_timeout_ms=5000,
                                   route_wait_ms=5000) as coord, AsyncExitStack() as stack, \
            AsyncCoordinatorClient(target(coord)) as client:
        workers = []
        for i in range(3):
            config = WorkerConfig(coordinator=target(coord), listen="127.0.0.1:0", pages=64,
                                  page_size=PAGE, device="cpu", worker_id=f"w{i}",
                                  max_new_tokens=16)
            running = await start_worker(config)
            stack.push_async_callback(running.stop, 0.5)
            workers.append(running)
        for w in workers:
            await asyncio.wait_for(w.agent.synced.wait(), 10)
        streams = _frontends(coord).streams_by_frontend()
        assert sum(streams.values()) == 3 and min(streams.values()) >= 1, streams
        # A generation's pages reach the index through a frontend.
        first = await AsyncWorkerClient(f"127.0.0.1:{workers[0].port}").generate(PROMPT, 4)

        async def indexed() -> bool:
            return (await client.lookup(PROMPT)).matches.get("w0", 0) > 0

        await eventually(indexed, what="w0's pages in the index")
        # The barrier: DRAIN and APPLY reach every worker through its frontend, their acks
        # come back the same way, and nothing made under version 0 is reused under 1.
        async with client.policy_update(0) as update:
            assert update.version == 1
        assert update.result is not None
        assert sorted(update.result.acked_workers) == ["w0", "w1", "w2"]
        assert update.result.fenced_workers == ()
        route = await client.route(PROMPT)
        after = await AsyncWorkerClient(route.address).generate(PROMPT, 4)
        assert (route.policy_version, after.policy_version, after.cached_tokens) == (1, 1, 0)
        assert after.tokens != first.tokens


async def test_a_frontend_answers_with_the_replicas_status_and_reason() -> None:
    async with running_coordinator(sync_frontends=1) as running:
        worker = ScriptedWorker(target(running), "w1", hash_config=DEV_HASH)
        await worker.register()
        assert worker.sync_port == _frontends(running).ports[0]
        worker.incarnation += 7  # an incarnation the replica never gave
        with pytest.raises(grpc.RpcError) as err:
            await worker.connect()
        outcome = outcome_of(err.value)
        assert outcome.code == grpc.StatusCode.FAILED_PRECONDITION
        assert outcome.reason is Reason.REREGISTER, outcome
        await worker.close()


async def test_the_caller_identity_is_the_frontends_callers(tmp_path: Path) -> None:
    identities = write_identities(tmp_path)
    async with running_coordinator(sync_frontends=1, auth_file=str(identities.path)) as running:
        worker = ScriptedWorker(target(running), "w1", hash_config=DEV_HASH,
                                token=identities.tokens["w1"])
        await worker.start()  # its own token: served
        assert (await worker.store([os.urandom(16)])).ack.seq == 1
        await worker.close()
        # Registered as w1, then a stream opened with w2's token: refused by the replica,
        # which sees w2 as the caller of the relayed stream.
        impostor = ScriptedWorker(target(running), "w1", hash_config=DEV_HASH,
                                  token=identities.tokens["w1"])
        await impostor.register()
        impostor.metadata = identities.metadata("w2")
        with pytest.raises(grpc.RpcError) as err:
            await impostor.connect()
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        impostor.metadata = ()
        with pytest.raises(grpc.RpcError) as err:
            await impostor.connect()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        await impostor.close()


async def test_a_killed_frontend_restarts_on_its_port_and_its_worker_resumes() -> None:
    async with running_coordinator(sync_frontends=1) as running, \
            AsyncCoordinatorClient(target(running)) as client:
        frontends = _frontends(running)
        (port,) = frontends.ports
        worker = ScriptedWorker(target(running), "w1", hash_config=DEV_HASH)
        await worker.start()
        before = [os.urandom(16) for _ in range(8)]
        assert (await worker.store(before)).ack.seq == 1
        (pid,) = frontends.pids()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises((grpc.RpcError, EOFError)):
            await worker.next_message(timeout=10)

        async def restarted() -> bool:
            return frontends.ports == [port] and frontends.pids() != [pid]

        await eventually(restarted, what="the frontend back on its port", timeout=30)
        assert frontends.restarts == 1
        await worker.disconnect()
        welcome = await worker.connect()
        assert welcome.welcome.next_seq == 2  # nothing applied was lost
        after = [os.urandom(16) for _ in range(8)]
        assert (await worker.store(after)).ack.seq == 2
        assert (await client.stats()).index_keys == 16
        await worker.close()


async def test_no_frontend_means_sync_on_the_replicas_own_port() -> None:
    async with running_coordinator() as running:
        assert running.sync_frontends is None
        worker = ScriptedWorker(target(running), "w1", hash_config=DEV_HASH)
        response = await worker.register()
        assert response.sync_port == 0
        await worker.connect()
        assert (await worker.store([os.urandom(16)])).ack.seq == 1
        await worker.close()


def test_a_frontend_count_out_of_range_is_refused() -> None:
    from coordinator.config import ConfigError, CoordinatorConfig
    with pytest.raises(ConfigError, match="sync_frontends"):
        CoordinatorConfig(sync_frontends=-1)
    assert pb.RegisterResponse(sync_port=1).sync_port == 1


async def test_the_frontends_are_in_the_metrics() -> None:
    from coordinator.server.metrics import CoordinatorMetrics
    async with running_coordinator(sync_frontends=2) as running:
        metrics = CoordinatorMetrics(running.service)
        metrics.watch_frontends(_frontends(running))
        worker = ScriptedWorker(target(running), "w1", hash_config=DEV_HASH)
        await worker.start()
        registry = metrics.registry
        assert registry.get_sample_value("kvcoord_sync_frontends") == 2
        streams = [registry.get_sample_value("kvcoord_sync_frontend_streams",
                                             {"frontend": str(i)}) for i in (0, 1)]
        assert sorted(streams) == [0, 1]
        assert registry.get_sample_value("kvcoord_sync_frontend_restarts_total") == 0
        await worker.close()


async def test_a_frontend_port_in_use_is_refused_at_start_naming_it() -> None:
    from coordinator.config import ConfigError
    taken, port = _listening_socket_after_a_free_port()
    try:
        with pytest.raises(ConfigError, match=f"127.0.0.1:{port + 1}.*in use"):
            async with running_coordinator(listen=f"127.0.0.1:{port}", sync_frontends=1):
                pass
    finally:
        taken.close()


def _listening_socket_after_a_free_port() -> tuple[socket.socket, int]:
    """A socket listening on some port P+1 while P is free: the frontend's port is taken, the
    replica's is not. The taken port is bound first, so nothing else can hold it (a free port
    picked first leaves P+1 to chance, which failed a CI run)."""
    for _ in range(100):
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1] - 1
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                taken.close()
                continue
        taken.listen()
        return taken, port
    raise RuntimeError("no free port found below a free ephemeral port in 100 tries")
