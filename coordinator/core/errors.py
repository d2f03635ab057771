"""Domain errors of the coordinator.

The core raises these; exactly one place (``coordinator.rpc.interceptor``) maps them to gRPC status
codes, so servicers never pick codes themselves. Each class names the status it becomes; an
error may also name its ``reason`` (``coordinator.wire.Reason``, sent as ``google.rpc.ErrorInfo``),
``metadata`` for that ErrorInfo, and ``retry_after_ms`` (sent as ``google.rpc.RetryInfo``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from coordinator.wire import Reason


class DomainError(Exception):
    """Base of every error the coordinator answers with a status code and message.

    ``reason`` says why where the code alone is ambiguous (clients branch on it, never on the
    message); ``retry_after_ms`` is set only when retrying after that delay may succeed."""

    status_name = "INTERNAL"
    # Defaults on the class: an error raised with a message alone (most refusals, some on hot
    # paths) sets nothing more.
    reason: Reason | None = None
    retry_after_ms: int | None = None
    metadata: Mapping[str, str] = MappingProxyType({})

    def __init__(
        self, message: str, *, reason: Reason | None = None, retry_after_ms: int | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason
        if retry_after_ms is not None:
            if retry_after_ms < 0:
                raise ValueError(f"retry_after_ms must be >= 0, got {retry_after_ms}")
            self.retry_after_ms = retry_after_ms
        if metadata:
            self.metadata = dict(metadata)


class InvalidArgument(DomainError):
    """The request can never succeed as sent (malformed or over a size limit)."""

    status_name = "INVALID_ARGUMENT"


class ResourceExhausted(DomainError):
    """A bounded resource (pending entries, streams, rate) is full; retrying later may work."""

    status_name = "RESOURCE_EXHAUSTED"


class FailedPrecondition(DomainError):
    """The caller's view of the system is wrong: unknown worker, stale incarnation, sequence
    regression, hash-config or protocol-version mismatch."""

    status_name = "FAILED_PRECONDITION"


class NotFound(DomainError):
    """A named object (worker) does not exist."""

    status_name = "NOT_FOUND"


class Unavailable(DomainError):
    """No worker can take the request now (none eligible, policy update draining)."""

    status_name = "UNAVAILABLE"


class Aborted(DomainError):
    """A compare-and-set lost: the caller's expected state is stale."""

    status_name = "ABORTED"


class Unimplemented(DomainError):
    """The RPC exists in the contract but this release does not serve it yet."""

    status_name = "UNIMPLEMENTED"
