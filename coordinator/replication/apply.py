"""Applying other replicas' events (``coordinator.replication.events``) to this replica's fleet and
index, so that it answers lookups as the worker's owner does.

Pure core: no grpc, redis or asyncio. Rules that keep every replica's view convergent:

- an event for an older incarnation than the one known here is ignored; a newer
  ``Registered`` replaces the session (and ends a stream this replica still had for it);
- page batches apply in the worker's own sequence order: a batch already seen is skipped, a
  batch past a gap is not guessed at but answered with a snapshot request to the owner, whose
  ``Replaced`` (holdings as of a sequence number) puts this replica right;
- a worker whose stream is on this replica is this replica's to describe: others' events about
  it are ignored, except a newer registration or an ``Attached`` (the worker moved: its stream
  here is stale and is closed);
- a remote worker stays routable only while its owner's events keep its lease: when the owner
  dies its workers lapse here after one lease, like a worker whose stream closed;
- a route another replica chose (``Routed``) counts here whoever owns the worker, its own
  included: its pending entries and in-flight load are the fleet's, not the chooser's
  (``Router.take_reservation``); heartbeats settle it on every replica alike. A route ended
  before it arrives here is settled at once (``core.routing.awaited_routes``);
- the routes in flight to a worker (``InFlight``, part of the owner's snapshot) are taken only
  by the replica that asked for the snapshot (one that joined): the others counted each route.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import structlog

from coordinator.config import CoordinatorConfig
from coordinator.control.sessions import WorkerStreams, WorkerSync
from coordinator.control.sessions.worker_sync import DEREGISTERED
from coordinator.core.fleet import Fleet, RegisteredWorker
from coordinator.core.index import PrefixIndex
from coordinator.core.routing import Router
from coordinator.replication.events import (
    Attached,
    Cordoned,
    Detached,
    Dropped,
    InFlight,
    Pages,
    Registered,
    Replaced,
    ReplicaEvent,
    Routed,
    RoutesEnded,
    State,
)
from coordinator.wire import Reason

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class ApplyCounters:
    applied: int = 0
    ignored: int = 0
    gaps: int = 0


class ReplicaApplier:
    """Applies worker events from other replicas. ``want_snapshot(worker_id)`` is called when
    this replica's view of a worker cannot be trusted (a gap, or a worker never heard of)."""

    def __init__(
        self, *, config: CoordinatorConfig, fleet: Fleet, index: PrefixIndex,
        sessions: WorkerSync, streams: WorkerStreams, clock: Callable[[], float],
        want_snapshot: Callable[[str], None], router: Router | None = None,
    ) -> None:
        """``router``: takes other replicas' routes (None: they are ignored)."""
        self._config = config
        self._router = router
        self._fleet = fleet
        self._index = index
        self._sessions = sessions
        self._streams = streams
        self._clock = clock
        self._want_snapshot = want_snapshot
        self._wanted: set[str] = set()  # workers with a snapshot asked for and not yet seen
        self.counters = ApplyCounters()

    def apply(self, origin: str, event: ReplicaEvent) -> None:
        """Apply one worker event published by replica ``origin`` (not this one)."""
        if isinstance(event, Routed | RoutesEnded | InFlight):
            self._route_event(event)
        elif isinstance(event, Registered):
            self._registered(origin, event)
        elif isinstance(event, Cordoned):
            session = self._fleet.get(event.worker_id)
            if session is not None and session.cordoned != event.cordoned:
                session.cordoned = event.cordoned
                self._fleet.changed()
            self.counters.applied += 1
        else:
            session = self._session(event, ask=not isinstance(event, Detached | Dropped))
            if session is None:
                self.counters.ignored += 1
                return
            self.counters.applied += 1
            if isinstance(event, Attached):
                self._attached(origin, session, event)
            elif self._streams.has_stream(session.worker_id):
                self.counters.ignored += 1  # ours to describe: a late event of an old owner
            elif isinstance(event, Pages):
                self._pages(session, event)
            elif isinstance(event, Replaced):
                self._index.replace_worker(session.worker_id, event.keys_by_tier)
                session.next_seq = event.seq + 1
                self._wanted.discard(session.worker_id)
            elif isinstance(event, State):
                self._state(origin, session, event)
            elif isinstance(event, Detached):
                if session.owner == origin and session.connected:
                    session.connected = False
                    session.disconnected_at = self._clock()
                    self._fleet.changed()
            elif isinstance(event, Dropped):
                self._sessions.forget(session.worker_id, f"{event.reason} (replica {origin})",
                                      final=event.reason == DEREGISTERED)

    def _route_event(self, event: Routed | RoutesEnded | InFlight) -> None:
        if self._router is None:
            self.counters.ignored += 1
        elif isinstance(event, RoutesEnded):
            self._router.end_remote_routes(event.route_ids)
            self.counters.applied += 1
        elif isinstance(event, InFlight):
            if (event.requester == self._sessions.replica_id
                    and self._router.restore_inflight(event.routes)):
                self.counters.applied += 1
            else:
                self.counters.ignored += 1  # another replica's snapshot, or a stale one
        elif self._router.take_reservation(event.reservation):
            self.counters.applied += 1
        else:
            self.counters.ignored += 1  # routed to an incarnation this replica does not know

    def _session(self, event: ReplicaEvent, *, ask: bool) -> RegisteredWorker | None:
        """The session the event is about, when the incarnations match. A worker this replica
        has never heard of gets a snapshot request (we joined after its registration)."""
        worker_id: str = getattr(event, "worker_id", "")
        incarnation: int = getattr(event, "incarnation", 0)
        session = self._fleet.get(worker_id)
        if session is None or session.incarnation < incarnation:
            if ask:
                self._ask(worker_id)
            return None
        return session if session.incarnation == incarnation else None

    def _ask(self, worker_id: str) -> None:
        if worker_id and worker_id not in self._wanted:
            self._wanted.add(worker_id)
            self._want_snapshot(worker_id)

    def _renew(self, session: RegisteredWorker) -> None:
        session.lease_deadline = self._clock() + self._config.lease_ms / 1000

    def _registered(self, origin: str, event: Registered) -> None:
        current = self._fleet.get(event.worker_id)
        if current is not None and current.incarnation >= event.incarnation:
            self.counters.ignored += 1
            return
        session = RegisteredWorker(
            worker_id=event.worker_id, incarnation=event.incarnation, address=event.address,
            model=event.model, policy_version=event.policy_version, external=event.external,
            total_pages=event.total_pages, http_url=event.http_url, host_pages=event.host_pages,
            lease_deadline=self._clock() + self._config.lease_ms / 1000, owner=origin,
        )
        self._sessions.install(session, f"worker re-registered through replica {origin}")
        self._wanted.discard(event.worker_id)
        self.counters.applied += 1
        log.info("replica.worker_registered", worker=event.worker_id,
                 incarnation=event.incarnation, origin=origin)

    def _attached(self, origin: str, session: RegisteredWorker, event: Attached) -> None:
        if self._streams.has_stream(session.worker_id):
            self._streams.close(
                session.worker_id, f"the worker attached to coordinator replica {origin}",
                Reason.SUPERSEDED,
            )
        session.owner = origin
        session.connected = True
        session.disconnected_at = None
        self._renew(session)
        self._fleet.changed()
        if session.next_seq < event.next_seq:
            self._ask(session.worker_id)  # batches we never saw were applied there

    def _pages(self, session: RegisteredWorker, event: Pages) -> None:
        if event.seq < session.next_seq:
            return  # seen already (a snapshot covered it)
        if event.seq > session.next_seq:
            self.counters.gaps += 1
            self._ask(session.worker_id)
            return
        self._index.apply(session.worker_id, event.events)
        session.observe_page_events(event.events, self._clock())
        session.next_seq = event.seq + 1
        self._renew(session)

    def _state(self, origin: str, session: RegisteredWorker, event: State) -> None:
        if session.owner and session.owner != origin:
            return  # a stale heartbeat from the previous owner
        session.owner = origin
        self._renew(session)
        session.report_load(event.load, event.completed_routes)
        changed = (session.draining != event.draining or (event.fenced and not session.fenced)
                   or session.policy_version != event.policy_version)
        session.draining = event.draining
        session.fenced = session.fenced or event.fenced  # fencing never reverts
        if session.policy_version != event.policy_version:
            session.policy_version = event.policy_version
            session.served_versions.add(event.policy_version)
        if changed:
            self._fleet.changed()
