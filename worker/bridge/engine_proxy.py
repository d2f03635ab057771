"""The engine's OpenAI-compatible API, served by the bridge in front of the engine
(``--http-listen``), so that a bridged engine's answers are attributed exactly as a reference
worker's are.

- **Every answer says its version.** ``x-kvcoord-policy-version`` is the weight version the
  bridge confirmed (``/weight_info`` read back) when the request was forwarded.
- **That version is the one that made it.** A request is forwarded only while the gate is open;
  the policy driver closes it at DRAIN (or at an async APPLY), waits until every forwarded
  request is answered (``wait_idle``), and only then pauses the engine and changes its weights.
  A request arriving meanwhile waits here, not in the engine (which would run it under the new
  weights after it was counted under the old), and is forwarded once the gate opens again, at
  the new version.
- **A fenced engine answers nothing.** Every request, waiting or new, gets 503 with code
  ``engine_fenced`` (a gateway routes around it), until the bridge has brought the engine back
  to a consistent state.
- **Rollout records.** Each answered completion or chat completion becomes one ``Rollout``
  (``on_answer``): id from ``x-request-id`` (else the answer's ``id``), the version above, and
  ``usage`` (prompt, cached and completion tokens; a stream carries usage only when the client
  asked ``stream_options.include_usage``, and a stream without it is recorded with zeros).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from coordinator.core.rollout_records import Rollout

log = structlog.get_logger(__name__)

VERSION_HEADER = "x-kvcoord-policy-version"
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive",
                "content-encoding", "date", "server", "host"}
_GENERATING = ("/v1/completions", "/v1/chat/completions")
# Usage sits at the end of an answer; a stream's last events are kept to find it.
_TAIL_BYTES = 64 << 10
_MAX_JSON_BYTES = 16 << 20


class EngineProxy:
    """Forwards ``/v1/*`` and ``/health`` to ``engine_url`` (see the module docstring).

    ``version`` is the confirmed weight version; ``in_flight`` counts forwarded requests not
    yet answered. The gate starts closed: ``open`` it with the first confirmed version.
    """

    def __init__(self, engine_url: str, *, worker_id: str,
                 on_answer: Callable[[Rollout], None]) -> None:
        self.engine_url = engine_url.rstrip("/")
        self.worker_id = worker_id
        self.version = 0
        self.in_flight = 0
        self.fenced_reason: str | None = None
        self._on_answer = on_answer
        self._gate = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._changed = asyncio.Event()  # set on every open/fence, to wake waiting requests
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self, host: str, port: int) -> None:
        """Listen on ``host:port``."""
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        app = web.Application(client_max_size=_MAX_JSON_BYTES)
        app.router.add_route("*", "/v1/{tail:.*}", self._forward)
        app.router.add_get("/health", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ------------------------------------------------------------------ the gate

    @property
    def is_open(self) -> bool:
        return self._gate.is_set()

    def close(self) -> None:
        """Hold new requests here (those already forwarded go on)."""
        self._gate.clear()

    def open(self, version: int) -> None:
        """Forward again, tagging answers with ``version`` (the engine's confirmed one)."""
        self.version = version
        self.fenced_reason = None
        self._gate.set()
        self._wake()

    def fence(self, reason: str) -> None:
        """Refuse every request, waiting or new, with 503 until ``open``."""
        self.fenced_reason = reason
        self._gate.clear()
        self._wake()

    async def wait_idle(self) -> None:
        """Return once no forwarded request is waiting for its answer."""
        await self._idle.wait()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # ------------------------------------------------------------------ forwarding

    async def _admit(self) -> web.Response | None:
        """Wait for the gate; a 503 answer when the engine is (or becomes) fenced."""
        while not self._gate.is_set():
            if self.fenced_reason is not None:
                return _fenced(self.fenced_reason)
            await self._changed.wait()
        return None

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        refused = await self._admit()
        if refused is not None:
            return refused
        version = self.version
        self.in_flight += 1
        self._idle.clear()
        try:
            return await self._relay(request, version)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def _relay(self, request: web.Request, version: int) -> web.StreamResponse:
        assert self._session is not None, "start() first"
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        try:
            upstream = await self._session.request(
                request.method, f"{self.engine_url}{request.rel_url}", data=body or None,
                headers=headers)
        except aiohttp.ClientError as exc:
            return web.json_response(_error(f"engine unreachable: {exc}", "engine_unreachable"),
                                     status=502)
        try:
            out_headers = {k: v for k, v in upstream.headers.items()
                           if k.lower() not in _HOP_HEADERS}
            out_headers[VERSION_HEADER] = str(version)
            response = web.StreamResponse(status=upstream.status, headers=out_headers)
            await response.prepare(request)
            generating = request.path in _GENERATING and upstream.status == 200
            kept = bytearray()
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
                if generating:
                    kept += chunk
                    if len(kept) > _MAX_JSON_BYTES:
                        del kept[:-_TAIL_BYTES]
            await response.write_eof()
        finally:
            upstream.release()
        if generating:
            rollout_id = request.headers.get("x-request-id", "")
            self._on_answer(self._rollout(bytes(kept), rollout_id, version))
        return response

    def _rollout(self, answer: bytes, rollout_id: str, version: int) -> Rollout:
        usage, answer_id = _usage_of(answer)
        details = usage.get("prompt_tokens_details") or {}
        prompt = int(usage.get("prompt_tokens") or 0)
        return Rollout(
            rollout_id=rollout_id or answer_id or uuid.uuid4().hex, policy_version=version,
            worker_id=self.worker_id, prompt_tokens=prompt,
            cached_tokens=min(prompt, int(details.get("cached_tokens") or 0)),
            completion_tokens=int(usage.get("completion_tokens") or 0))


def _usage_of(answer: bytes) -> tuple[dict[str, Any], str]:
    """``(usage, id)`` of a JSON answer or of an SSE stream's last event that has usage."""
    text = answer.decode(errors="replace").strip()
    if not text.startswith("data:") and not text.startswith(":"):
        try:
            body = json.loads(text)
        except ValueError:
            return {}, ""
        return (body.get("usage") or {}, str(body.get("id") or "")) if isinstance(body, dict) \
            else ({}, "")
    usage: dict[str, Any] = {}
    answer_id = ""
    for line in text.splitlines():
        if not line.startswith("data:") or line.strip() == "data: [DONE]":
            continue
        try:
            event = json.loads(line[5:])
        except ValueError:
            continue
        if isinstance(event, dict):
            answer_id = answer_id or str(event.get("id") or "")
            usage = event.get("usage") or usage
    return usage, answer_id


def _error(message: str, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "server_error", "code": code}}


def _fenced(reason: str) -> web.Response:
    return web.json_response(_error(f"this engine is fenced: {reason}", "engine_fenced"),
                             status=503, headers={"Retry-After": "1"})
