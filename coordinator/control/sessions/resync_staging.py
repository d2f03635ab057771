"""``InventoryStaging``: the open resyncs of this replica's workers.

A worker asked to resync (a sequence gap, a reconnect the coordinator cannot trust) answers with
its whole inventory in chunks under the message-size limit; the chunks are staged here and
replace the worker's holdings in the index only with the last one, so a stream that dies
mid-inventory leaves the index as it was (the next stream is asked again).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import structlog

from coordinator.control.sessions.sync_messages import InventoryIn, Resync
from coordinator.core.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from coordinator.core.fleet import RegisteredWorker
from coordinator.core.fleet.registered_worker import PAGE_BOUND_FACTOR
from coordinator.wire import Reason

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class _Staged:
    resync_id: int
    keys_by_tier: dict[str, list[bytes]] = field(default_factory=dict)
    count: int = 0


class InventoryStaging:
    """Resync ids asked of workers and the inventory chunks received so far."""

    def __init__(self, max_pages_per_worker: int) -> None:
        self._max_pages = max_pages_per_worker
        self._ids = itertools.count(1)
        self._staged: dict[str, _Staged] = {}

    def open(self, session: RegisteredWorker, reason: str) -> Resync:
        """Ask ``session`` for its whole inventory (chunks staged before stay discarded)."""
        resync_id = next(self._ids)
        session.resync_id = resync_id
        self._staged.pop(session.worker_id, None)
        log.warning("worker.resync", worker=session.worker_id, reason=reason, resync=resync_id)
        return Resync(resync_id, reason)

    def discard(self, worker_id: str) -> None:
        """Forget what the worker staged (it re-registered, or left)."""
        self._staged.pop(worker_id, None)

    def add(self, session: RegisteredWorker, chunk: InventoryIn) -> dict[str, list[bytes]] | None:
        """Stage one chunk; with the last one, the whole inventory by tier (and the resync is
        closed), else None. FailedPrecondition for a chunk of another resync; InvalidArgument
        past the worker's ``page_bound`` (4x its device and host pages); ResourceExhausted
        (PAGE_CAP) past ``max_pages_per_worker``."""
        if chunk.resync_id != session.resync_id:
            raise FailedPrecondition(
                f"inventory for resync {chunk.resync_id}, but the open resync is "
                f"{session.resync_id}"
            )
        staged = self._staged.get(session.worker_id)
        if staged is None or staged.resync_id != chunk.resync_id:
            staged = self._staged[session.worker_id] = _Staged(chunk.resync_id)
        staged.count += len(chunk.keys)
        if staged.count > session.page_bound:
            raise InvalidArgument(
                f"inventory of {staged.count} pages exceeds {session.page_bound}, "
                f"{PAGE_BOUND_FACTOR}x the worker's {session.total_pages} device and "
                f"{session.host_pages} host pages"
            )
        if staged.count > self._max_pages:
            raise ResourceExhausted(
                f"inventory of {staged.count} pages is over the limit of "
                f"{self._max_pages} per worker (max_pages_per_worker)",
                reason=Reason.PAGE_CAP, metadata={"limit": str(self._max_pages)},
            )
        staged.keys_by_tier.setdefault(chunk.tier.value, []).extend(chunk.keys)
        if not chunk.last:
            return None
        del self._staged[session.worker_id]
        session.resync_id = None
        return staged.keys_by_tier
