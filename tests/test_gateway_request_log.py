"""Every API request through ``kvcoord gateway`` gets exactly one ``gateway.request`` log line,
however it ends: answered, refused, cut by the client mid-answer; and a client that closes
after the last chunk, before the stream's end, is not an error (its line says so).

Against the real fleet of tests/test_gateway.py (a coordinator, two reference workers, the
gateway in this process, its log captured with structlog's own capture)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import structlog
from aiohttp import web

from kvcoord.gateway import server
from tests.test_gateway import MODEL, Fleet, running_fleet


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    async with running_fleet() as running:
        yield running


def request_lines(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [entry for entry in logs if entry["event"] == "gateway.request"]


async def test_every_request_gets_one_line_with_its_outcome(fleet: Fleet) -> None:
    chat = {"model": MODEL, "max_tokens": 4, "stream": True,
            "messages": [{"role": "user", "content": "where do my pages live?"}]}
    with structlog.testing.capture_logs() as logs:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{fleet.url}/v1/chat/completions", json=chat) as answer:
                assert answer.status == 200
                await answer.read()
            async with session.post(f"{fleet.url}/v1/completions", json={
                    "model": MODEL, "prompt": "one", "max_tokens": 2}) as answer:
                assert answer.status == 200
            async with session.post(f"{fleet.url}/v1/completions", json={
                    "model": MODEL, "prompt": "two", "max_tokens": "many"}) as answer:
                assert answer.status == 400
            async with session.post(f"{fleet.url}/v1/completions", json={
                    "model": "no-such-model", "prompt": "three", "max_tokens": 2}) as answer:
                assert answer.status == 404
            leaving = await session.post(f"{fleet.url}/v1/completions", json={
                "model": MODEL, "prompt": "leave me halfway", "max_tokens": 250,
                "stream": True})
            await leaving.content.readline()
            leaving.close()  # the client goes away mid-answer
            await asyncio.sleep(0)
        lines = request_lines(logs)
        for _ in range(100):  # the cut request's line is written as its handler unwinds
            if len(lines) == 5:
                break
            await asyncio.sleep(0.05)
            lines = request_lines(logs)
    assert [(e["path"], e["status"], e["outcome"]) for e in lines] == [
        ("/v1/chat/completions", 200, "ok"), ("/v1/completions", 200, "ok"),
        ("/v1/completions", 400, "refused"), ("/v1/completions", 404, "refused"),
        ("/v1/completions", 499, "client_gone")]
    answered = lines[:2] + lines[4:]
    assert all({"request_id", "worker", "matched_tokens", "prompt_tokens", "policy_version",
                "ms"} <= set(e) for e in answered), answered
    assert all("worker" not in e for e in lines[2:4])  # refused before any route


async def test_a_client_closing_after_the_last_chunk_is_no_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A stream whose client has all it asked for and resets the connection before the
    stream's end: ``_end_stream`` marks the line and raises nothing (it raised
    ClientConnectionResetError at write_eof before)."""
    last_chunk_sent, may_end = asyncio.Event(), asyncio.Event()
    ended: dict[str, Any] = {}

    async def stream(request: web.Request) -> web.StreamResponse:
        request[server.LINE] = {}
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: [DONE]\n\n")
        last_chunk_sent.set()
        await may_end.wait()
        try:
            await server._end_stream(request, response)
            ended.update(request[server.LINE], raised=None)
        except Exception as exc:  # what the test is about: nothing may reach here
            ended["raised"] = repr(exc)
        return response

    app = web.Application()
    app.router.add_get("/stream", stream)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        received = b""
        while b"[DONE]" not in received:
            received += await reader.read(1024)
        await last_chunk_sent.wait()
        raw = writer.get_extra_info("socket")
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        writer.close()  # a reset, not a clean close: the stream's end has nowhere to go
        await asyncio.sleep(0.2)
        may_end.set()
        for _ in range(100):
            if ended:
                break
            await asyncio.sleep(0.02)
    finally:
        await runner.cleanup()
    assert ended == {"outcome": "client_closed_at_end", "raised": None}
