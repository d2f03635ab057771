"""What a Register must carry before a worker is admitted: an id, pages, an address, and the
coordinator's own hash configuration (algorithm, page size, key fingerprint), since keys hashed
any other way would never match the index."""

from __future__ import annotations

from coordinator.control.sync_messages import RegistrationRequest
from coordinator.core.errors import FailedPrecondition, InvalidArgument
from coordinator.core.hash_config import HashConfig
from coordinator.wire import Reason


def check_registration(req: RegistrationRequest, ours: HashConfig) -> None:
    """InvalidArgument for a missing id, no pages or an address that is not HOST:PORT;
    FailedPrecondition, reason HASH_CONFIG, for another hash configuration (final for the
    worker: retrying cannot help)."""
    if not req.worker_id:
        raise InvalidArgument("worker_id is required")
    if req.total_pages <= 0:
        raise InvalidArgument(f"total_pages must be > 0, got {req.total_pages}")
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
