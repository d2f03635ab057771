"""What a shard's replicas know of the other shards' workers: the workers' records in the store.

A replica holds only its own shard's workers in memory (their events come through its shard's
stream), but a policy update's barrier spans every shard of the namespace. So the replica that
begins an update takes the other shards' members from the worker records (leases, shared by all
shards), and each worker's owner keeps in its record what that choice reads:

- ``shard``: the shard it registered with (written at Register; absent = unsharded);
- ``status``: ``ready`` (its stream is attached and it is not fenced), ``fenced`` or
  ``disconnected`` (absent until its first stream attaches); cordons and drains are not kept,
  as neither decides membership;
- ``policy_version``: the version it serves.

``ShardRecords`` is the sink that keeps them: it passes every report on to the replication sink
it wraps and queues a record update when one of those changed, written by one task in the order
queued (latest wins per worker). It writes again at least once a lease while the worker
heartbeats, so a record a lost write or a racing old owner left behind is corrected. A record
lags its worker by one store round trip; a worker whose owner died keeps ``ready`` until its
lease runs out (a Begin then counts it, and the commit fences it unless it re-attaches in time).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence

import structlog

from coordinator.control.replication_sink import ReplicationSink
from coordinator.core.fleet import RegisteredWorker, WorkerStatus
from coordinator.core.index import PageEvent
from coordinator.store.protocol import MetadataStore, StoreUnavailable, WorkerRecord

log = structlog.get_logger(__name__)

SHARD = "shard"
STATUS = "status"
READY, FENCED, DISCONNECTED = "ready", "fenced", "disconnected"


def status_of(session: RegisteredWorker) -> str:
    """The ``status`` a worker's record should say (see the module docstring)."""
    if not session.connected:
        return DISCONNECTED
    return FENCED if session.fenced else READY


def local_members(fleet: Iterable[RegisteredWorker], version: int,
                  now: float) -> list[RegisteredWorker]:
    """The members of an update from ``version`` among this replica's workers: internal,
    serving ``version``, ready or cordoned at ``now``."""
    return [s for s in fleet
            if not s.external and s.policy_version == version
            and s.status(now) in (WorkerStatus.READY, WorkerStatus.CORDONED)]


def members_elsewhere(records: Iterable[WorkerRecord], *, shard: str, version: int) -> list[str]:
    """The workers of shards other than ``shard`` that an update from ``version`` waits for,
    by their records: not external, serving ``version``, attached and not fenced. Sorted."""
    return sorted(
        r.worker_id for r in records
        if r.info.get(SHARD, "") != shard and not r.external and r.policy_version == version
        and r.info.get(STATUS) == READY
    )


class ShardRecords:
    """A ``ReplicationSink`` that also keeps this replica's workers' records current for the
    other shards (see the module docstring). ``stop`` writes what is queued."""

    def __init__(self, inner: ReplicationSink, store: MetadataStore, *, refresh_s: float,
                 clock: Callable[[], float]) -> None:
        """``refresh_s``: how long an unchanged record goes without being written again."""
        self._inner = inner
        self._store = store
        self._refresh_s = refresh_s
        self._clock = clock
        # worker -> (incarnation, fields) last queued, and when
        self._known: dict[str, tuple[tuple[int, dict[str, str]], float]] = {}
        self._due: dict[str, tuple[int, dict[str, str]]] = {}
        self._writer: asyncio.Task[None] | None = None

    def _mirror(self, session: RegisteredWorker) -> None:
        entry = (session.incarnation, {STATUS: status_of(session),
                                       "policy_version": str(session.policy_version)})
        now = self._clock()
        known = self._known.get(session.worker_id)
        if known is not None and known[0] == entry and now - known[1] < self._refresh_s:
            return
        self._known[session.worker_id] = (entry, now)
        self._due[session.worker_id] = entry
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(
                self._write(), name="kvcoord-shard-records")

    async def _write(self) -> None:
        while self._due:
            worker_id = next(iter(self._due))
            incarnation, fields = self._due.pop(worker_id)
            try:
                await self._store.update_worker(worker_id, incarnation, **fields)
            except StoreUnavailable as exc:
                self._known.pop(worker_id, None)  # its next heartbeat queues it again
                log.warning("shard_records.not_written", worker=worker_id, error=str(exc))

    async def stop(self) -> None:
        """Write what is queued (a graceful stop), then nothing more."""
        if self._writer is not None:
            await asyncio.wait([self._writer], timeout=2.0)
            self._writer.cancel()

    # ------------------------------------------------------------------ ReplicationSink

    def registered(self, session: RegisteredWorker) -> None:
        self._inner.registered(session)

    def attached(self, session: RegisteredWorker) -> None:
        self._inner.attached(session)
        self._mirror(session)

    def detached(self, session: RegisteredWorker) -> None:
        self._inner.detached(session)
        self._mirror(session)

    def pages(self, session: RegisteredWorker, seq: int, events: Sequence[PageEvent]) -> None:
        self._inner.pages(session, seq, events)

    def replaced(self, session: RegisteredWorker, seq: int,
                 keys_by_tier: Mapping[str, Sequence[bytes]]) -> None:
        self._inner.replaced(session, seq, keys_by_tier)

    def state(self, session: RegisteredWorker, completed_routes: int) -> None:
        self._inner.state(session, completed_routes)
        self._mirror(session)

    def dropped(self, session: RegisteredWorker, reason: str) -> None:
        self._inner.dropped(session, reason)
        self._known.pop(session.worker_id, None)

    def cordoned(self, session: RegisteredWorker) -> None:
        self._inner.cordoned(session)

    def policy_changed(self, abort_running: bool) -> None:
        self._inner.policy_changed(abort_running)
