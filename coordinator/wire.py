"""The wire contract's constants, defined once for every client and server of the gRPC API.

``PROTOCOL_VERSION`` goes in every request and answer; a peer newer than the receiver is refused
rather than misread. The page key size is the core's (``coordinator.core.hashing.PAGE_KEY_BYTES``):
page keys travel as concatenated 16-byte keys.
"""

from __future__ import annotations

from coordinator.core.hashing import PAGE_KEY_BYTES

__all__ = ["PAGE_KEY_BYTES", "PROTOCOL_VERSION"]

PROTOCOL_VERSION = 1
