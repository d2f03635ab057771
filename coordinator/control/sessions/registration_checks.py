"""What a Register must carry before a worker is admitted: an id, pages, an address, and the
coordinator's own hash configuration (algorithm, page size, key fingerprint), since keys hashed
any other way would never match the index."""

from __future__ import annotations

from coordinator.control.sessions.sync_messages import RegistrationRequest
from coordinator.core.errors import FailedPrecondition, InvalidArgument
from coordinator.core.hashing import HashConfig
from coordinator.wire import Reason

MAX_HOST_PAGES = 1 << 28
"""Host-tier pages one worker may register: 2**28 pages of 16 tokens at 128 KiB a token is
512 TiB of RAM, far above any host; a larger count is a bug, and it would lift the worker's
page cap (4x device + host pages) to where it bounds nothing."""


def check_registration(req: RegistrationRequest, ours: HashConfig) -> None:
    """InvalidArgument for a missing id, no pages, more than ``MAX_HOST_PAGES`` host pages or
    an address that is not HOST:PORT; FailedPrecondition, reason HASH_CONFIG, for another hash
    configuration (final for the worker: retrying cannot help)."""
    if not req.worker_id:
        raise InvalidArgument("worker_id is required")
    if req.total_pages <= 0:
        raise InvalidArgument(f"total_pages must be > 0, got {req.total_pages}")
    if not 0 <= req.host_pages <= MAX_HOST_PAGES:
        raise InvalidArgument(f"host_pages must be 0..{MAX_HOST_PAGES}, got {req.host_pages}")
    if ":" not in req.address:
        raise InvalidArgument(f"address must be HOST:PORT, got {req.address!r}")
    if req.algorithm != ours.algorithm.value:
        raise FailedPrecondition(
            f"hash algorithm mismatch: worker uses {req.algorithm!r}, "
            f"coordinator uses {ours.algorithm.value!r}", reason=Reason.HASH_CONFIG,
        )
    if req.page_size != ours.page_size:
        raise FailedPrecondition(
            f"page size mismatch: worker uses {req.page_size}, coordinator uses "
            f"{ours.page_size}", reason=Reason.HASH_CONFIG,
        )
    if req.fingerprint != ours.fingerprint():
        raise FailedPrecondition(
            "hash key mismatch: the worker's KVCOORD_HASH_KEY differs from the coordinator's",
            reason=Reason.HASH_CONFIG,
        )
