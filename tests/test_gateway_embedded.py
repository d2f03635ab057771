"""``kvcoord gateway --embed-coordinator``: one process is the gateway and the coordinator, and
the gateway's routes reach the coordinator in process, through the same guard, error mapping
and metrics as a remote call. Real reference workers register with the embedded coordinator
over gRPC; the official ``openai`` client talks to the gateway."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import openai
import pytest
from openai import AsyncOpenAI

from coordinator.client import AsyncCoordinatorClient, KvcoordError
from coordinator.config import CoordinatorConfig
from coordinator.server.in_process import InProcessStub
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.wire import Reason
from kvcoord import child_process
from kvcoord.demo import free_port
from kvcoord.gateway.config import GatewayConfig
from kvcoord.gateway.main import start_gateway
from kvcoord.gateway.server import GatewayServer
from tests.auth_fixtures import write_identities
from tests.cli_refusals import assert_refused_in_one_line
from tests.coordinator_fixtures import FAST_KNOBS, eventually
from worker.config import WorkerConfig
from worker.main import RunningWorker, start_worker

PAGE = 16
MODEL = "default"
FIRST = [{"role": "user", "content": "Where do the pages of this conversation live? " * 8}]
KVCOORD = str(Path(sys.executable).parent / "kvcoord")


@asynccontextmanager
async def embedded_fleet(tmp_path: Path, tokens: dict[str, str] | None = None,
                         **coordinator: Any
                         ) -> AsyncIterator[tuple[GatewayServer, list[RunningWorker]]]:
    """A gateway running its coordinator in process, and two reference workers registered with
    that coordinator (as w1 and w2 when ``auth_file`` is given)."""
    gateway, client = await start_gateway(
        GatewayConfig(listen="127.0.0.1:0", embed_coordinator="127.0.0.1:0",
                      drain_wait_ms=5_000),
        embedded=CoordinatorConfig(listen="127.0.0.1:0", page_size=PAGE, **FAST_KNOBS,
                                   **coordinator))
    workers: list[RunningWorker] = []
    try:
        assert gateway.embedded is not None
        for i in (1, 2):
            extra: dict[str, Any] = {}
            if tokens is not None:
                token_file = tmp_path / f"w{i}.token"
                token_file.write_text(tokens[f"w{i}"])
                extra = {"auth_file": coordinator["auth_file"], "token_file": str(token_file)}
            workers.append(await start_worker(WorkerConfig(
                coordinator=f"127.0.0.1:{gateway.embedded.port}", listen="127.0.0.1:0",
                pages=256, page_size=PAGE, device="cpu", worker_id=f"w{i}",
                max_new_tokens=64, http_listen="127.0.0.1:0", **extra)))
        for worker in workers:
            await asyncio.wait_for(worker.agent.synced.wait(), 10)
        yield gateway, workers
    finally:
        for worker in workers:
            await worker.stop(0.5)
        await gateway.stop()
        await client.close()


async def test_the_next_turn_lands_on_the_first_turns_worker_through_the_embedded_coordinator(
    tmp_path: Path,
) -> None:
    async with embedded_fleet(tmp_path) as (gateway, workers):
        api = AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="unused",
                          max_retries=0)
        raw = await api.chat.completions.with_raw_response.create(
            model=MODEL, messages=FIRST, max_tokens=4)
        first = raw.parse()
        served_by = raw.headers["x-kvcoord-worker"]
        second_turn = [*FIRST, {"role": "assistant",
                                "content": first.choices[0].message.content},
                       {"role": "user", "content": "And the next turn?"}]

        async def settled() -> bool:
            assert gateway.embedded is not None
            async with AsyncCoordinatorClient(f"127.0.0.1:{gateway.embedded.port}") as remote:
                return all(w.inflight_routes == 0 for w in await remote.workers())

        await eventually(settled, what="the first route reported finished")
        raw2 = await api.chat.completions.with_raw_response.create(
            model=MODEL, messages=second_turn, max_tokens=4)
        second = raw2.parse()
        await api.close()
    assert served_by in {w.agent.worker_id for w in workers}
    assert raw2.headers["x-kvcoord-worker"] == served_by
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens_details.cached_tokens >= (
        first.usage.prompt_tokens // PAGE * PAGE) > 0


async def test_refusals_come_back_as_a_remote_coordinator_would_send_them(
    tmp_path: Path,
) -> None:
    """The in-process call goes through the coordinator's own guard: an unknown token is 401,
    a role that may not route 403; a fleet with no worker is 503 with Retry-After (the
    refusal's status details reach the gateway as they would over the wire)."""
    ids = write_identities(tmp_path)
    async with embedded_fleet(tmp_path, auth_file=str(ids.path), tokens=ids.tokens) as (
            gateway, _workers):
        url = f"http://127.0.0.1:{gateway.port}/v1"
        api = AsyncOpenAI(base_url=url, api_key=ids.tokens["sched-a"], max_retries=0)
        answer = await api.completions.create(model=MODEL, prompt="hello there", max_tokens=1)
        await api.close()
        assert answer.usage is not None and answer.usage.completion_tokens == 1
        for token, error, status in [("wrong-token-0123456789abcdef",
                                      openai.AuthenticationError, 401),
                                     (ids.tokens["trainer"], openai.PermissionDeniedError, 403)]:
            api = AsyncOpenAI(base_url=url, api_key=token, max_retries=0)
            with pytest.raises(error) as refused:
                await api.completions.create(model=MODEL, prompt="hi", max_tokens=1)
            await api.close()
            assert refused.value.status_code == status
        assert gateway.embedded is not None
        stub = InProcessStub(gateway.embedded.servicer)
        local = AsyncCoordinatorClient.over_stub(stub, f"127.0.0.1:{gateway.embedded.port}")
        with pytest.raises(KvcoordError) as no_worker:
            await local.as_caller(ids.tokens["sched-a"]).route(
                [1] * 64, model="no-such-model")
        assert no_worker.value.code is grpc.StatusCode.UNAVAILABLE
        assert no_worker.value.reason is Reason.NO_WORKER
        assert no_worker.value.retry_after_ms is not None
        with pytest.raises(NotImplementedError):
            stub.WatchPolicy(pb.WatchPolicyRequest())


async def test_kvcoord_gateway_embeds_its_coordinator_in_one_process(tmp_path: Path) -> None:
    """One ``kvcoord gateway --embed-coordinator`` process: a worker registers with it, a
    request through it is answered, SIGTERM stops both."""
    coordinator, listen = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    env = {**os.environ, "KVCOORD_PAGE_SIZE": str(PAGE)}
    env.pop("KVCOORD_COORDINATOR", None)
    process = await child_process.start_async(
        [KVCOORD, "gateway", "--embed-coordinator", coordinator, "--listen", listen,
         "--log-level", "warning"], env=env, stderr=asyncio.subprocess.PIPE)
    worker: RunningWorker | None = None
    try:
        async def registered() -> bool:
            try:
                async with AsyncCoordinatorClient(coordinator, timeout=2) as client:
                    return any(w.state == "ready" for w in await client.workers())
            except KvcoordError:
                return False

        await asyncio.sleep(0.5)
        worker = await start_worker(WorkerConfig(
            coordinator=coordinator, listen="127.0.0.1:0", pages=256, page_size=PAGE,
            device="cpu", worker_id="solo", max_new_tokens=8, http_listen="127.0.0.1:0"))
        await eventually(registered, timeout=30, what="the worker registered in the gateway")

        async def ready() -> bool:
            try:
                async with aiohttp.ClientSession() as session, \
                        session.get(f"http://{listen}/readyz") as response:
                    return response.status == 200
            except aiohttp.ClientConnectionError:
                return False

        await eventually(ready, timeout=30, what="the gateway ready")
        api = AsyncOpenAI(base_url=f"http://{listen}/v1", api_key="unused", max_retries=0)
        raw = await api.completions.with_raw_response.create(
            model=MODEL, prompt="one process", max_tokens=2)
        await api.close()
        assert raw.headers["x-kvcoord-worker"] == "solo"
        assert raw.parse().usage.completion_tokens == 2  # type: ignore[union-attr]
    finally:
        if worker is not None:
            await worker.stop(0.5)
        process.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(process.wait(), 30)
    assert code == 0


@pytest.mark.parametrize(("flags", "env", "says"), [
    (["--embed-coordinator", "nowhere"], {}, "embed_coordinator must be HOST:PORT"),
    (["--embed-coordinator", "127.0.0.1:0", "--coordinator", "127.0.0.1:1"], {},
     "give --coordinator (route through a coordinator elsewhere) or --embed-coordinator"),
    (["--embed-coordinator", "127.0.0.1:0"], {"KVCOORD_COORDINATOR": "127.0.0.1:1"},
     "not both"),
    (["--embed-coordinator", "127.0.0.1:0"], {"KVCOORD_PAGE_SIZE": "0"}, "page_size"),
])
def test_embedding_refuses_bad_settings_in_one_line(flags: list[str], env: dict[str, str],
                                                    says: str) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVCOORD_")}
    assert_refused_in_one_line("gateway", flags, says, env={**clean, **env})
