"""``kvcoord gateway`` with the official ``openai`` client, against a real coordinator and two
reference workers: a conversation's next turn lands on the worker holding its first turn, with
the cached tokens in ``usage``; streams pass through chunk by chunk; ``n`` goes to one worker;
refusals are OpenAI JSON with the right status; a worker that fails before its first byte is
routed around; health endpoints say what they should."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from coordinator.client import AsyncCoordinatorClient
from coordinator.server.main import RunningCoordinator
from kvcoord import child_process
from kvcoord.demo import free_port
from kvcoord.gateway.config import GatewayConfig
from kvcoord.gateway.main import start_gateway
from kvcoord.gateway.server import GatewayServer
from tests.auth_fixtures import IdentityFile, write_identities
from tests.cli_refusals import assert_refused_in_one_line
from tests.coordinator_fixtures import eventually, running_coordinator, target
from worker.config import WorkerConfig
from worker.main import RunningWorker, start_worker
from worker.text.tokenizer import REFERENCE_TOKENIZER, reference_tokenizer

PAGE = 16
MODEL = "default"


@dataclass
class Fleet:
    coordinator: RunningCoordinator
    workers: list[RunningWorker]
    gateway: GatewayServer

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.port}"

    def client(self) -> AsyncOpenAI:
        return AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)


@asynccontextmanager
async def running_gateway(coordinator: str, **settings: Any) -> AsyncIterator[GatewayServer]:
    """A started gateway in front of ``coordinator``, stopped (and its client closed) after."""
    gateway, client = await start_gateway(GatewayConfig(
        coordinator=coordinator, listen="127.0.0.1:0", **settings))
    try:
        yield gateway
    finally:
        await gateway.stop()
        await client.close()


@asynccontextmanager
async def running_fleet(ids: IdentityFile | None = None,
                        tmp_path: Path | None = None,
                        **coordinator_settings: Any) -> AsyncIterator[Fleet]:
    """A coordinator (``coordinator_settings`` for its config), two reference workers with
    HTTP endpoints, and a gateway; with ``ids``, auth is on everywhere (the workers as w1 and
    w2)."""
    auth: dict[str, Any] = {} if ids is None else {"auth_file": str(ids.path)}
    async with running_coordinator(page_size=PAGE, barrier_timeout_ms=5_000,
                                   **auth, **coordinator_settings) as coord:
        workers = []
        try:
            for i in range(2):
                extra = dict(auth)
                if ids is not None and tmp_path is not None:
                    token_file = tmp_path / f"w{i + 1}.token"
                    token_file.write_text(ids.tokens[f"w{i + 1}"])
                    extra["token_file"] = str(token_file)
                workers.append(await start_worker(WorkerConfig(
                    coordinator=target(coord), listen="127.0.0.1:0", pages=256, page_size=PAGE,
                    device="cpu", worker_id=f"w{i}" if ids is None else f"w{i + 1}",
                    max_new_tokens=256, http_listen="127.0.0.1:0", **extra)))
            for worker in workers:
                await asyncio.wait_for(worker.agent.synced.wait(), 10)
            async with running_gateway(target(coord), drain_wait_ms=10_000) as gateway:
                yield Fleet(coord, workers, gateway)
        finally:
            for worker in workers:
                await worker.stop(0.5)


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    async with running_fleet() as running:
        yield running


async def _settled(fleet: Fleet, token: str | None = None) -> bool:
    async with AsyncCoordinatorClient(target(fleet.coordinator), token) as client:
        return all(w.inflight_routes == 0 for w in await client.workers())


FIRST = [{"role": "system", "content": "You are the routing oracle of a KV-cache fleet."},
         {"role": "user", "content": "Tell me where the pages of this conversation live. " * 6}]


async def test_the_next_turn_lands_on_the_first_turns_worker_with_cached_tokens(
    fleet: Fleet,
) -> None:
    async with fleet.client() as api:
        raw = await api.chat.completions.with_raw_response.create(
            model=MODEL, messages=FIRST, max_tokens=6)
        first = raw.parse()
        worker = raw.headers["x-kvcoord-worker"]
        # A person reads the answer before the next turn; meanwhile the worker's heartbeat
        # (~20 ms after a generation ends) tells the coordinator the route finished. Sooner,
        # the route would still count as queued work on that worker.
        await eventually(lambda: _settled(fleet), what="the first route reported finished")
        second_turn = [*FIRST, {"role": "assistant", "content": first.choices[0].message.content},
                       {"role": "user", "content": "And the next turn?"}]
        raw2 = await api.chat.completions.with_raw_response.create(
            model=MODEL, messages=second_turn, max_tokens=6)
        second = raw2.parse()
    assert raw.headers["x-kvcoord-policy-version"] == "0" and raw.headers["x-request-id"]
    assert raw2.headers["x-kvcoord-worker"] == worker
    assert second.usage is not None and first.usage is not None
    assert first.usage.prompt_tokens == len(reference_tokenizer().encode_chat(FIRST))
    # The first turn's full prompt pages are reused by the second (the completion's are not:
    # the engine records prompt pages and the completion's, but the template re-renders it).
    assert second.usage.prompt_tokens_details.cached_tokens >= (
        first.usage.prompt_tokens // PAGE * PAGE)


async def test_a_stream_passes_through_chunk_by_chunk(fleet: Fleet) -> None:
    async with fleet.client() as api:
        whole = await api.completions.create(model=MODEL, prompt="Stream this", max_tokens=30)
        stream = await api.completions.create(
            model=MODEL, prompt="Stream this", max_tokens=30, stream=True,
            stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len([t for t in texts if t]) > 5
    assert "".join(texts) == whole.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 30


async def test_the_first_chunk_reaches_the_client_before_generation_ends(fleet: Fleet) -> None:
    body = {"model": MODEL, "prompt": "a long stream", "max_tokens": 200, "stream": True}
    async with aiohttp.ClientSession() as session, \
            session.post(f"{fleet.url}/v1/completions", json=body) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        first = await response.content.readline()
        assert first.startswith(b"data: {")
        worker = {w.worker_id: w for w in fleet.workers}[response.headers["x-kvcoord-worker"]]
        assert worker.runtime.stats().running_requests == 1  # the worker is still decoding
        rest = (await response.read()).decode()
    assert rest.rstrip().endswith("data: [DONE]")


async def test_n_copies_go_to_one_worker_as_the_engines_own_n(fleet: Fleet) -> None:
    async with fleet.client() as api:
        raw = await api.completions.with_raw_response.create(
            model=MODEL, prompt="GRPO group prompt", n=4, max_tokens=2)
    answer = raw.parse()
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    worker = {w.worker_id: w for w in fleet.workers}[raw.headers["x-kvcoord-worker"]]
    assert worker.gate.totals.requests == 4  # all four ran there


async def test_a_worker_failing_before_its_first_byte_is_routed_around(fleet: Fleet) -> None:
    async with fleet.client() as api:
        raw = await api.chat.completions.with_raw_response.create(
            model=MODEL, messages=FIRST, max_tokens=2)
        holder = {w.worker_id: w for w in fleet.workers}[raw.headers["x-kvcoord-worker"]]
        assert holder.http is not None
        await holder.http.stop()  # its endpoint now refuses connections; still registered
        again = await api.chat.completions.with_raw_response.create(
            model=MODEL, messages=FIRST, max_tokens=2)
    assert again.headers["x-kvcoord-worker"] != holder.worker_id
    assert again.parse().choices[0].finish_reason == "length"


@pytest.mark.parametrize(("path", "body", "status", "code"), [
    ("completions", b"{not json", 400, "invalid_json"),
    ("completions", {"model": MODEL, "prompt": 7}, 400, "invalid_type"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
     400, "invalid_type"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
     400, None),
    ("completions", {"model": "gpt-9", "prompt": "x"}, 404, "model_not_found"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 4096}, 400,
     "context_length_exceeded"),
    ("embeddings", {"model": MODEL}, 404, "not_found"),
])
async def test_refusals_are_openai_json_with_the_right_status(
    fleet: Fleet, path: str, body: Any, status: int, code: str | None,
) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as session, session.post(
            f"{fleet.url}/v1/{path}", data=data,
            headers={"Content-Type": "application/json"}) as response:
        answer = await response.json()
    assert response.status == status, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["code"] == code


async def test_a_body_over_the_limit_is_413_and_unknown_fields_pass(fleet: Fleet) -> None:
    async with aiohttp.ClientSession() as session:
        big = await session.post(f"{fleet.url}/v1/completions", data=b"x" * (9 * 1024 * 1024))
        assert big.status == 413 and (await big.json())["error"]["code"] == "body_too_large"
        ok = await session.post(f"{fleet.url}/v1/completions", json={
            "model": MODEL, "prompt": "x", "max_tokens": 1, "top_k": 3, "min_p": 0.1})
        assert ok.status == 200, await ok.text()


async def test_health_live_and_ready_and_no_worker_is_503() -> None:
    async with running_coordinator(page_size=PAGE) as coord, \
            running_gateway(target(coord)) as gateway:
        url = f"http://127.0.0.1:{gateway.port}"
        async with aiohttp.ClientSession() as session:
            assert (await session.get(f"{url}/livez")).status == 200
            ready = await session.get(f"{url}/readyz")
            assert ready.status == 503
            assert (await ready.json())["reason"] == "no routable worker"
        api = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as refused:
            await api.completions.create(model=MODEL, prompt="hi", max_tokens=1)
        assert refused.value.status_code == 503
        assert refused.value.response.json()["error"]["code"] == "no_worker"
        await api.close()


async def test_several_prompts_are_spread_by_one_route_batch_and_merged_by_index(
    fleet: Fleet,
) -> None:
    tokenizer = reference_tokenizer()
    prompts = ["First prompt, held by one worker: " * 4, "Second prompt, held by the other: " * 4]
    alone = []
    for prompt, worker in zip(prompts, fleet.workers, strict=True):  # warm each on its worker
        direct = AsyncOpenAI(base_url=f"http://127.0.0.1:{worker.http_port}/v1",
                             api_key="unused", max_retries=0)
        alone.append((await direct.completions.create(model=MODEL, prompt=prompt,
                                                      max_tokens=3)).choices[0].text)
        await direct.close()

    async def indexed() -> bool:
        async with AsyncCoordinatorClient(target(fleet.coordinator)) as client:
            found = [await client.lookup(tokenizer.encode(p)) for p in prompts]
        return [sorted(f.matches) for f in found] == [["w0"], ["w1"]] and await _settled(fleet)

    await eventually(indexed, what="each prompt indexed on its own worker")
    async with fleet.client() as api:
        raw = await api.completions.with_raw_response.create(
            model=MODEL, prompt=prompts, n=2, max_tokens=3)
        stream = await api.completions.create(
            model=MODEL, prompt=prompts, n=2, max_tokens=3, stream=True,
            stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
    answer = raw.parse()
    assert sorted(raw.headers["x-kvcoord-worker"].split(",")) == ["w0", "w1"]
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert [c.text for c in answer.choices] == [alone[0], alone[0], alone[1], alone[1]]
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert answer.usage.completion_tokens == 4 * 3
    assert answer.usage.prompt_tokens_details.cached_tokens > 0  # both shares hit their cache
    streamed: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {c.index: c.text for c in answer.choices}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


async def test_kvcoord_gateway_serves_a_fleet_and_stops_on_sigterm(fleet: Fleet) -> None:
    port = free_port()
    process = await child_process.start_async(
        [Path(sys.executable).parent / "kvcoord", "gateway", "--coordinator",
         target(fleet.coordinator), "--listen", f"127.0.0.1:{port}", "--log-level", "warning"],
        stderr=asyncio.subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"

        async def ready() -> bool:
            try:
                async with aiohttp.ClientSession() as session, \
                        session.get(f"{url}/readyz") as response:
                    return response.status == 200
            except aiohttp.ClientConnectionError:
                return False

        await eventually(ready, timeout=30, what="kvcoord gateway ready")
        api = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        answer = await api.completions.create(model=MODEL, prompt="through the CLI", max_tokens=2)
        await api.close()
        assert answer.usage is not None and answer.usage.completion_tokens == 2
    finally:
        process.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(process.wait(), 20)
    assert code == 0


@pytest.mark.parametrize(("flags", "says"), [
    (["--tokenizer", "/nonexistent"], "tokenizer: tokenizer directory '/nonexistent'"),
    (["--listen", "nowhere"], "listen must be HOST:PORT"),
    (["--route-retries", "-1"], "route_retries must be >= 0"),
    (["--coordinator", ""], "coordinator:"),
    (["--max-context", "0"], "max_context must be >= 1"),
    (["--drain-wait-ms", "0"], "drain_wait_ms must be > 0"),
    (["--metrics-port", "70000"], "metrics_port out of range"),
    (["--model", ""], "model must not be empty"),
    (["--metrics-host", ""], "metrics_host must not be empty"),
    (["--metrics-port", "0", "--metrics-host", "203.0.113.5"],
     "cannot serve /metrics on 203.0.113.5:0 (--metrics-host, --metrics-port): "
     "Cannot assign requested address"),
])
def test_kvcoord_gateway_refuses_bad_settings_in_one_line(flags: list[str], says: str) -> None:
    assert_refused_in_one_line("gateway", flags, says)


def answers_metrics(host: str, port: int) -> bool:
    """Whether ``host:port`` serves the gateway's ``/metrics`` (False: connection refused)."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as response:
            return b"kvcoord_gateway_requests_total" in response.read()
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ConnectionRefusedError):
            return False
        raise


# 127.0.0.2 is this machine's loopback too (Linux routes 127/8 to lo), but a socket bound to
# 127.0.0.1 does not answer on it: one bound to 0.0.0.0 does.
@pytest.mark.parametrize(("settings", "served", "refused"), [
    ({"listen": "127.0.0.1:0"}, "127.0.0.1", "127.0.0.2"),
    ({"listen": "127.0.0.2:0"}, "127.0.0.2", "127.0.0.1"),
    ({"listen": "127.0.0.1:0", "metrics_host": "127.0.0.2"}, "127.0.0.2", "127.0.0.1"),
], ids=["listen-host", "other-listen-host", "metrics-host"])
async def test_metrics_bind_the_listen_host_unless_metrics_host_names_another(
    settings: dict[str, str], served: str, refused: str,
) -> None:
    gateway, client = await start_gateway(GatewayConfig(
        coordinator="127.0.0.1:1", metrics_port=0, **settings))
    try:
        assert gateway.metrics_port is not None
        assert await asyncio.to_thread(answers_metrics, served, gateway.metrics_port)
        assert not await asyncio.to_thread(answers_metrics, refused, gateway.metrics_port)
    finally:
        await gateway.stop()
        await client.close()


async def test_with_auth_on_each_client_is_itself_everywhere(tmp_path: Path) -> None:
    """The client's token goes to the coordinator (its role, its tenant's keys) and to the
    worker (its tenant's cache): two tenants never share cached pages; no token, a wrong one or
    a role that may not route is refused."""
    ids = write_identities(tmp_path)
    async with running_fleet(ids, tmp_path) as running:
        cached: dict[str, list[int]] = {}
        for name in ("sched-a", "sched-b", "sched-a"):
            api = AsyncOpenAI(base_url=f"{running.url}/v1", api_key=ids.tokens[name],
                              max_retries=0)
            answer = await api.chat.completions.create(model=MODEL, messages=FIRST,
                                                       max_tokens=2)
            await api.close()
            assert answer.usage is not None
            cached.setdefault(name, []).append(answer.usage.prompt_tokens_details.cached_tokens)
            await eventually(lambda: _settled(running, ids.tokens["admin"]),
                             what="the route reported finished")
        assert cached["sched-a"][0] == 0 and cached["sched-b"] == [0]
        assert cached["sched-a"][1] > 0  # a's own pages, on the worker a was routed to before
        for token, error, status in [("wrong-token-0123456789abcdef",
                                      openai.AuthenticationError, 401),
                                     (ids.tokens["trainer"], openai.PermissionDeniedError, 403)]:
            api = AsyncOpenAI(base_url=f"{running.url}/v1", api_key=token, max_retries=0)
            with pytest.raises(error) as refused:
                await api.completions.create(model=MODEL, prompt="hi", max_tokens=1)
            await api.close()
            assert refused.value.status_code == status
        async with aiohttp.ClientSession() as session, session.post(
                f"{running.url}/v1/completions", json={"model": MODEL, "prompt": "hi"}) as r:
            assert r.status == 401
            assert (await r.json())["error"]["type"] == "authentication_error"


async def test_a_request_during_a_sync_update_waits_and_runs_at_the_new_version(
    fleet: Fleet,
) -> None:
    async with AsyncCoordinatorClient(target(fleet.coordinator)) as trainer, \
            fleet.client() as api:
        await trainer.begin_policy_update(0)  # sync: the fleet drains
        waiting = asyncio.ensure_future(api.completions.with_raw_response.create(
            model=MODEL, prompt="asked mid-update", max_tokens=2))
        state = await trainer.commit_policy_update(1, timeout=10)
        raw = await asyncio.wait_for(waiting, 15)
    assert state.version == 1 and sorted(state.acked_workers) == ["w0", "w1"]
    assert raw.headers["x-kvcoord-policy-version"] == "1"
    assert raw.parse().choices[0].finish_reason == "length"


def sample(fleet: Fleet, name: str, **labels: str) -> float:
    value = fleet.gateway.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_metrics_count_requests_latencies_cached_tokens_and_the_version(
    fleet: Fleet,
) -> None:
    async with fleet.client() as api:
        raw = await api.chat.completions.with_raw_response.create(
            model=MODEL, messages=FIRST, max_tokens=3)
        stream = await api.completions.create(model=MODEL, prompt="metered", max_tokens=40,
                                              stream=True, stream_options={"include_usage": True})
        _ = [chunk async for chunk in stream]
        with pytest.raises(openai.NotFoundError):
            await api.completions.create(model="nope", prompt="x", max_tokens=1)
    worker = raw.headers["x-kvcoord-worker"]
    assert sample(fleet, "kvcoord_gateway_requests_total", endpoint="/v1/chat/completions",
                  status="200") == 1
    assert sample(fleet, "kvcoord_gateway_requests_total", endpoint="/v1/completions",
                  status="200") == 1
    assert sample(fleet, "kvcoord_gateway_requests_total", endpoint="/v1/completions",
                  status="404") == 1
    prompt = len(reference_tokenizer().encode_chat(FIRST)) + len(
        reference_tokenizer().encode("metered"))
    assert sample(fleet, "kvcoord_gateway_prompt_tokens_total") == prompt
    assert sample(fleet, "kvcoord_gateway_tokenizer_drift_total") == 0
    assert sample(fleet, "kvcoord_gateway_time_to_first_byte_seconds_count", worker=worker) >= 1
    assert sum(sample(fleet, "kvcoord_gateway_inter_token_seconds_count", worker=w.worker_id)
               for w in fleet.workers) > 0  # how many: as the network coalesces chunks
    assert sample(fleet, "kvcoord_gateway_policy_version") == 0
    assert sample(fleet, "process_cpu_seconds_total") > 0


async def test_a_tokenizer_that_is_not_the_engines_is_counted_as_drift(
    fleet: Fleet, tmp_path: Path,
) -> None:
    other = tmp_path / "other-template"
    shutil.copytree(REFERENCE_TOKENIZER, other)
    (other / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    async with running_gateway(target(fleet.coordinator), tokenizer=str(other)) as gateway:
        api = AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="unused",
                          max_retries=0)
        await api.chat.completions.create(model=MODEL, messages=FIRST, max_tokens=1)
        await api.close()
        assert gateway.metrics.registry.get_sample_value(
            "kvcoord_gateway_tokenizer_drift_total") == 1


async def test_a_client_leaving_the_gateway_mid_stream_stops_the_workers_generation(
    fleet: Fleet,
) -> None:
    body = {"model": MODEL, "prompt": "leave me halfway", "max_tokens": 250, "stream": True}
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{fleet.url}/v1/completions", json=body)
        await response.content.readline()
        worker = {w.worker_id: w for w in fleet.workers}[response.headers["x-kvcoord-worker"]]
        response.close()  # the client goes away
    await asyncio.wait_for(worker.gate.wait_idle(), 5)
    assert worker.gate.totals.requests == 0  # stopped, not run to its 250th token


async def test_a_worker_killed_mid_stream_fails_that_stream_and_the_next_goes_elsewhere(
    fleet: Fleet,
) -> None:
    http_port = free_port()
    victim = child_process.start(
        [str(Path(sys.executable).parent / "kvcoord"), "worker", "--coordinator",
         target(fleet.coordinator), "--listen", "127.0.0.1:0", "--worker-id", "victim",
         "--device", "cpu", "--page-size", str(PAGE), "--http-listen", f"127.0.0.1:{http_port}",
         "--log-level", "warning"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "KVCOORD_MAX_NEW_TOKENS": "512", "KVCOORD_HEARTBEAT_MS": "200"})
    prompt = "Only the victim holds this prompt. " * 8
    try:
        async def serving() -> bool:
            async with AsyncCoordinatorClient(target(fleet.coordinator)) as client:
                return "victim" in [w.worker_id for w in await client.workers()
                                    if w.state == "ready"]

        await eventually(serving, timeout=60, what="the victim worker registered")
        direct = AsyncOpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused",
                             max_retries=0)
        await direct.completions.create(model=MODEL, prompt=prompt, max_tokens=1)  # its cache
        await direct.close()

        async def indexed() -> bool:
            async with AsyncCoordinatorClient(target(fleet.coordinator)) as client:
                found = await client.lookup(reference_tokenizer().encode(prompt))
            return "victim" in found.matches and await _settled(fleet)

        await eventually(indexed, what="the victim's pages indexed")
        async with fleet.client() as api:
            raw = await api.completions.with_raw_response.create(
                model=MODEL, prompt=prompt, max_tokens=400, stream=True)
            assert raw.headers["x-kvcoord-worker"] == "victim"
            chunks = raw.parse()
            await anext(aiter(chunks))
            victim.kill()  # the worker dies under the stream
            with pytest.raises(openai.APIError):
                async for _ in chunks:
                    pass
            after = await api.completions.with_raw_response.create(
                model=MODEL, prompt=prompt, max_tokens=2)
        assert after.headers["x-kvcoord-worker"] in ("w0", "w1")
    finally:
        victim.kill()
        victim.wait(10)
