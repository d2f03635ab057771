"""``GatewayServer``: the OpenAI-compatible front door (``kvcoord gateway``).

Per request: the body is checked as the engines check it (``worker.http_api.openai_requests``:
known fields of the wrong type are refused, unknown ones pass), the prompt is tokenized exactly
as the engine does (``worker.text``: the chat template as Hugging Face renders it), the token
ids are routed (``Route``; several completion prompts with one ``RouteBatch``) under the
client's own bearer token, and the client's body goes unchanged to the chosen worker's OpenAI
endpoint (its registered ``http_url``) with the client's token; the answer, streamed or not,
is passed back as it arrives. A worker that refuses the connection or fails before its first
byte is routed around (``route_retries`` more tries, excluding it); after the first byte the
client gets what the worker sent. Responses carry ``x-kvcoord-worker``,
``x-kvcoord-policy-version`` and ``x-request-id`` (the client's, or a new one). A client that
goes away closes the upstream request, which stops the worker's generation.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import structlog
from aiohttp import web

from coordinator.client.types import Route
from kvcoord.gateway import fanout
from kvcoord.gateway.config import GatewayConfig
from kvcoord.gateway.metrics import GatewayMetrics, Observation
from kvcoord.gateway.requests import RequestReader
from kvcoord.gateway.routing import BASE_SCOPE, RequestScope, RouteFinder, RouteLedger
from worker.http_api.openai_requests import CompletionRequest, OpenAIError
from worker.http_api.serving import (
    Handler,
    bind_http,
    common_refusal,
    json_body,
    openai_errors,
)
from worker.text.tokenizer import TextTokenizer

if TYPE_CHECKING:
    from coordinator.server.main import RunningCoordinator

log = structlog.get_logger(__name__)

STARTED = web.RequestKey("started", float)
"""When the request arrived (``time.perf_counter``), for its latency metrics."""
LINE = web.RequestKey("line", dict)
"""What the handler learned of a request (worker, route, outcome...): the fields of its one
``gateway.request`` log line, which the middleware writes however the request ends."""
# Outcomes of a request, as its log line names them.
OK, REFUSED, CLIENT_GONE, CLIENT_CLOSED_AT_END, WORKER_FAILED = (
    "ok", "refused", "client_gone", "client_closed_at_end", "worker_failed_mid_answer")
LOGGED_PREFIX = "/v1/"  # /livez, /readyz and /metrics scrapes are counted, not logged
# Headers of the worker's answer that are the transport's business, not the client's.
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive",
                "content-encoding", "date", "server"}


def served_version(upstream: aiohttp.ClientResponse, route: Route) -> int:
    """The weight version that made an answer: what a bridged engine's proxy confirmed
    (``x-kvcoord-policy-version``), else the version the route was chosen at."""
    confirmed = upstream.headers.get("x-kvcoord-policy-version", "")
    return int(confirmed) if confirmed.isdigit() else route.policy_version


def _counted(metrics: GatewayMetrics) -> Any:
    """A middleware counting every answer by endpoint and status (a client gone: 499), and
    writing each API request's one ``gateway.request`` line, however it ended: answered,
    refused, or cut by the client or the worker (the handler's ``LINE`` fields)."""

    @web.middleware
    async def count(request: web.Request, handler: Handler) -> web.StreamResponse:
        request[STARTED] = time.perf_counter()
        line: dict[str, Any] = {}
        request[LINE] = line
        endpoint = request.match_info.route.resource.canonical if (
            request.match_info.route.resource is not None) else "unknown"
        status = 499
        try:
            response = await handler(request)
            status = response.status
            return response
        finally:
            if line.get("outcome") == CLIENT_GONE:
                status = 499  # answered in part: what the client got is not an answer
            metrics.requests.labels(endpoint, str(status)).inc()
            if endpoint.startswith(LOGGED_PREFIX):
                outcome = line.pop("outcome", None) or (
                    CLIENT_GONE if status == 499 else OK if status < 400 else REFUSED)
                log.info("gateway.request", path=endpoint, status=status, outcome=outcome,
                         ms=round((time.perf_counter() - request[STARTED]) * 1000, 1), **line)

    return count


class GatewayServer:
    """See the module docstring; ``start`` binds, ``stop`` closes."""

    def __init__(self, config: GatewayConfig, routes: RouteFinder, tokenizer: TextTokenizer,
                 readiness: Callable[[], Awaitable[str | None]],
                 metrics: GatewayMetrics | None = None,
                 embedded: RunningCoordinator | None = None) -> None:
        """``readiness()``: None when requests can be served, else why not. ``embedded``: the
        coordinator running in this process (``--embed-coordinator``), stopped last by
        ``stop``."""
        self.metrics = metrics or GatewayMetrics()
        self.embedded = embedded
        self._config = config
        self._routes = routes
        self._readiness = readiness
        self._tokenizer = tokenizer
        self._reader = RequestReader(config, tokenizer)
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.metrics_port: int | None = None
        app = web.Application(client_max_size=config.max_body_bytes,
                              middlewares=[_counted(self.metrics), openai_errors(common_refusal)])
        app.router.add_get("/livez", self._livez)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        self.app = app

    async def start(self) -> int:
        """Serve on ``config.listen``; returns the bound port."""
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self._config.upstream_timeout_ms / 1000,
                                          sock_connect=self._config.connect_timeout_ms / 1000),
            auto_decompress=False)
        # NOTE: handler_cancellation: a client that goes away cancels its handler, whose
        # ``finally`` releases the worker's answer, closing that request (its generation stops).
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=self._config.shutdown_grace_ms / 1000)
        await self._runner.setup()
        sock = bind_http(self._config.listen)
        self.port = int(sock.getsockname()[1])
        await web.SockSite(self._runner, sock).start()
        log.info("gateway.serving", listen=self._config.listen, port=self.port,
                 coordinator=self._config.embed_coordinator or self._config.coordinator,
                 embedded=self.embedded is not None, model=self._config.model,
                 tokenizer=self._tokenizer.source, max_context=self._reader.max_context)
        return self.port

    async def stop(self) -> None:
        """Stop accepting; requests in flight get ``shutdown_grace_ms`` to finish."""
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
        await self._routes.ends.flush()
        if self.embedded is not None:  # last: the ends above went to it
            await self.embedded.stop()

    # ------------------------------------------------------------------ endpoints

    async def _livez(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, request: web.Request) -> web.Response:
        why = await self._readiness()
        if why is None:
            return web.json_response({"status": "ready"})
        return web.json_response({"status": "unready", "reason": why}, status=503)

    async def _models(self, request: web.Request) -> web.Response:
        base = {"id": self._config.model, "object": "model", "created": 0, "owned_by": "kvcoord",
                "max_model_len": self._reader.max_context}
        adapters = [{**base, "id": name, "parent": self._config.model}
                    for name in self._config.adapters]  # as vLLM lists its LoRA modules
        return web.json_response({"object": "list", "data": [base, *adapters]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        read = self._reader.chat(json_body(raw))
        return await self._forward(request, "chat/completions", raw, read.prompts[0],
                                   read.scope)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        read = self._reader.completion(json_body(raw))
        assert read.completion is not None  # a completion's read keeps its request
        if len(read.prompts) == 1:
            return await self._forward(request, "completions", raw, read.prompts[0],
                                       read.scope)
        return await self._forward_many(request, read.completion, read.prompts, read.scope)

    # ------------------------------------------------------------------ forwarding

    def _token(self, request: web.Request) -> str | None:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        return token.strip() if scheme.lower() == "bearer" and token.strip() else None

    async def _forward(self, request: web.Request, path: str, raw: bytes,
                       prompt: list[int], scope: RequestScope) -> web.StreamResponse:
        """Route ``prompt`` (in the namespace ``scope`` names) and pass the
        client's ``raw`` body to the worker's ``path``; the request's routes end however it
        ends. OpenAIError for a route refused (or no worker answering)."""
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        request[LINE]["request_id"] = request_id
        token = self._token(request)
        ledger = self._routes.ledger(token)
        try:
            return await self._forward_one(request, path, raw, prompt, token, request_id, ledger,
                                           scope)
        finally:
            ledger.close()

    async def _forward_one(self, request: web.Request, path: str, raw: bytes,
                           prompt: list[int], token: str | None, request_id: str,
                           ledger: RouteLedger, scope: RequestScope) -> web.StreamResponse:
        upstream, route = await self._open_upstream(path, raw, prompt, token, request_id, ledger,
                                                    started=request[STARTED], scope=scope)
        version = served_version(upstream, route)
        self.metrics.policy_version.set(version)
        request[LINE].update(worker=route.worker_id, route_id=route.route_id,
                             policy_version=version, matched_tokens=route.matched_tokens,
                             prompt_tokens=len(prompt), upstream_status=upstream.status)
        streamed = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
        seen = Observation(self.metrics, route.worker_id, request[STARTED], len(prompt),
                           streamed=streamed)
        try:
            headers = {k: v for k, v in upstream.headers.items()
                       if k.lower() not in _HOP_HEADERS and not k.lower().startswith("x-kvcoord")}
            headers.update({"x-request-id": request_id, "x-kvcoord-worker": route.worker_id,
                            "x-kvcoord-policy-version": str(version),
                            "x-kvcoord-route-id": route.route_id})
            response = web.StreamResponse(status=upstream.status, headers=headers)
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():  # as it arrives, never buffered
                    seen.chunk(chunk)
                    await response.write(chunk)
            except ConnectionResetError:  # the client went away mid-answer (499)
                request[LINE]["outcome"] = CLIENT_GONE
                return response
            except (aiohttp.ClientError, TimeoutError) as exc:
                # After the first byte there is no routing around: the client must see the
                # answer fail, so the connection is cut rather than the stream ended cleanly.
                log.warning("gateway.worker_failed_mid_answer", worker=route.worker_id,
                            request_id=request_id, error=str(exc) or type(exc).__name__)
                request[LINE]["outcome"] = WORKER_FAILED
                if request.transport is not None:
                    request.transport.close()
                return response
            seen.end(upstream.status)
            request[LINE]["cached_tokens"] = seen.cached_tokens
            await _end_stream(request, response)
            return response
        finally:
            upstream.release()  # a client gone mid-stream closes the worker's request too

    async def _open_upstream(self, path: str, raw: bytes, prompt: list[int],
                             token: str | None, request_id: str, ledger: RouteLedger,
                             first: Route | None = None, started: float | None = None,
                             scope: RequestScope = BASE_SCOPE
                             ) -> tuple[aiohttp.ClientResponse, Route]:
        """The worker's answer, its status and headers read (nothing of the body yet), and
        the route that chose it (``first``, when given, is tried before routing). The time from
        ``started`` (the request's arrival; now when None) to each upstream send is the
        gateway's added latency. Workers that
        cannot be reached, have no HTTP endpoint or fail with a 5xx before any byte are routed
        around, ``route_retries`` times; their routes end at once (``ledger``)."""
        assert self._session is not None, "start() first"
        excluded: list[str] = []
        started = time.perf_counter() if started is None else started
        headers = {"Content-Type": "application/json", "x-request-id": request_id}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        for _ in range(1 + self._config.route_retries):
            route = first or await self._routes.route(prompt, token, excluded, scope)
            first = None
            ledger.issued([route])
            if not route.http_url:
                ledger.end(route)
                excluded.append(route.worker_id)
                continue
            self.metrics.added.observe(time.perf_counter() - started)
            try:
                upstream = await self._session.post(f"{route.http_url}/v1/{path}", data=raw,
                                                    headers=headers)
            except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                self.metrics.retries.inc()
                log.warning("gateway.worker_failed", worker=route.worker_id,
                            request_id=request_id, error=str(exc) or type(exc).__name__)
                ledger.end(route)
                excluded.append(route.worker_id)
                continue
            if upstream.status in (502, 503, 504):
                self.metrics.retries.inc()
                upstream.release()
                ledger.end(route)
                excluded.append(route.worker_id)
                continue
            return upstream, route
        raise OpenAIError(503, f"no worker answered (tried {', '.join(excluded) or 'none'})",
                          type="server_error", code="no_worker", headers={"Retry-After": "1"})

    async def _forward_many(self, request: web.Request, parsed: CompletionRequest,
                            prompts: list[list[int]], scope: RequestScope
                            ) -> web.StreamResponse:
        """Several completion prompts: routed with one RouteBatch; each worker gets its share
        (the body with only its prompts), and the choices come back merged by index
        (``fanout``): as one answer, or one stream after another."""
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        request[LINE].update(request_id=request_id, prompts=len(prompts),
                             prompt_tokens=sum(len(p) for p in prompts))
        token = self._token(request)
        routes = await self._routes.route_batch(prompts, token, scope)
        ledger = self._routes.ledger(token)
        ledger.issued(routes)
        shares = fanout.shares(parsed, routes)
        opened = []
        try:
            for share in shares:
                raw = json.dumps({**parsed.body, "prompt": share.prompts}).encode()
                upstream, route = await self._open_upstream(
                    "completions", raw, prompts[share.indexes[0]], token, request_id, ledger,
                    first=share.route, scope=scope)
                opened.append((share, upstream, route))
            request[LINE].update(worker=",".join(r.worker_id for _, _, r in opened),
                                 matched_tokens=sum(r.matched_tokens for _, _, r in opened))
            headers = {"x-request-id": request_id,
                       "x-kvcoord-worker": ",".join(r.worker_id for _, _, r in opened),
                       "x-kvcoord-policy-version": ",".join(sorted(
                           {str(served_version(u, r)) for _, u, r in opened}))}
            failed = next((u for _, u, _ in opened if u.status != 200), None)
            if failed is not None:  # a refusal of one share is the answer to all
                return web.Response(status=failed.status, body=await failed.read(),
                                    headers={**headers, "Content-Type": "application/json"})
            n = parsed.sampling.n
            if not parsed.sampling.stream:
                answers = [(s, await u.json()) for s, u, _ in opened]
                return web.json_response(fanout.merged(answers, n), headers=headers)
            response = web.StreamResponse(headers={
                **headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            totals = fanout.StreamTotals()
            for share, upstream, _ in opened:
                async for line in upstream.content:
                    out = fanout.reindexed_line(line, share, n, totals)
                    if out:
                        await response.write(out)
            if parsed.sampling.include_usage and totals.usage:
                await response.write(fanout.usage_line(totals))
            await response.write(b"data: [DONE]\n\n")
            await _end_stream(request, response)
            return response
        finally:
            for _, upstream, _ in opened:
                upstream.release()
            ledger.close()


async def _end_stream(request: web.Request, response: web.StreamResponse) -> None:
    """End a streamed answer whose every byte was written. A client that closed its connection
    after the last chunk, before the stream's end (it had all it asked for), is not an error:
    its log line says so and nothing is raised."""
    try:
        await response.write_eof()
    except ConnectionResetError:
        request[LINE]["outcome"] = CLIENT_CLOSED_AT_END
