"""The one place where errors become gRPC status codes (and where RPCs are counted and guarded).

Servicers raise ``coordinator.core.errors.DomainError`` subclasses, which name their status and
may name a reason and a retry delay; a server may add a table for other exception types it
expects (the coordinator: a store outage; the worker: its runtime's errors). The call is aborted
with that status and the exception's message, and a reason or delay travels as ``google.rpc``
status details (``ErrorInfo`` in domain ``coordinator.wire.ERROR_DOMAIN``, ``RetryInfo``) in the
``grpc-status-details-bin`` trailer that grpcio-status writes and clients read
(``coordinator.client.outcomes.outcome_of``). Anything else is a bug: it is logged with its
traceback and answered INTERNAL without details.
Before the handler runs, ``coordinator.rpc.guard.Guard`` admits the call (identity, role, rate);
its refusals are domain errors like any other, so they are counted and answered the same way.
"""

from __future__ import annotations

import time
import types
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import structlog
from google.protobuf.descriptor import ServiceDescriptor
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from coordinator.core.errors import DomainError
from coordinator.rpc.guard import Guard, ServerSecurity
from coordinator.rpc.identities import Role
from coordinator.wire import ERROR_DOMAIN, Reason

log = structlog.get_logger(__name__)

Behavior = Callable[..., Any]


class RpcMetrics(Protocol):
    """What the mapping records into: ``requests{method,code}`` and ``latency{method}``."""

    requests: Any
    latency: Any


@dataclass(frozen=True, slots=True)
class Mapped:
    """How an exception is answered: its status, and the reason, ErrorInfo metadata and retry
    delay sent as status details (none when ``reason`` and ``retry_after_ms`` are None)."""

    status: str  # a grpc.StatusCode name
    retry_after_ms: int | None = None
    reason: Reason | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)


class ErrorMappingInterceptor:
    """Maps errors to status codes and records per-method counts and latencies.

    It wraps each servicer method once, at registration (``wrap``), rather than acting as a
    ``grpc.aio.ServerInterceptor``: grpc.aio's interceptor path re-creates the handler and
    schedules extra tasks on every call, which measured ~450 us per Route on this project's
    benchmark machine, more than the routing work itself.
    """

    def __init__(
        self, metrics: RpcMetrics, expected: Mapping[type[Exception], Mapped] | None = None,
        guard: Guard | None = None,
    ) -> None:
        """``expected``: how to answer exception types beside ``DomainError`` (the first
        ``isinstance`` match, in order); ``guard``: who may call (None: auth off)."""
        self._metrics = metrics
        self._expected = dict(expected or {})
        self._guard = guard or Guard(ServerSecurity())
        self._children: dict[tuple[str, str], tuple[Any, Any]] = {}

    def wrap(
        self, servicer: Any, service: ServiceDescriptor,
        permissions: Mapping[str, frozenset[Role]] | None = None,
        only: frozenset[str] | None = None,
    ) -> Any:
        """A servicer whose every RPC of ``service`` is admitted by the guard under
        ``permissions`` (method -> roles; a method not named there is admin-only) and goes
        through the error mapping. A client stream is paced by the caller's rate; a server
        stream holds one of the caller's open-stream slots while it runs."""
        wrapped = types.SimpleNamespace()
        table = dict(permissions or {})
        for method in service.methods:
            if only is not None and method.name not in only:
                continue  # ``only``: the methods this servicer serves (the rest: none)
            behavior = getattr(servicer, method.name)
            if method.server_streaming:
                wrapper = self._wrap_stream(method.name, behavior, table, method.client_streaming)
            else:
                wrapper = self._wrap_unary(method.name, behavior, table)
            setattr(wrapped, method.name, wrapper)
        return wrapped

    def record(self, method: str, code: str, started: float) -> None:
        # Label children resolved once per (method, code): labels() hashes and locks per call.
        children = self._children.get((method, code))
        if children is None:
            children = self._children[(method, code)] = (
                self._metrics.requests.labels(method, code),
                self._metrics.latency.labels(method),
            )
        children[0].inc()
        children[1].observe(time.perf_counter() - started)

    def _wrap_unary(
        self, method: str, behavior: Behavior, permissions: Mapping[str, frozenset[Role]]
    ) -> Behavior:
        guard = self._guard

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started = time.perf_counter()
            code = "OK"
            try:
                guard.admit(method, context, permissions)
                return await behavior(request, context)
            except Exception as exc:
                code, answer = self.classify(exc, method)
                del request  # see _release
                await _abort(context, _release(exc), answer)
            finally:
                self.record(method, code, started)

        return unary

    def _wrap_stream(
        self, method: str, behavior: Behavior, permissions: Mapping[str, frozenset[Role]],
        client_streaming: bool,
    ) -> Behavior:
        guard = self._guard

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            started = time.perf_counter()
            code = "OK"
            identity = None
            try:
                caller = guard.admit(method, context, permissions)
                guard.open_stream(caller, method)
                identity = caller
                if client_streaming and guard.paces:
                    request = guard.paced(caller, request)
                async for response in behavior(request, context):
                    yield response
            except Exception as exc:
                code, answer = self.classify(exc, method)
                del request  # see _release
                await _abort(context, _release(exc), answer)
            finally:
                # NOTE: set only once open_stream took a slot: a stream refused before (or by)
                # it has none to give back.
                if identity is not None:
                    guard.close_stream(identity)
                self.record(method, code, started)

        return stream

    def classify(self, exc: Exception, method: str) -> tuple[str, Mapped | None]:
        """The status label for ``exc`` and how to answer it (None: re-raise as it is)."""
        if isinstance(exc, grpc.aio.AbortError):
            return "ABORTED_IN_HANDLER", None  # a handler called context.abort itself
        if isinstance(exc, DomainError):
            return exc.status_name, Mapped(exc.status_name, exc.retry_after_ms, exc.reason,
                                           exc.metadata)
        for cls, mapped in self._expected.items():
            if isinstance(exc, cls):
                return mapped.status, mapped
        log.exception("rpc.internal_error", method=method)
        return "INTERNAL", Mapped("INTERNAL")


MAX_DETAILS_CHARS = 1024
"""Status details longer than this are cut: messages quote the offending input, and a client
refuses trailers over its metadata limit (16 KiB by default), losing the real status."""


def _release(exc: Exception) -> Exception:
    """``exc`` without its traceback. The abort that follows raises an exception that grpc keeps
    until a garbage collection runs, and through it every frame the traceback holds, with the
    request in them: a refused 16 MiB request would stay in memory for that long (a flood of
    them grew a coordinator by a gigabyte). The caller drops its own ``request`` first."""
    exc.__traceback__ = None
    return exc


def details(exc: Exception) -> str:
    """The message of ``exc`` as status details: control characters escaped, at most
    ``MAX_DETAILS_CHARS`` characters."""
    message = str(exc)
    if not message.isprintable():
        message = "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)
    if len(message) > MAX_DETAILS_CHARS:
        cut = len(message) - MAX_DETAILS_CHARS
        message = f"{message[:MAX_DETAILS_CHARS]}... ({cut} more characters)"
    return message


def rich_status(answer: Mapped, message: str) -> status_pb2.Status:
    """``answer`` as a ``google.rpc.Status``: its code and ``message``, then an ``ErrorInfo``
    when it has a reason and a ``RetryInfo`` when it has a retry delay (in that order)."""
    code = grpc.StatusCode[answer.status]
    status = status_pb2.Status(code=code.value[0], message=message)
    if answer.reason is not None:
        status.details.add().Pack(error_details_pb2.ErrorInfo(
            reason=answer.reason.value, domain=ERROR_DOMAIN, metadata=dict(answer.metadata),
        ))
    if answer.retry_after_ms is not None:
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromMilliseconds(answer.retry_after_ms)
        status.details.add().Pack(retry)
    return status


async def _abort(context: grpc.aio.ServicerContext, exc: Exception, answer: Mapped | None) -> None:
    """End the call with ``answer`` (its message is the exception's, except for INTERNAL)."""
    if answer is None:
        raise exc
    message = "internal error" if answer.status == "INTERNAL" else details(exc)
    if answer.reason is None and answer.retry_after_ms is None:
        await context.abort(grpc.StatusCode[answer.status], message)
    else:
        await context.abort_with_status(rpc_status.to_status(rich_status(answer, message)))
