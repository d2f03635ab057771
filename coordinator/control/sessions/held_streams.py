"""``HeldStreams``: the workers whose Sync streams this replica is holding back now, and the
leases it renews for them.

A stream waits for the ingest budget (``control.sessions.ingest_governor``) with everything
its worker sent behind the held batch, heartbeats included. The worker is talking; we are not
reading. So while a stream waits, or waited within a heartbeat period, the reaper renews the
worker's lease itself once less than half of it is left (``renew``): liveness never waits
behind page events, and a wait costs a stream two dictionary writes, not a timer of its own
(a timer per waiting batch cost a saturated replica a quarter of a core, ``kvcoord bench
fleet``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from coordinator.control.sessions.worker_sync import WorkerSync
from coordinator.core.errors import DomainError
from coordinator.core.fleet import RegisteredWorker
from coordinator.store.protocol import StoreUnavailable

log = structlog.get_logger(__name__)


class HeldStreams:
    def __init__(self, sessions: WorkerSync, period_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``period_s``: a worker counts as held for this long after a wait ended too (a
        stream held batch after batch waits many short times), and its lease is renewed once
        less than half of it is left."""
        self._sessions = sessions
        self._period_s = period_s
        self._clock = clock
        # id -> (session, None while it waits, else when its last wait ended)
        self._held: dict[int, tuple[RegisteredWorker, float | None]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, session: RegisteredWorker) -> None:
        """``session``'s stream waits from now (until ``release``)."""
        self._held[id(session)] = (session, None)

    def release(self, session: RegisteredWorker) -> None:
        self._held[id(session)] = (session, self._clock())

    async def renew(self, lease_s: float) -> int:
        """Renew the lease of every worker held now or within a period whose lease (of
        ``lease_s``) is half gone; forget the others. Returns how many were renewed. A lease
        found gone is left to the worker's next heartbeat to report."""
        now = self._clock()
        due = []
        for key, (session, ended) in list(self._held.items()):
            if ended is not None and now - ended > self._period_s:
                del self._held[key]
            elif session.lease_deadline - now < lease_s / 2:
                due.append(session)
        for session in due:
            try:
                await self._sessions.held_alive(session)
            except (DomainError, StoreUnavailable) as exc:
                log.warning("worker.held_lease_not_renewed", worker=session.worker_id,
                            error=str(exc))
        return len(due)
