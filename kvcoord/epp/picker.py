"""``EndpointPicker``: the ``envoy.service.ext_proc.v3.ExternalProcessor`` service of ``kvcoord
epp``. One gRPC stream is one HTTP request passing through Envoy.

Per request: the headers are held (``BUFFERED``: answered at once, Envoy keeps the request
until its body's answer; ``FULL_DUPLEX_STREAMED``: answered with the body), the body is read
whole and checked, tokenized and scoped by the gateway's own ``RequestReader``, and routed by
its ``RouteFinder`` under the client's bearer token (a sync drain waited out, bounded, as the
gateway does; only engines at the serving version are candidates). The answer names the
engine's ``host:port`` in ``x-gateway-destination-endpoint`` and in ``envoy.lb`` dynamic
metadata; the body goes on unchanged. A refusal is an immediate answer in OpenAI's error shape
(400 malformed, 404 unknown model or path, 413 body over the limit, 429 shed, 503 no engine).
A request without a body (``GET /v1/models``) goes to the least busy engine at the serving
version. The route ends when the stream ends (Envoy closes it when the request is done, or
the client or Envoy goes away); when the address that served (``upstream.address``, sent as
a response attribute where Envoy is asked to) is not the one picked, that is counted and
logged. A stream that ends before its body is counted, never an error.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import structlog
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    ProcessingRequest,
    ProcessingResponse,
)
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorServicer
from grpc import aio

from coordinator.client import KvcoordError
from coordinator.client.types import Route, WorkerInfo
from kvcoord.epp import protocol
from kvcoord.epp.metrics import PickerMetrics
from kvcoord.gateway.requests import RequestReader
from kvcoord.gateway.routing import RouteFinder, RouteLedger, refusal_of
from worker.http_api.openai_requests import OpenAIError
from worker.text.tokenizer import ChatTemplateError, TokenizerError

log = structlog.get_logger(__name__)

Fleet = Callable[[str | None], Awaitable[tuple[list[WorkerInfo], int]]]
"""The workers and the serving version, asked under a caller's token."""


def endpoint_of(http_url: str) -> str:
    """``host:port`` of a worker's registered ``http_url`` (what Envoy connects to)."""
    parts = urlsplit(http_url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.hostname}:{port}"


def bearer(headers: dict[str, str]) -> str | None:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class EndpointPicker(ExternalProcessorServicer):  # type: ignore[misc]
    """See the module docstring. ``fleet(token)``: the workers and the serving version."""

    def __init__(self, reader: RequestReader, routes: RouteFinder, fleet: Fleet,
                 metrics: PickerMetrics, *, max_body_bytes: int) -> None:
        self.reader = reader
        self.routes = routes
        self.fleet = fleet
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes

    async def Process(self, request_iterator: AsyncIterator[ProcessingRequest],
                      context: aio.ServicerContext[Any, Any]) -> AsyncIterator[ProcessingResponse]:
        exchange = _Exchange(self)
        try:
            async for message in request_iterator:
                for response in await exchange.handle(message):
                    yield response
        finally:
            exchange.close()


class _Exchange:
    """One request's stream: what was read of it, and its route until the stream ends."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker
        self.mode = protocol.BUFFERED
        self.headers: dict[str, str] = {}
        self.subset: frozenset[str] | None = None
        self.body = bytearray()
        self.ledger: RouteLedger | None = None
        self.picked: str | None = None
        self.outcome = "ended_before_body"
        self.began = time.perf_counter()
        self.line: dict[str, Any] = {}
        self.answer_headers: dict[str, str] = {}
        """Set on the engine's answer: the worker and route picked, as the gateway does."""

    async def handle(self, message: ProcessingRequest) -> list[ProcessingResponse]:
        if self.outcome.startswith("refused"):
            return []  # answered at once: what Envoy still had in flight needs no answer
        kind = message.WhichOneof("request")
        if message.HasField("protocol_config"):
            self.mode = message.protocol_config.request_body_mode
        if kind == "request_headers":
            self.headers = protocol.header_map(message.request_headers)
            self.subset = protocol.subset_hint(message)
            if message.request_headers.end_of_stream:
                return [await self._pick_without_body()]
            if self.mode == protocol.FULL_DUPLEX_STREAMED:
                return []  # answered with the body, once it is whole
            return [protocol.continued(kind)]
        if kind == "request_body":
            self.body += message.request_body.body
            if len(self.body) > self.picker.max_body_bytes:
                return [self._refused(OpenAIError(
                    413, f"the request body is over {self.picker.max_body_bytes} bytes",
                    code="body_too_large"))]
            if not message.request_body.end_of_stream:
                return []  # full duplex: more to come, answered whole at the end
            return await self._pick()
        if kind == "response_headers":
            self._served(message)
            return [protocol.answered_headers(self.answer_headers)]
        if kind in ("response_body", "request_trailers", "response_trailers"):
            return [protocol.continued(kind)]
        return []

    async def _pick(self) -> list[ProcessingResponse]:
        started = time.perf_counter()
        picker, token = self.picker, bearer(self.headers)
        try:
            read = picker.reader.read(self.headers.get(":path", ""), bytes(self.body))
            excluded = await self._outside_subset(token)
            # Envoy sends a request to one endpoint: several completion prompts go where the
            # first is cached (the gateway alone can split them).
            route = await picker.routes.route(read.prompts[0], token, excluded, read.scope)
        except OpenAIError as refusal:
            return [self._refused(refusal)]
        except (TokenizerError, ChatTemplateError) as exc:
            return [self._refused(OpenAIError(400, str(exc)))]
        self.ledger = picker.routes.ledger(token)
        self.ledger.issued([route])
        if not route.http_url:
            return [self._refused(OpenAIError(
                503, f"worker {route.worker_id} has no HTTP endpoint", type="server_error",
                code="no_worker", headers={"Retry-After": "1"}))]
        self._chose(route, len(read.prompts[0]), started)
        extra = {"x-kvcoord-route-id": route.route_id}
        assert self.picked is not None
        if self.mode == protocol.FULL_DUPLEX_STREAMED:
            return protocol.picked_full_duplex([self.picked], extra, bytes(self.body))
        return [protocol.picked_after_buffered_body([self.picked], extra)]

    async def _pick_without_body(self) -> ProcessingResponse:
        """A request with nothing to route by: the least busy engine at the serving version."""
        token = bearer(self.headers)
        try:
            workers, version = await self.picker.fleet(token)
        except KvcoordError as exc:
            return self._refused(refusal_of(exc))
        ready = sorted((w.inflight_routes, w.worker_id, endpoint_of(w.http_url))
                       for w in workers if w.state == "ready" and w.http_url
                       and w.policy_version == version
                       and (self.subset is None or endpoint_of(w.http_url) in self.subset))
        if not ready:
            return self._refused(OpenAIError(503, "no engine is ready", type="server_error",
                                             code="no_worker", headers={"Retry-After": "1"}))
        _, worker_id, self.picked = ready[0]
        self.outcome = "picked"
        self.answer_headers = {"x-kvcoord-worker": worker_id}
        self.line.update(worker=worker_id, endpoint=self.picked, body=False)
        self.picker.metrics.picks.labels("picked").inc()
        return protocol.picked_after_headers([self.picked], {})

    async def _outside_subset(self, token: str | None) -> list[str]:
        """The workers the gateway's subset hint leaves out (none without a hint);
        OpenAIError 503 when it leaves none in."""
        if self.subset is None:
            return []
        try:
            workers, _ = await self.picker.fleet(token)
        except KvcoordError as exc:
            raise refusal_of(exc) from None
        outside = [w.worker_id for w in workers
                   if not w.http_url or endpoint_of(w.http_url) not in self.subset]
        if len(outside) == len(workers):
            raise OpenAIError(503, "no engine of the gateway's subset is known here",
                              type="server_error", code="no_worker",
                              headers={"Retry-After": "1"})
        return outside

    def _chose(self, route: Route, prompt_tokens: int, started: float) -> None:
        self.picked = endpoint_of(route.http_url)
        self.outcome = "picked"
        self.picker.metrics.picks.labels("picked").inc()
        self.picker.metrics.pick_seconds.observe(time.perf_counter() - started)
        self.answer_headers = {"x-kvcoord-worker": route.worker_id,
                               "x-kvcoord-route-id": route.route_id,
                               "x-kvcoord-policy-version": str(route.policy_version)}
        self.line.update(worker=route.worker_id, endpoint=self.picked, route_id=route.route_id,
                         policy_version=route.policy_version, prompt_tokens=prompt_tokens,
                         matched_tokens=route.matched_tokens)

    def _served(self, message: ProcessingRequest) -> None:
        served = protocol.served_address(message)
        if served is None or self.picked is None:
            return
        self.line["served"] = served
        self.picker.metrics.served.labels("picked" if served == self.picked else "elsewhere").inc()
        if served != self.picked:
            # Envoy sent it elsewhere (a fallback, or an endpoint the header did not name):
            # the route's engine is not doing this work, so its load is released now.
            log.warning("epp.served_elsewhere", picked=self.picked, served=served)
            if self.ledger is not None:
                self.ledger.close()

    def _refused(self, refusal: OpenAIError) -> ProcessingResponse:
        self.outcome = f"refused_{refusal.status}"
        self.picker.metrics.picks.labels(self.outcome).inc()
        self.line.update(status=refusal.status, code=refusal.code)
        return protocol.refused(refusal.status, refusal.body(), refusal.headers.items())

    def close(self) -> None:
        """The stream ended: the route ends, and the request gets its one log line."""
        if self.ledger is not None:
            self.ledger.close()
        if self.outcome == "ended_before_body":
            self.picker.metrics.picks.labels(self.outcome).inc()
        log.info("epp.request", path=self.headers.get(":path"), outcome=self.outcome,
                 request_id=self.headers.get("x-request-id"),
                 objective=self.headers.get(protocol.OBJECTIVE_HEADER),
                 fairness_id=self.headers.get(protocol.FAIRNESS_HEADER),
                 ms=round((time.perf_counter() - self.began) * 1000, 1), **self.line)
