"""The reference worker's OpenAI-compatible endpoint (``--http-listen``), driven by the official
``openai`` client against a real worker (and coordinator): completions and chat, streamed chunk by
chunk, several prompts and ``n``, cached tokens in ``usage``, the ids the shipped tokenizer
gives, every refusal as OpenAI JSON, credentials as on gRPC, and a client that goes away
stopping its generation."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import openai
import pytest
from openai import AsyncOpenAI

from coordinator.client import AsyncCoordinatorClient
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from kvcoord import child_process
from tests.auth_fixtures import write_identities
from tests.coordinator_fixtures import DEV_HASH, running_coordinator, target
from worker.config import ConfigError, WorkerConfig
from worker.main import RunningWorker, start_worker
from worker.sync.sync_protocol import WorkerIdentity, register_request
from worker.text.tokenizer import reference_tokenizer

PAGE = 16
MODEL = "default"


async def _worker(coordinator: str, **overrides: Any) -> RunningWorker:
    settings = {"listen": "127.0.0.1:0", "pages": 256, "page_size": PAGE, "device": "cpu",
                "worker_id": "w0", "max_new_tokens": 256, "http_listen": "127.0.0.1:0",
                **overrides}
    config = WorkerConfig(coordinator=coordinator, **settings)
    running = await start_worker(config)
    await asyncio.wait_for(running.agent.synced.wait(), 10)
    return running


@pytest.fixture
async def worker() -> AsyncIterator[RunningWorker]:
    async with running_coordinator(page_size=PAGE) as coord:
        running = await _worker(target(coord))
        try:
            yield running
        finally:
            await running.stop(0.5)


def base_url(worker: RunningWorker) -> str:
    return f"http://127.0.0.1:{worker.http_port}/v1"


def client(worker: RunningWorker, api_key: str = "unused") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=base_url(worker), api_key=api_key, max_retries=0)


CHAT = [{"role": "system", "content": "You route prompts."},
        {"role": "user", "content": "Which worker holds my prefix? " * 8}]


async def test_a_chat_turn_is_answered_and_its_repeat_is_served_from_the_cache(
    worker: RunningWorker,
) -> None:
    async with client(worker) as api:
        first = await api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5)
        again = await api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5)
    prompt = reference_tokenizer().encode_chat(CHAT)
    assert first.usage is not None and again.usage is not None
    assert first.usage.prompt_tokens == len(prompt) == again.usage.prompt_tokens
    assert first.usage.completion_tokens == 5
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # Every full page of the prompt is reused the second time.
    assert again.usage.prompt_tokens_details.cached_tokens == len(prompt) // PAGE * PAGE > 0
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].finish_reason == "length"
    assert first.choices[0].message.content == again.choices[0].message.content  # greedy
    assert first.object == "chat.completion" and first.model == MODEL


async def test_completions_take_several_prompts_and_n_copies_each(
    worker: RunningWorker,
) -> None:
    tokenizer = reference_tokenizer()
    async with client(worker) as api:
        answer = await api.completions.create(
            model=MODEL, prompt=["The index maps", "Workers hold pages"], n=2, max_tokens=3)
        ids = await api.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=2)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert answer.choices[0].text == answer.choices[1].text  # copies of one prompt, greedy
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == len(tokenizer.encode("The index maps")) + len(
        tokenizer.encode("Workers hold pages"))  # each prompt once, whatever n
    assert answer.usage.completion_tokens == 4 * 3
    assert ids.usage is not None and ids.usage.prompt_tokens == 4  # token ids taken as they are


async def test_a_stream_arrives_chunk_by_chunk_with_usage_last(worker: RunningWorker) -> None:
    async with client(worker) as api:
        whole = await api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40)
        stream = await api.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=40, stream=True,
            stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(texts) > 5  # token by token, not one buffered answer
    assert "".join(texts) == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 40


async def test_the_first_chunk_arrives_before_the_generation_ends(worker: RunningWorker) -> None:
    """Raw SSE: the first data line is read while the worker is still decoding."""
    body = {"model": MODEL, "prompt": "stream me", "max_tokens": 200, "stream": True}
    async with aiohttp.ClientSession() as session, \
            session.post(f"{base_url(worker)}/completions", json=body) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        first = await response.content.readline()
        assert first.startswith(b"data: {")
        assert worker.runtime.stats().running_requests == 1  # still generating
        rest = (await response.read()).decode()
    assert rest.rstrip().endswith("data: [DONE]")


async def test_a_client_that_goes_away_stops_its_generation(worker: RunningWorker) -> None:
    body = {"model": MODEL, "prompt": "a long answer", "max_tokens": 250, "stream": True}
    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{base_url(worker)}/completions", json=body)
        await response.content.readline()
        response.close()  # the client disconnects mid-stream
    gate = worker.gate
    await asyncio.wait_for(gate.wait_idle(), 5)  # the generation stopped, not ran to its end
    assert gate.totals.requests == 0  # nothing was answered or counted
    assert worker.runtime.stats().running_requests == 0
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(("path", "body", "status", "code"), [
    ("completions", b"{not json", 400, "invalid_json"),
    ("completions", {"model": MODEL, "prompt": 7}, 400, "invalid_type"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "invalid_type"),
    ("completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "invalid_type"),
    ("chat/completions", {"model": MODEL, "messages": "hi"}, 400, "invalid_type"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
     400, None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                          "stream": "yes"}, 400, "invalid_type"),
    ("completions", {"model": "other", "prompt": "x"}, 404, "model_not_found"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 5000}, 400,
     "context_length_exceeded"),
    ("completions", {"model": MODEL, "prompt": [9999]}, 400, None),
    ("nowhere", {}, 404, "not_found"),
])
async def test_refusals_are_openai_json_with_the_right_status(
    worker: RunningWorker, path: str, body: Any, status: int, code: str | None,
) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as session, session.post(
            f"{base_url(worker)}/{path}", data=data,
            headers={"Content-Type": "application/json"}) as response:
        answer = await response.json()
    assert response.status == status, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["message"]
    assert answer["error"]["code"] == code


async def test_unknown_fields_pass_and_a_body_over_the_limit_is_413(
    worker: RunningWorker,
) -> None:
    async with aiohttp.ClientSession() as session:
        ok = await session.post(f"{base_url(worker)}/completions", json={
            "model": MODEL, "prompt": "x", "max_tokens": 1, "top_k": 5, "repetition_penalty": 1.1,
            "temperature": 0.7, "stop": ["\n"], "seed": 3})
        assert ok.status == 200, await ok.text()
        big = await session.post(f"{base_url(worker)}/completions",
                                 data=b"x" * (9 * 1024 * 1024))
        assert big.status == 413
        assert (await big.json())["error"]["code"] == "body_too_large"
    async with client(worker) as api:
        models = await api.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_with_auth_on_the_endpoint_takes_the_grpc_credentials_and_tenants(
    tmp_path: Path,
) -> None:
    ids = write_identities(tmp_path)
    token_file = tmp_path / "w1.token"
    token_file.write_text(ids.tokens["w1"] + "\n")
    async with running_coordinator(page_size=PAGE, auth_file=str(ids.path)) as coord:
        running = await _worker(target(coord), auth_file=str(ids.path),
                                token_file=str(token_file), worker_id="w1")
        try:
            cached = {}
            for name in ("sched-a", "sched-b", "sched-a"):
                async with client(running, api_key=ids.tokens[name]) as api:
                    answer = await api.chat.completions.create(
                        model=MODEL, messages=CHAT, max_tokens=2)
                assert answer.usage is not None
                cached.setdefault(name, []).append(
                    answer.usage.prompt_tokens_details.cached_tokens)
            # Each tenant's pages are its own: b does not hit what a cached, a does.
            assert cached["sched-a"][0] == 0 and cached["sched-b"] == [0]
            assert cached["sched-a"][1] > 0
            async with client(running, api_key="wrong-token-0123456789abcdef") as api:
                with pytest.raises(openai.AuthenticationError) as refused:
                    await api.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert refused.value.status_code == 401
            async with aiohttp.ClientSession() as session, session.post(  # no token at all
                    f"{base_url(running)}/completions",
                    json={"model": MODEL, "prompt": "hi"}) as response:
                assert response.status == 401
                assert (await response.json())["error"]["type"] == "authentication_error"
            async with client(running, api_key=ids.tokens["w2"]) as api:
                with pytest.raises(openai.PermissionDeniedError):  # workers do not Generate
                    await api.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        finally:
            await running.stop(0.5)


def test_a_bad_http_listen_or_tokenizer_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"http_listen must be HOST:PORT, got 'nowhere'"):
        WorkerConfig(http_listen="nowhere")
    kvcoord = Path(sys.executable).parent / "kvcoord"
    for tokenizer, says in [(tmp_path / "missing", "does not exist"),
                            (tmp_path, "tokenizer.json: no such file")]:
        result = child_process.run(
            [str(kvcoord), "worker", "--coordinator", "127.0.0.1:1", "--listen", "127.0.0.1:0",
             "--device", "cpu", "--http-listen", "127.0.0.1:0", "--tokenizer", str(tokenizer)],
            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert result.returncode == 2, result.stderr[-2000:]
        assert result.stderr.startswith("kvcoord worker: tokenizer: ")
        assert says in result.stderr


async def test_the_worker_registers_its_http_url_and_routes_name_it(
    worker: RunningWorker,
) -> None:
    url = f"http://127.0.0.1:{worker.http_port}"
    async with AsyncCoordinatorClient(worker.config.coordinator) as coordinator:
        route = await coordinator.route(list(range(1, 40)))
        listed = await coordinator.workers()
    assert route.worker_id == "w0" and route.http_url == url
    assert [w.http_url for w in listed] == [url]


@pytest.mark.parametrize("url", ["ftp://h:1", "http://", "http://h:99999", "http://h/ x",
                                 "http://h/?q=1", "x" * 10])
async def test_a_register_with_a_bad_http_url_is_refused(url: str) -> None:
    async with running_coordinator(page_size=PAGE) as coord:
        identity = WorkerIdentity(worker_id="w9", address="h:1", model=MODEL, total_pages=8,
                                  hash_config=DEV_HASH, http_url=url)
        async with grpc.aio.insecure_channel(target(coord)) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await pb_grpc.CoordinatorStub(channel).Register(register_request(identity, 0))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "http_url" in (refused.value.details() or "")
