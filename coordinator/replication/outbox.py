"""``ReplicationOutbox``: what this replica has yet to publish to the others.

The replica's services report their own workers' changes and the policy changes made here
through the ``ReplicationSink`` calls; each becomes an event queued here, in the order it
happened, for the publisher (``Replicator``) to send. The queue is bounded: past
``max_queued`` (a long store outage) it is dropped and the view marked dirty, and the publisher
re-publishes every owned worker as a snapshot once the store answers, which supersedes what was
lost. Every call returns at once.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping, Sequence

import structlog

from coordinator.core.fleet import RegisteredWorker
from coordinator.core.index import PageEvent
from coordinator.core.routing import RouteReservation
from coordinator.replication.events import (
    Attached,
    Cordoned,
    Detached,
    Dropped,
    Pages,
    PolicyChanged,
    Registered,
    Replaced,
    ReplicaEvent,
    Routed,
    RoutesEnded,
    SnapshotWanted,
    State,
)

log = structlog.get_logger(__name__)

MAX_QUEUED = 200_000
"""Events waiting to be published; past it the view is re-snapshotted instead."""


class ReplicationOutbox:
    """The bounded queue of events to publish; implements ``ReplicationSink``.

    ``dirty``: the queue lost events (full, or a publish failed): re-publish every owned worker
    once the store answers; ``want_all``: with that, ask every other replica for theirs too."""

    def __init__(self, max_queued: int = MAX_QUEUED) -> None:
        self.events: deque[ReplicaEvent] = deque()
        self.wake = asyncio.Event()  # set when there is something to publish
        self.dirty = False
        self.want_all = False
        self._max_queued = max_queued

    def put(self, event: ReplicaEvent) -> None:
        """Queue ``event`` (dropped while dirty: the snapshot to come covers it)."""
        if self.dirty:
            return
        if len(self.events) >= self._max_queued:
            log.warning("replication.queue_full", queued=len(self.events))
            self.events.clear()
            self.dirty = True
            return
        self.events.append(event)
        self.wake.set()

    def mark_dirty(self, *, want_all: bool = False) -> None:
        """The publisher is to re-publish every owned worker (what is queued is then moot)."""
        self.dirty = True
        self.want_all = self.want_all or want_all
        self.wake.set()

    def snapshot_wanted(self, worker_id: str) -> None:
        """Ask the owner of ``worker_id`` (every replica, for "") for a snapshot."""
        self.put(SnapshotWanted(worker_id))

    # ------------------------------------------------------------------ ReplicationSink

    def registered(self, session: RegisteredWorker) -> None:
        self.put(registered_event(session))

    def attached(self, session: RegisteredWorker) -> None:
        self.put(Attached(session.worker_id, session.incarnation, session.next_seq))

    def detached(self, session: RegisteredWorker) -> None:
        self.put(Detached(session.worker_id, session.incarnation))

    def pages(self, session: RegisteredWorker, seq: int, events: Sequence[PageEvent]) -> None:
        self.put(Pages(session.worker_id, session.incarnation, seq, tuple(events)))

    def replaced(self, session: RegisteredWorker, seq: int,
                 keys_by_tier: Mapping[str, Sequence[bytes]]) -> None:
        by_tier = {tier: tuple(keys) for tier, keys in keys_by_tier.items()}
        self.put(Replaced(session.worker_id, session.incarnation, seq, by_tier))

    def state(self, session: RegisteredWorker, completed_routes: int) -> None:
        self.put(state_event(session, completed_routes))

    def dropped(self, session: RegisteredWorker, reason: str) -> None:
        self.put(Dropped(session.worker_id, session.incarnation, reason))

    def cordoned(self, session: RegisteredWorker) -> None:
        self.put(Cordoned(session.worker_id, session.cordoned))

    def policy_changed(self, abort_running: bool) -> None:
        self.put(PolicyChanged(abort_running))

    # ------------------------------------------------------------------ the router's decisions

    def routed(self, reservation: RouteReservation) -> None:
        self.put(Routed(reservation))

    def routes_ended(self, route_ids: tuple[str, ...]) -> None:
        self.put(RoutesEnded(route_ids))


def registered_event(session: RegisteredWorker) -> Registered:
    return Registered(session.worker_id, session.incarnation, session.address, session.model,
                      session.policy_version, session.external, session.total_pages,
                      session.http_url, session.host_pages)


def state_event(session: RegisteredWorker, completed_routes: int) -> State:
    return State(session.worker_id, session.incarnation, session.policy_version, session.load,
                 completed_routes, session.draining, session.fenced)
