"""``KvcoordError`` (a refused call, with its gRPC status) and the retry rules built on it: when a
refusal may be retried, after how long, and when another target may serve instead."""

from __future__ import annotations

import time

import grpc


class KvcoordError(Exception):
    """A call the coordinator (or the transport) refused. ``code`` is the ``grpc.StatusCode``."""

    def __init__(
        self, code: grpc.StatusCode, details: str, *, retry_after_ms: int | None = None
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.retry_after_ms = retry_after_ms

    @classmethod
    def from_rpc(cls, exc: grpc.RpcError) -> KvcoordError:
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
        retry_after: int | None = None
        trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
        for key, value in trailing or ():
            if key == "retry-after-ms":
                retry_after = int(value)
        return cls(code, details, retry_after_ms=retry_after)


RETRYABLE_WITH_HINT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
"""Codes a server may send with ``retry-after-ms``: an update draining the fleet, no worker yet,
the metadata store down (UNAVAILABLE); the caller over its rate limit (RESOURCE_EXHAUSTED)."""


def retry_pause(error: KvcoordError, deadline: float) -> float | None:
    """Seconds to wait before retrying a call the server asked to retry (a code of
    ``RETRYABLE_WITH_HINT`` with ``retry-after-ms``), or None when it must not be retried or
    the deadline would pass."""
    if error.code not in RETRYABLE_WITH_HINT or error.retry_after_ms is None:
        return None
    pause = error.retry_after_ms / 1000
    if time.monotonic() + pause >= deadline:
        return None
    return pause


def is_transport_failure(error: KvcoordError) -> bool:
    """UNAVAILABLE raised by the transport (worth another target), not by the coordinator
    (which always says when to retry)."""
    return error.code == grpc.StatusCode.UNAVAILABLE and error.retry_after_ms is None


def another_target_may_serve(error: KvcoordError) -> bool:
    """UNAVAILABLE, from the transport or from the coordinator: this replica cannot serve the
    call now (unreachable; its policy state older than ``policy_stale_ms``, its store down, no
    routable worker, the fleet draining), and another replica may. A unary call tries the next
    target at once rather than waiting out ``retry-after-ms`` on this one."""
    return bool(error.code == grpc.StatusCode.UNAVAILABLE)
