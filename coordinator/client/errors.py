"""``KvcoordError`` (a refused call, with its gRPC status, reason and retry delay) and the retry
rules built on it: when a refusal may be retried, after how long, and when another target may
serve instead. Every rule reads the typed status details (``coordinator.client.outcomes``)."""

from __future__ import annotations

import time
from collections.abc import Mapping

import grpc

from coordinator.client.outcomes import outcome_of
from coordinator.wire import Reason


class KvcoordError(Exception):
    """A call the coordinator (or the transport) refused. ``code`` is the ``grpc.StatusCode``;
    ``reason`` the server's ``coordinator.wire.Reason`` (None when it gave none);
    ``retry_after_ms`` its ``RetryInfo`` delay (None: retrying is not advised); ``metadata`` the
    ``ErrorInfo`` metadata (e.g. ``peer_version`` for PROTOCOL_VERSION); ``details`` the status
    text, for people only: branch on ``code`` and ``reason``, never on it."""

    def __init__(
        self, code: grpc.StatusCode, details: str, *, reason: Reason | None = None,
        retry_after_ms: int | None = None, metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.reason = reason
        self.retry_after_ms = retry_after_ms
        self.metadata: Mapping[str, str] = dict(metadata or {})

    @classmethod
    def from_rpc(cls, exc: grpc.RpcError) -> KvcoordError:
        """The error a failed call ``exc`` (blocking or aio) stands for, its status details
        decoded by ``outcome_of`` (never raises)."""
        outcome = outcome_of(exc)
        return cls(outcome.code, outcome.message, reason=outcome.reason,
                   retry_after_ms=outcome.retry_after_ms, metadata=outcome.metadata)


RETRYABLE_WITH_HINT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
"""Codes a server may send with ``RetryInfo`` that the SDK retries: an update draining the
fleet, no worker yet, stale policy state, the metadata store down (UNAVAILABLE); the caller over
its rate limit (RESOURCE_EXHAUSTED)."""


def retry_pause(error: KvcoordError, deadline: float) -> float | None:
    """Seconds to wait before retrying a call the server asked to retry (a code of
    ``RETRYABLE_WITH_HINT`` with ``RetryInfo``), or None when it must not be retried or the
    deadline (``time.monotonic`` seconds) would pass before the retry could start.
    A ``RetryInfo`` on any other code is the caller's to act on: POLICY_RESTORED
    (FAILED_PRECONDITION) is raised, and the trainer begins again after ``retry_after_ms``."""
    if error.code not in RETRYABLE_WITH_HINT or error.retry_after_ms is None:
        return None
    pause = error.retry_after_ms / 1000
    if time.monotonic() + pause >= deadline:
        return None
    return pause


def is_transport_failure(error: KvcoordError) -> bool:
    """UNAVAILABLE raised by the transport (worth another target), not by a kvcoord server
    (which always names its reason and says when to retry)."""
    return (error.code == grpc.StatusCode.UNAVAILABLE and error.reason is None
            and error.retry_after_ms is None)


def another_target_may_serve(error: KvcoordError) -> bool:
    """UNAVAILABLE, from the transport or from the coordinator: this replica cannot serve the
    call now (unreachable; its policy state older than ``policy_stale_ms``, its store down, no
    routable worker, the fleet draining), and another replica may. A unary call tries the next
    target at once rather than waiting out the ``RetryInfo`` delay on this one."""
    return bool(error.code == grpc.StatusCode.UNAVAILABLE)
