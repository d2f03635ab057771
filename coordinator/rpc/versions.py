"""The protocol-version check every kvcoord server (coordinator and worker) runs on every request.

A server answers exactly one version, ``coordinator.wire.PROTOCOL_VERSION``; 0 (the field
unset) reads as that version. Any other is refused with FAILED_PRECONDITION, reason
``PROTOCOL_VERSION``, naming both versions: during a rolling upgrade a mixed fleet is told, not
misread. An older peer is refused too, since it could not read this server's refusals (version 1
looked for the reason in the details text and a ``retry-after-ms`` trailer).
"""

from __future__ import annotations

from coordinator.core.errors import FailedPrecondition
from coordinator.wire import PROTOCOL_VERSION, Reason


def check_protocol(version: int) -> None:
    """Refuse a request whose ``protocol_version`` is neither 0 nor ``PROTOCOL_VERSION``: the
    message says which side to upgrade, ErrorInfo metadata carries ``peer_version`` and
    ``server_version``."""
    if version in (0, PROTOCOL_VERSION):
        return
    relation, upgrade = ("newer", "the server") if version > PROTOCOL_VERSION else (
        "older", "the caller")
    raise FailedPrecondition(
        f"protocol version {version} is {relation} than this server's {PROTOCOL_VERSION}: "
        f"upgrade {upgrade}",
        reason=Reason.PROTOCOL_VERSION,
        metadata={"peer_version": str(version), "server_version": str(PROTOCOL_VERSION)},
    )
