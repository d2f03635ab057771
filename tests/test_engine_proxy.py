"""The bridge's proxy in front of an engine (``worker.bridge.engine_proxy``): requests wait while
the gate is closed and run at the version it reopens with, a fence answers 503 to waiting and new
requests alike, ``wait_idle`` waits for forwarded requests, and each answered completion becomes
a rollout record with the answer's usage. The upstream is a real HTTP server answering as vLLM's
OpenAI server does (a JSON completion, or an SSE stream with a final usage event)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from coordinator.core.rollout_records import Rollout
from kvcoord.fleet_procs import free_port
from worker.bridge.engine_proxy import VERSION_HEADER, EngineProxy

USAGE = {"prompt_tokens": 40, "completion_tokens": 3,
         "prompt_tokens_details": {"cached_tokens": 32}}


class Upstream:
    """An engine's OpenAI server: answers after ``release`` is set (to hold a request running)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.release.set()
        self.seen = 0

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.seen += 1
        body = await request.json()
        await self.release.wait()
        if not body.get("stream"):
            return web.json_response({"id": "cmpl-1", "choices": [{"text": "abc"}],
                                      "usage": USAGE})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"id": "cmpl-2", "choices": [{"text": "a"}]}\n\n')
        await response.write(b'data: {"id": "cmpl-2", "choices": [], "usage": '
                             + json.dumps(USAGE).encode() + b"}\n\ndata: [DONE]\n\n")
        await response.write_eof()
        return response


@pytest.fixture
async def proxied() -> AsyncIterator[tuple[EngineProxy, Upstream, list[Rollout], str]]:
    upstream = Upstream()
    app = web.Application()
    app.router.add_post("/v1/completions", upstream.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    engine_port, proxy_port = free_port(), free_port()
    await web.TCPSite(runner, "127.0.0.1", engine_port).start()
    records: list[Rollout] = []
    proxy = EngineProxy(f"http://127.0.0.1:{engine_port}", worker_id="vllm-0",
                        on_answer=records.append)
    await proxy.start("127.0.0.1", proxy_port)
    try:
        yield proxy, upstream, records, f"http://127.0.0.1:{proxy_port}"
    finally:
        await proxy.stop()
        await runner.cleanup()


async def _post(url: str, body: dict[str, object], request_id: str = "r1"
                ) -> tuple[int, str, str]:
    async with aiohttp.ClientSession() as session, session.post(
            f"{url}/v1/completions", json=body, headers={"x-request-id": request_id}) as answer:
        return answer.status, answer.headers.get(VERSION_HEADER, ""), await answer.text()


async def test_requests_wait_while_closed_and_run_at_the_version_it_reopens_with(
    proxied: tuple[EngineProxy, Upstream, list[Rollout], str],
) -> None:
    proxy, upstream, records, url = proxied
    proxy.open(0)
    assert (await _post(url, {"prompt": [1]}, "before"))[:2] == (200, "0")
    proxy.close()
    waiting = asyncio.create_task(_post(url, {"prompt": [1]}, "during"))
    await asyncio.sleep(0.3)
    assert not waiting.done() and upstream.seen == 1  # held in the bridge, not the engine
    proxy.open(1)
    status, version, _ = await asyncio.wait_for(waiting, 5)
    assert (status, version) == (200, "1")
    assert [(r.rollout_id, r.policy_version) for r in records] == [("before", 0), ("during", 1)]
    assert records[1] == Rollout("during", 1, "vllm-0", prompt_tokens=40, cached_tokens=32,
                                 completion_tokens=3)


async def test_a_fence_refuses_waiting_and_new_requests_with_503(
    proxied: tuple[EngineProxy, Upstream, list[Rollout], str],
) -> None:
    proxy, upstream, records, url = proxied
    waiting = asyncio.create_task(_post(url, {"prompt": [1]}))  # the gate starts closed
    await asyncio.sleep(0.2)
    proxy.fence("load: no such file")
    status, _, body = await asyncio.wait_for(waiting, 5)
    assert status == 503 and "engine_fenced" in body and "no such file" in body
    assert (await _post(url, {"prompt": [1]}))[0] == 503
    assert upstream.seen == 0 and records == []


async def test_wait_idle_returns_only_when_forwarded_requests_are_answered(
    proxied: tuple[EngineProxy, Upstream, list[Rollout], str],
) -> None:
    proxy, upstream, records, url = proxied
    proxy.open(2)
    upstream.release.clear()
    running = asyncio.create_task(_post(url, {"prompt": [1], "stream": True}, "streamed"))
    while upstream.seen == 0:
        await asyncio.sleep(0.02)
    proxy.close()
    idle = asyncio.create_task(proxy.wait_idle())
    await asyncio.sleep(0.2)
    assert not idle.done() and proxy.in_flight == 1
    upstream.release.set()
    await asyncio.wait_for(idle, 5)
    assert (await running)[:2] == (200, "2")
    assert records == [Rollout("streamed", 2, "vllm-0", 40, 32, 3)]
