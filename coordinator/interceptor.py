"""The one place where domain errors become gRPC status codes (and where RPCs are counted).

Servicers raise ``coordinator.errors.DomainError`` subclasses; this interceptor aborts the call
with the status the class names and its message. Anything else is a bug: it is logged with its
traceback and answered INTERNAL without leaking details.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog

from coordinator.errors import DomainError, Unavailable
from coordinator.metrics import CoordinatorMetrics

log = structlog.get_logger(__name__)

Behavior = Callable[..., Any]


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Maps ``DomainError`` to status codes and records per-method counts and latencies."""

    def __init__(self, metrics: CoordinatorMetrics) -> None:
        self._metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(method, handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(method, handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._wrap_stream(method, handler.stream_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

    def _record(self, method: str, code: str, started: float) -> None:
        self._metrics.requests.labels(method, code).inc()
        self._metrics.latency.labels(method).observe(time.perf_counter() - started)

    def _wrap_unary(self, method: str, behavior: Behavior) -> Behavior:
        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started = time.perf_counter()
            code = "OK"
            try:
                return await behavior(request, context)
            except DomainError as exc:
                code = exc.status_name
                await _abort(context, exc)
            except Exception as exc:
                code = _passthrough_or_internal(exc, method)
                if code != "INTERNAL":
                    raise
                await context.abort(grpc.StatusCode.INTERNAL, "internal error")
            finally:
                self._record(method, code, started)

        return unary

    def _wrap_stream(self, method: str, behavior: Behavior) -> Behavior:
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            started = time.perf_counter()
            code = "OK"
            try:
                async for response in behavior(request, context):
                    yield response
            except DomainError as exc:
                code = exc.status_name
                await _abort(context, exc)
            except Exception as exc:
                code = _passthrough_or_internal(exc, method)
                if code != "INTERNAL":
                    raise
                await context.abort(grpc.StatusCode.INTERNAL, "internal error")
            finally:
                self._record(method, code, started)

        return stream


async def _abort(context: grpc.aio.ServicerContext, exc: DomainError) -> None:
    if isinstance(exc, Unavailable) and exc.retry_after_ms is not None:
        context.set_trailing_metadata((("retry-after-ms", str(exc.retry_after_ms)),))
    await context.abort(grpc.StatusCode[exc.status_name], str(exc))


def _passthrough_or_internal(exc: Exception, method: str) -> str:
    """Aborts raised by grpc itself pass through; anything else is our bug."""
    if isinstance(exc, grpc.aio.AbortError):
        return "ABORTED_BY_HANDLER"
    log.exception("rpc.internal_error", method=method)
    return "INTERNAL"
