"""``InProcessStub``: the coordinator's unary RPCs called in the process that serves them.

A gateway that runs its coordinator in its own process (``kvcoord gateway --embed-coordinator``)
asks it for routes through this stub instead of a gRPC channel. The call still goes through the
servicer as the server wraps it (``ErrorMappingInterceptor.wrap``): the same guard (bearer
token, role, rate), the same error mapping with its status details, the same per-method
metrics. What it skips is the wire: no serialization, no HTTP/2 frames, no poller wake-ups, no
second process. A refusal is raised as ``InProcessRpcError``, a ``grpc.RpcError`` that carries
the code, message and trailing metadata the wire would have, so
``coordinator.client.KvcoordError.from_rpc`` reads it exactly as it reads a remote one.

Only unary-unary methods are served; a streaming method raises ``NotImplementedError``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from coordinator.v1 import coordinator_pb2 as pb

_SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"]
_UNARY = frozenset(m.name for m in _SERVICE.methods
                   if not m.client_streaming and not m.server_streaming)


class InProcessRpcError(grpc.RpcError, grpc.aio.AbortError):  # type: ignore[misc]
    """A call the in-process servicer ended with a status: what a channel would have raised.
    It is an ``AbortError`` too, so the error mapping passes it on as an abort, never maps it
    again as a bug."""

    def __init__(self, code: grpc.StatusCode, details: str,
                 trailing_metadata: Sequence[tuple[str, Any]] = ()) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details
        self._trailing = tuple(trailing_metadata)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._trailing


class _LocalContext:
    """The part of ``grpc.aio.ServicerContext`` the coordinator's unary handlers use: the
    caller's metadata, the deadline, and the two ways to abort. No TLS peer: a call made in
    the process is identified by its bearer token alone."""

    def __init__(self, metadata: Sequence[tuple[str, Any]] | None,
                 timeout: float | None) -> None:
        self._metadata = tuple(metadata or ())
        self._deadline = None if timeout is None else time.monotonic() + timeout

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._metadata

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}

    def peer(self) -> str:
        return "in-process"

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: Sequence[tuple[str, Any]] = ()) -> None:
        raise InProcessRpcError(code, details, trailing_metadata)

    async def abort_with_status(self, status: grpc.Status) -> None:
        raise InProcessRpcError(status.code, status.details, status.trailing_metadata)


class InProcessStub:
    """``stub.Route(request, timeout=..., metadata=...)`` as a ``CoordinatorStub`` offers it,
    answered by ``servicer`` (the wrapped servicer a running coordinator serves) in this
    process and event loop."""

    def __init__(self, servicer: Any) -> None:
        self._servicer = servicer

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method not in _UNARY:
            raise NotImplementedError(
                f"{method}: only unary calls are served in process (use a channel)")
        behavior = getattr(self._servicer, method)

        async def call(request: Any, *, timeout: float | None = None,
                       metadata: Sequence[tuple[str, Any]] | None = None) -> Any:
            return await behavior(request, _LocalContext(metadata, timeout))

        setattr(self, method, call)  # built once per method
        return call
