"""The wire contract's constants, defined once for every client and server of the gRPC API.

``PROTOCOL_VERSION`` goes in every request and answer; a peer speaking another version is refused
(FAILED_PRECONDITION, reason ``PROTOCOL_VERSION``) rather than misread. The page key size is the
core's (``coordinator.core.hashing.PAGE_KEY_BYTES``; page keys travel as concatenated 16-byte
keys): this module imports nothing of the coordinator, so the core may import it. The ``Sync``
stream's messages are converted, for both sides, by ``coordinator.sync_codec``.

A refusal says why in a ``google.rpc.ErrorInfo`` status detail: ``domain`` is ``ERROR_DOMAIN``
and ``reason`` one of ``Reason``. A refusal that may be retried also carries a
``google.rpc.RetryInfo`` with the delay. Clients branch on the status code and the reason, never
on the details text (docs/PROTOCOL.md §6 lists every reason). Pure: no grpc here.
"""

from __future__ import annotations

import enum

__all__ = ["ERROR_DOMAIN", "PROTOCOL_VERSION", "Reason"]

PROTOCOL_VERSION = 2
"""2: refusals carry ``ErrorInfo``/``RetryInfo`` status details (1 said why only in the details
text and a ``retry-after-ms`` trailer). Requests at 1 are refused: a version-1 client would
misread every refusal of a version-2 server. 0 (unset) reads as the current version."""

ERROR_DOMAIN = "kvcoord"
"""``ErrorInfo.domain`` of every reason below: a reason under another domain is not ours."""


class Reason(enum.StrEnum):
    """Why a call was refused or a ``Sync`` stream ended: ``ErrorInfo.reason``, beside the status
    code. Each member's docstring says what a client must do. A code without a reason (bad input,
    a permission, a lost compare-and-set) means what the code says."""

    REREGISTER = "REREGISTER"
    """FAILED_PRECONDITION: the coordinator does not know this incarnation (unknown worker,
    stale incarnation, lease gone, dropped after its grace, registered again): Register anew and
    announce the whole inventory."""

    DEREGISTERED = "DEREGISTERED"
    """FAILED_PRECONDITION: the worker left the fleet for good (Deregister, by it or an
    operator): never register again."""

    SUPERSEDED = "SUPERSEDED"
    """FAILED_PRECONDITION: a newer stream of the same worker and incarnation took over (on this
    replica or another): this stream is done; the newer one carries on."""

    LEASE_LAPSED = "LEASE_LAPSED"
    """FAILED_PRECONDITION: no heartbeat for ``lease_ms``; the worker is unroutable but its pages
    are kept for ``drop_grace_ms``: reconnect with the same incarnation."""

    FENCED = "FENCED"
    """FAILED_PRECONDITION: the worker missed the APPLIED barrier of a policy update: register
    again, load the version RegisterResponse names."""

    PAGE_CAP = "PAGE_CAP"
    """RESOURCE_EXHAUSTED: an event batch or inventory would take the worker past its page limit
    (``max_pages_per_worker``, or 4x its ``total_pages``); nothing of it was applied and the
    next ``welcome.next_seq`` is its number: evict pages, then resend it smaller."""

    PROTOCOL_VERSION = "PROTOCOL_VERSION"
    """FAILED_PRECONDITION: the request's ``protocol_version`` is not the server's (ErrorInfo
    metadata ``peer_version``, ``server_version``): upgrade whichever side is older."""

    HASH_CONFIG = "HASH_CONFIG"
    """FAILED_PRECONDITION: Register's hash algorithm, page size or key differs from the
    coordinator's: fix the worker's configuration; retrying cannot help."""

    POLICY_RESTORED = "POLICY_RESTORED"
    """FAILED_PRECONDITION + RetryInfo: BeginPolicyUpdate within one lease of the policy state
    being restored after the store lost it: begin again after the delay."""

    DRAINING = "DRAINING"
    """UNAVAILABLE + RetryInfo: a sync policy update is draining (the coordinator's Route and
    RouteBatch, a worker's Generate): retry after the delay."""

    POLICY_STALE = "POLICY_STALE"
    """UNAVAILABLE + RetryInfo: this replica has not read the policy state for
    ``policy_stale_ms``: ask another replica now, or this one after the delay."""

    STORE_UNAVAILABLE = "STORE_UNAVAILABLE"
    """UNAVAILABLE + RetryInfo: the metadata store is unreachable from this replica: ask another
    replica now, or this one after the delay."""

    NO_WORKER = "NO_WORKER"
    """UNAVAILABLE + RetryInfo: no routable worker serves the model and version: retry after the
    delay (workers may be registering or coming back)."""

    RATE_LIMITED = "RATE_LIMITED"
    """RESOURCE_EXHAUSTED + RetryInfo: the caller's identity is over its request rate: retry
    after the delay (when a token is back)."""

    STREAM_LIMIT = "STREAM_LIMIT"
    """RESOURCE_EXHAUSTED: the caller's identity holds ``max_streams_per_identity`` open server
    streams: close one first."""
