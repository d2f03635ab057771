"""Coordinator replicas kept identical through the store's ``events`` stream.

A shard's replicas (``CoordinatorConfig.shard``) use a stream and a replica set of their own
(``events:<shard>``, announced in ``replicas:<shard>``), so they apply only their own shard's
workers' events; unsharded replicas use ``events`` and ``replicas``.

Each replica publishes what its own services queued (``ReplicationOutbox``: the
``ReplicationSink`` the worker sessions and policy updates report to) and applies what the
others publish (``ReplicaApplier``). One publisher task sends events in the order they happened,
batched into one pipelined round trip; one tailer task blocks on the stream and applies entries
in stream order. Lag (publish to apply, wall clock) is measured on every applied entry.

Bootstrap: a starting replica notes the stream's end, asks every live replica for a snapshot
of the workers it owns (``SnapshotWanted``), and reports ready once each has answered
(``SnapshotDone``) or ``bootstrap_timeout_ms`` passed; the server reports SERVING only then.
With shared routes a snapshot asked for carries the routes in flight to each worker too
(``InFlight``, for the asker only), so the joiner counts the load the others count.

Faults: a failed publish drops the queued events and marks this replica's view dirty; once the
store answers again every owned worker is re-published as a snapshot (registration, stream
state, holdings as of its sequence number), which supersedes what was lost. A stream that
vanished (Redis restarted without persistence) or was trimmed past the tailer's cursor makes
the tailer ask everyone for snapshots again.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from coordinator.config import CoordinatorConfig
from coordinator.control.policy_updates import PolicyUpdates
from coordinator.control.sessions import WorkerStreams, WorkerSync
from coordinator.core.fleet import Fleet, RegisteredWorker
from coordinator.core.index import PrefixIndex
from coordinator.core.routing import Router
from coordinator.replication.apply import ReplicaApplier
from coordinator.replication.events import (
    Attached,
    Cordoned,
    Detached,
    InFlight,
    MalformedEvent,
    PolicyChanged,
    Replaced,
    ReplicaEvent,
    SnapshotDone,
    SnapshotWanted,
    decode,
    encode,
    origin_of,
)
from coordinator.replication.outbox import ReplicationOutbox, registered_event, state_event
from coordinator.store.protocol import (
    MetadataStore,
    StoreUnavailable,
    events_stream,
    parse_entry_id,
)

log = structlog.get_logger(__name__)

STREAM = events_stream("")  # an unsharded replica's; a shard's is events:<shard>
_PUBLISH_BATCH = 512  # events per pipelined round trip
_READ_BATCH = 1024
_BLOCK_MS = 200  # the tailer's XREAD BLOCK; below any store command timeout we use
_LAG_SAMPLES = 4096
# Each Redis round trip costs the event loop ~100 us of redis-py, whatever it carries: the
# publisher waits this long for more events before a round trip, and the tailer this long
# between reads, so a busy replica sends and reads many events per trip (a few ms of lag).
_COALESCE_S = 0.005


def default_replica_id() -> str:
    """host-pid-random: unique per process, readable in logs and ``kvcoord status``."""
    return f"{socket.gethostname()}-{os.getpid()}-{random.randrange(16**4):04x}"


@dataclass(slots=True)
class ReplicationCounters:
    published: int = 0
    applied: int = 0
    malformed: int = 0
    publish_failures: int = 0
    snapshots_sent: int = 0
    resnapshots: int = 0  # times this replica asked everyone again (stream lost or trimmed)


class Replicator:
    """The replication of one coordinator replica: publishes its outbox, applies the others'."""

    def __init__(
        self, *, config: CoordinatorConfig, store: MetadataStore, fleet: Fleet,
        index: PrefixIndex, sessions: WorkerSync, streams: WorkerStreams,
        updates: PolicyUpdates, outbox: ReplicationOutbox,
        clock: Callable[[], float], wall_clock: Callable[[], float] = time.time,
        router: Router | None = None,
    ) -> None:
        """``outbox``: what this replica's services queued for the others (the publisher
        drains it); ``sessions``, ``streams`` and ``updates``: where the others' events and
        policy changes are applied here; ``router``: where their routes are counted."""
        self.replica_id = sessions.replica_id
        self._config = config
        self._shard = config.shard
        self._stream = events_stream(config.shard)
        self._store = store
        self._fleet = fleet
        self._index = index
        self._sessions = sessions
        self._updates = updates
        self._clock = clock
        self._wall_clock = wall_clock
        self._applier = ReplicaApplier(
            config=config, fleet=fleet, index=index, sessions=sessions, streams=streams,
            clock=clock, want_snapshot=outbox.snapshot_wanted, router=router,
        )
        self._outbox = outbox
        self._router = router
        self._publishing = False
        self._cursor = "0-0"
        self._tasks: list[asyncio.Task[None]] = []
        # Loops also check this: redis-py can turn a cancellation that lands on its read
        # timeout into a TimeoutError (StoreUnavailable here), which the loops survive.
        self._stopping = False
        self._waiting_for: set[str] = set()  # peers whose bootstrap snapshot is still due
        self.ready = asyncio.Event()
        self.peers: list[str] = []
        self.live: list[str] = [self.replica_id]  # live replicas, as of the last announce
        self.lags_ms: deque[float] = deque(maxlen=_LAG_SAMPLES)
        self.counters = ReplicationCounters()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Note the stream's end, start the tasks, ask the live replicas for snapshots. Returns
        at once; ``ready`` is set when the bootstrap is done (see ``wait_ready``)."""
        bounds = await self._store.stream_bounds(self._stream)
        self._cursor = bounds.last_id or "0-0"
        live = await self._store.live_replicas(shard=self._shard)
        self._waiting_for = set(live) - {self.replica_id}
        self.peers = sorted(self._waiting_for)
        await self._announce()
        self.live = sorted({*self.peers, self.replica_id})
        self._outbox.put(SnapshotWanted(""))
        if not self._waiting_for:
            self.ready.set()
        for name, loop in (("publish", self._publish_forever), ("tail", self._tail_forever),
                           ("announce", self._announce_forever)):
            self._tasks.append(asyncio.create_task(loop(), name=f"kvcoord-replication-{name}"))
        log.info("replication.started", replica=self.replica_id, peers=self.peers,
                 stream=self._stream, cursor=self._cursor)

    async def wait_ready(self) -> bool:
        """Wait for the bootstrap (at most ``bootstrap_timeout_ms``); False when it timed out
        (peers that never answered are presumed dead: their workers will reconnect)."""
        timeout = self._config.bootstrap_timeout_ms / 1000
        try:
            await asyncio.wait_for(self.ready.wait(), timeout)
        except TimeoutError:
            log.warning("replication.bootstrap_timed_out", replica=self.replica_id,
                        silent_peers=sorted(self._waiting_for))
            self.ready.set()
            return False
        log.info("replication.bootstrapped", replica=self.replica_id, workers=len(self._fleet))
        return True

    async def stop(self) -> None:
        self._stopping = True
        self._outbox.wake.set()
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)
        self._tasks.clear()

    async def flush(self, timeout: float = 2.0) -> None:
        """Wait until everything queued so far has been published (tests, graceful stop)."""
        deadline = self._clock() + timeout
        while (self._outbox.events or self._publishing) and self._clock() < deadline:
            await asyncio.sleep(0.005)

    async def caught_up(self, timeout: float) -> bool:
        """Wait until everything in the stream now has been applied here (at most ``timeout``
        seconds); False when it was not, or the store could not say."""
        try:
            last = (await self._store.stream_bounds(self._stream)).last_id
        except StoreUnavailable:
            return False
        if last is None:
            return True
        target = parse_entry_id(last)
        deadline = self._clock() + timeout
        while parse_entry_id(self._cursor) < target:
            if self._clock() >= deadline:
                return False
            await asyncio.sleep(0.005)
        return True

    # ------------------------------------------------------------------ publishing

    def _snapshots(self, sessions: list[RegisteredWorker],
                   requester: str = "") -> list[ReplicaEvent]:
        """What another replica needs to hold exactly our view of ``sessions`` (their
        inventories read in one pass over the index); for a ``requester`` that asked, with
        shared routes, the routes in flight to them as well."""
        inventories = self._index.worker_inventories(
            s.worker_id for s in sessions if s.resync_id is None)
        events = [event for s in sessions
                  for event in self._snapshot(s, inventories.get(s.worker_id, {}))]
        if requester and self._router is not None:
            events += [InFlight(requester, r) for r in self._router.inflight(sessions)]
        return events

    def _snapshot(self, session: RegisteredWorker,
                  inventory: dict[str, list[bytes]]) -> list[ReplicaEvent]:
        worker_id, incarnation = session.worker_id, session.incarnation
        events: list[ReplicaEvent] = [registered_event(session)]
        if session.connected:
            events.append(Attached(worker_id, incarnation, session.next_seq))
        else:
            events.append(Detached(worker_id, incarnation))
        if session.resync_id is None:  # mid-resync our index is not the truth: its end is
            events.append(Replaced(worker_id, incarnation, session.next_seq - 1,
                                   {tier: tuple(keys) for tier, keys in inventory.items()}))
        events.append(state_event(session, 0))
        if session.cordoned:
            events.append(Cordoned(worker_id, True))
        self.counters.snapshots_sent += 1
        return events

    def _own_sessions(self) -> list[RegisteredWorker]:
        return [s for s in self._fleet if self._sessions.is_local(s)]

    async def _publish_forever(self) -> None:
        attempt = 0
        while not self._stopping:
            outbox = self._outbox
            if not outbox.events and not outbox.dirty:
                outbox.wake.clear()
                await outbox.wake.wait()
            if len(outbox.events) < _PUBLISH_BATCH:
                await asyncio.sleep(_COALESCE_S)  # let a busy replica's events gather
            if outbox.dirty:
                if not await self._store.ping():
                    attempt += 1
                    await asyncio.sleep(_backoff(attempt))
                    continue
                outbox.dirty = False
                outbox.events.clear()
                outbox.events.extend(self._snapshots(self._own_sessions()))
                if outbox.want_all:
                    outbox.want_all = False
                    outbox.events.append(SnapshotWanted(""))
                log.info("replication.republished", replica=self.replica_id,
                         workers=len(self._own_sessions()))
            batch = [outbox.events.popleft()
                     for _ in range(min(len(outbox.events), _PUBLISH_BATCH))]
            if not batch:
                continue
            now_ms = int(self._wall_clock() * 1000)
            entries = [encode(self.replica_id, now_ms, event) for event in batch]
            self._publishing = True
            try:
                await self._store.append_many(self._stream, entries,
                                              maxlen=self._config.max_replication_events)
                self.counters.published += len(entries)
                attempt = 0
            except StoreUnavailable as exc:
                self.counters.publish_failures += 1
                outbox.mark_dirty()
                log.warning("replication.publish_failed", replica=self.replica_id,
                            dropped=len(batch) + len(outbox.events), error=str(exc))
                outbox.events.clear()
            finally:
                self._publishing = False

    # ------------------------------------------------------------------ tailing

    async def _tail_forever(self) -> None:
        attempt = 0
        while not self._stopping:
            try:
                entries = await self._store.tail(self._stream, after=self._cursor,
                                                 count=_READ_BATCH, block_ms=_BLOCK_MS)
                if attempt:
                    await self._check_stream()
                    attempt = 0
            except StoreUnavailable as exc:
                attempt += 1
                if attempt == 1:
                    log.warning("replication.tail_failed", replica=self.replica_id,
                                error=str(exc))
                await asyncio.sleep(_backoff(attempt))
                continue
            now_ms = self._wall_clock() * 1000
            for entry in entries:
                self._cursor = entry.entry_id
                if origin_of(entry.fields) == self.replica_id:
                    continue  # applied when it happened
                try:
                    envelope = decode(entry.fields)
                except MalformedEvent as exc:
                    self.counters.malformed += 1
                    log.warning("replication.malformed", entry=entry.entry_id, error=str(exc))
                    continue
                if envelope.origin == self.replica_id:
                    continue
                self.lags_ms.append(max(0.0, now_ms - envelope.published_ms))
                self.counters.applied += 1
                try:
                    await self._apply(envelope.origin, envelope.event)
                except Exception:  # one bad event must not stop replication
                    log.exception("replication.apply_failed", entry=entry.entry_id,
                                  origin=envelope.origin)
            if len(entries) < _READ_BATCH:
                await asyncio.sleep(_COALESCE_S)

    async def _apply(self, origin: str, event: ReplicaEvent) -> None:
        if isinstance(event, SnapshotWanted):
            sessions = self._own_sessions() if not event.worker_id else [
                s for s in self._own_sessions() if s.worker_id == event.worker_id
            ]
            for snapshot_event in self._snapshots(sessions, requester=origin):
                self._outbox.put(snapshot_event)
            if not event.worker_id:
                self._outbox.put(SnapshotDone(origin))
        elif isinstance(event, SnapshotDone):
            if event.requester == self.replica_id:
                self._waiting_for.discard(origin)
                if not self._waiting_for:
                    self.ready.set()
        elif isinstance(event, PolicyChanged):
            await self._updates.follow(abort_running=event.abort_running)
        else:
            self._applier.apply(origin, event)

    async def _check_stream(self) -> None:
        """After a store outage: a stream that vanished or was trimmed past our cursor lost
        events we never applied; ask every owner for its workers again."""
        # The cursor as it was before asking: the tailer moves it on meanwhile, and a cursor
        # read after the answer could be past a last id that was current when Redis answered.
        cursor = parse_entry_id(self._cursor)
        bounds = await self._store.stream_bounds(self._stream)
        lost = (bounds.last_id is None and cursor != (0, 0)) or (
            bounds.last_id is not None and parse_entry_id(bounds.last_id) < cursor
        ) or (bounds.first_id is not None and parse_entry_id(bounds.first_id) > cursor
              and cursor != (0, 0))
        if lost:
            self.counters.resnapshots += 1
            log.warning("replication.stream_lost", replica=self.replica_id, cursor=self._cursor,
                        first=bounds.first_id, last=bounds.last_id)
            if bounds.last_id is not None and parse_entry_id(bounds.last_id) < cursor:
                self._cursor = bounds.last_id  # a new stream: its ids start over
            self._outbox.mark_dirty(want_all=True)  # our own workers are re-published too

    async def _announce_forever(self) -> None:
        """Keep this replica listed as live. (Policy changes whose event was lost are caught by
        the service's periodic policy read, ``CoordinatorReplica._read_policy_forever``.)"""
        period = self._config.heartbeat_ms / 1000
        while not self._stopping:
            await asyncio.sleep(period)
            try:
                await self._announce()
                self.live = await self._store.live_replicas(shard=self._shard)
                await self._check_stream()
            except StoreUnavailable:
                pass  # the tailer and publisher log the outage and recover from it
            except Exception:
                log.exception("replication.announce_failed")

    async def _announce(self) -> None:
        await self._store.announce_replica(self.replica_id, self._config.lease_ms,
                                           shard=self._shard)

    # ------------------------------------------------------------------ observations

    def lag_quantile(self, q: float) -> float | None:
        """The ``q`` quantile of recent publish-to-apply lags in ms; None before any."""
        if not self.lags_ms:
            return None
        ordered = sorted(self.lags_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    @property
    def queued(self) -> int:
        return len(self._outbox.events)


def _backoff(attempt: int) -> float:
    ceiling = min(2.0, 0.05 * 2.0 ** min(attempt, 10))
    return ceiling / 2 + random.uniform(0.0, ceiling / 2)
