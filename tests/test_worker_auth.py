"""A worker with auth on, end to end: it registers with its own token (or mTLS certificate),
its Generate/LoadWeights/GetStats obey the role table, and its prefix cache keeps tenants apart
exactly as the coordinator's index does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from coordinator.client import AsyncCoordinatorClient, KvcoordError
from coordinator.client.channels import ClientTls
from coordinator.rpc.identities import WORKER_PERMISSIONS, Role
from coordinator.server.main import RunningCoordinator
from tests.auth_fixtures import IDENTITIES, IdentityFile, write_identities
from tests.coordinator_fixtures import running_coordinator, target
from tests.tls_certs import make_pki
from worker.client import AsyncWorkerClient
from worker.config import WorkerConfig
from worker.main import RunningWorker, start_worker
from worker.v1 import worker_pb2 as wpb
from worker.v1 import worker_pb2_grpc as wpb_grpc

PAGE = 4
PROMPT = [5, 9, 13, 17, 21, 25, 29, 33, 37, 41]  # 2 full pages of 4 and a partial one


@dataclass
class Fleet:
    coordinator: RunningCoordinator
    worker: RunningWorker
    identities: IdentityFile

    @property
    def worker_target(self) -> str:
        return f"127.0.0.1:{self.worker.port}"


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    identities = write_identities(tmp_path)
    token_file = tmp_path / "w1.token"
    token_file.write_text(identities.tokens["w1"] + "\n")
    async with running_coordinator(page_size=PAGE, auth_file=str(identities.path)) as coord:
        config = WorkerConfig(
            coordinator=target(coord), listen="127.0.0.1:0", pages=16, page_size=PAGE,
            device="cpu", worker_id="w1", max_new_tokens=8, auth_file=str(identities.path),
            token_file=str(token_file),
        )
        running = await start_worker(config)
        await asyncio.wait_for(running.agent.synced.wait(), 5)
        yield Fleet(coord, running, identities)
        await running.stop(grace=0.5)


async def test_the_worker_registers_with_its_own_token_and_obeys_the_role_table(
    fleet: Fleet,
) -> None:
    assert fleet.coordinator.service.worker_sync.served_versions_of("w1") is not None
    requests = {
        "Generate": wpb.GenerateRequest(token_ids=PROMPT, max_new_tokens=1),
        "LoadWeights": wpb.LoadWeightsRequest(version=0),
        "GetStats": wpb.GetStatsRequest(),
    }
    assert set(requests) == set(WORKER_PERMISSIONS)
    async with grpc.aio.insecure_channel(fleet.worker_target) as channel:
        stub = wpb_grpc.WorkerStub(channel)
        for name, (role, *_) in IDENTITIES.items():
            for method, request in requests.items():
                try:
                    await getattr(stub, method)(request, metadata=fleet.identities.metadata(name))
                    code = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    code = exc.code()
                if Role(role) in WORKER_PERMISSIONS[method]:
                    assert code == grpc.StatusCode.OK, (name, method, code)
                else:
                    assert code == grpc.StatusCode.PERMISSION_DENIED, (name, method, code)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Generate(requests["Generate"])
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_a_worker_cordons_itself_but_cannot_uncordon(fleet: Fleet) -> None:
    await fleet.worker.agent.cordon_self()  # what a graceful stop does first
    async with AsyncCoordinatorClient(target(fleet.coordinator),
                                      token=fleet.identities.tokens["admin"]) as admin:
        assert [(w.worker_id, w.state) for w in await admin.workers()] == [("w1", "cordoned")]
    async with AsyncCoordinatorClient(target(fleet.coordinator),
                                      token=fleet.identities.tokens["w1"]) as as_worker:
        with pytest.raises(KvcoordError) as refused:
            await as_worker.cordon("w1", cordoned=False)
        assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert "may cordon itself but not uncordon" in str(refused.value)


async def test_tenants_do_not_share_the_workers_cache_or_the_coordinators_index(
    fleet: Fleet,
) -> None:
    tokens = fleet.identities.tokens

    async def generate(who: str) -> int:
        async with AsyncWorkerClient(fleet.worker_target, token=tokens[who]) as client:
            return (await client.generate(PROMPT, 2)).cached_tokens

    assert await generate("sched-a") == 0
    assert await generate("sched-a") == 2 * PAGE  # A's second call hits A's pages
    assert await generate("sched-b") == 0  # the same tokens from B: nothing of A's
    assert await generate("sched-b") == 2 * PAGE

    async def lookup(who: str) -> dict[str, int]:
        async with AsyncCoordinatorClient(target(fleet.coordinator), token=tokens[who]) as c:
            return (await c.lookup(PROMPT)).matches

    # The worker reported each tenant's pages under that tenant's keys; each sees its own.
    for who in ("sched-a", "sched-b"):
        deadline = asyncio.get_running_loop().time() + 5
        while await lookup(who) != {"w1": 2 * PAGE}:
            assert asyncio.get_running_loop().time() < deadline, f"{who} never saw its pages"
            await asyncio.sleep(0.02)
    async with AsyncWorkerClient(fleet.worker_target, token=tokens["admin"]) as client:
        assert (await client.generate(PROMPT, 2)).cached_tokens == 0  # the default tenant


async def test_mutual_tls_identifies_callers_by_certificate(tmp_path: Path) -> None:
    identities = write_identities(tmp_path)
    pki = make_pki(tmp_path / "pki", ("w1-cert", "trainer-cert", "stranger"))
    async with running_coordinator(
        page_size=PAGE, auth_file=str(identities.path), tls_cert=pki.server.cert,
        tls_key=pki.server.key, tls_client_ca=pki.ca,
    ) as coord:
        address = f"localhost:{coord.port}"
        worker = await start_worker(WorkerConfig(
            coordinator=address, listen="127.0.0.1:0", pages=16, page_size=PAGE, device="cpu",
            worker_id="w1", tls_ca=pki.ca, tls_cert=pki.clients["w1-cert"].cert,
            tls_key=pki.clients["w1-cert"].key,
        ))
        try:
            # No token: the certificate's common name (w1-cert) is the worker identity w1.
            await asyncio.wait_for(worker.agent.synced.wait(), 5)
        finally:
            await worker.stop(grace=0.2)

        def tls(name: str) -> ClientTls:
            files = pki.clients[name]
            return ClientTls.from_files(pki.ca, files.cert, files.key)

        async with AsyncCoordinatorClient(address, tls=tls("trainer-cert")) as trainer:
            assert (await trainer.policy()).version == 0
            with pytest.raises(KvcoordError) as denied:
                await trainer.route(PROMPT)
            assert denied.value.code == grpc.StatusCode.PERMISSION_DENIED
        async with AsyncCoordinatorClient(address, tls=tls("stranger")) as stranger:
            with pytest.raises(KvcoordError) as unknown:
                await stranger.policy()
            assert unknown.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert "names no identity" in str(unknown.value)
        # No client certificate at all: the handshake fails before any handler runs.
        async with AsyncCoordinatorClient(address, tls=ClientTls.from_files(pki.ca),
                                          timeout=1) as anonymous:
            with pytest.raises(KvcoordError) as refused:
                await anonymous.policy()
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE
