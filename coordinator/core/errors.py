"""Domain errors of the coordinator.

The core raises these; exactly one place (``coordinator.rpc.interceptor``) maps them to gRPC status
codes, so servicers never pick codes themselves. Each class names the status it becomes.
"""

from __future__ import annotations


class DomainError(Exception):
    """Base of every error the coordinator answers with a status code and message."""

    status_name = "INTERNAL"


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

    def __init__(self, message: str, *, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class Aborted(DomainError):
    """A compare-and-set lost: the caller's expected state is stale."""

    status_name = "ABORTED"


class Unimplemented(DomainError):
    """The RPC exists in the contract but this release does not serve it yet."""

    status_name = "UNIMPLEMENTED"
