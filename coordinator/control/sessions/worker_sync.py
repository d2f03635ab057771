"""``WorkerSync``: the Register/Sync state machine for every worker of this replica.

Keeps the index true: event batches apply in sequence order per incarnation, a gap asks the
worker for its full inventory instead of guessing, a regression or a stale incarnation is a
protocol violation (FailedPrecondition ends the stream). A closed stream or a lapsed lease makes a
worker unroutable at once; its entries go after a grace period. Every stream this module ends
names its ``coordinator.wire.Reason`` (the details text is for people and logs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog

from coordinator.config import CoordinatorConfig
from coordinator.control.policy import HighWater, PolicyView
from coordinator.control.replication_sink import ReplicationSink
from coordinator.control.sessions.registration_checks import check_registration
from coordinator.control.sessions.resync_staging import InventoryStaging
from coordinator.control.sessions.sync_messages import (
    Ack,
    HeartbeatIn,
    InventoryIn,
    Outbound,
    Registration,
    RegistrationRequest,
    Resync,
    StreamCloser,
    StreamSender,
    Welcome,
)
from coordinator.control.sessions.worker_streams import WorkerStreams
from coordinator.control.shard_members import SHARD
from coordinator.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
)
from coordinator.core.fleet import BatchVerdict, Fleet, RegisteredWorker
from coordinator.core.fleet.registered_worker import PAGE_BOUND_FACTOR
from coordinator.core.hashing import HashConfig
from coordinator.core.index import PageEvent, PagesStored, PrefixIndex
from coordinator.store.protocol import MetadataStore, StoreUnavailable
from coordinator.wire import Reason

log = structlog.get_logger(__name__)


DEREGISTERED = "deregistered"
"""The drop reason replicas tell each other for a worker that left for good (its stream ends
with ``Reason.DEREGISTERED``: it must not register again)."""


@dataclass(slots=True)
class SyncCounters:
    events_applied: int = 0
    resyncs: int = 0
    acks_merged: int = 0  # acks not written: a later (cumulative) one covered them


class WorkerSync:
    """Owns the fleet's sessions and applies what workers send to the index."""

    def __init__(
        self,
        *,
        config: CoordinatorConfig,
        hash_config: HashConfig,
        index: PrefixIndex,
        fleet: Fleet,
        store: MetadataStore,
        policy: PolicyView,
        streams: WorkerStreams,
        replication: ReplicationSink,
        high_water: HighWater,
        clock: Callable[[], float],
        replica_id: str = "local",
    ) -> None:
        """``policy``: the state a Register is answered with; told (before the answer) the
        version each worker reports having loaded, to check it against the store.
        ``streams``: the stream table shared with policy updates. ``replication``: told what
        this replica's workers changed."""
        self.replica_id = replica_id
        self.high_water = high_water
        self._config = config
        self._hash_config = hash_config
        self._index = index
        self._fleet = fleet
        self._store = store
        self._policy = policy
        self._streams = streams
        self._replication = replication
        self._clock = clock
        self._resyncs = InventoryStaging(config.max_pages_per_worker)
        # worker id -> (versions its last incarnation served, until when): rollout records of
        # generations that finish after the worker was dropped are still attributable.
        self._departed: dict[str, tuple[frozenset[int], float]] = {}
        self.counters = SyncCounters()

    # ------------------------------------------------------------------ registration

    async def register(self, req: RegistrationRequest) -> Registration:
        """Admit a worker under a new incarnation; any older incarnation's entries are dropped."""
        check_registration(req, self._hash_config)
        cfg = self._config
        # Before the answer: it names the version to serve, never one below what the worker
        # already holds (the store may have forgotten it). Not an external worker's: a bridge
        # serves the version its operator gave it, which is no evidence of what was served.
        if not req.external:
            await self._policy.worker_reported(req.policy_version)
        # Above every incarnation seen here too, should the store have lost its counter.
        current = self._fleet.get(req.worker_id)
        known = max(self.high_water.incarnation(req.worker_id),
                    0 if current is None else current.incarnation)
        record = await self._store.register_worker(
            req.worker_id,
            address=req.address,
            policy_version=req.policy_version,
            external=req.external,
            lease_ms=cfg.lease_ms,
            info={"model": req.model or cfg.default_model, "total_pages": str(req.total_pages),
                  "host_pages": str(req.host_pages), **({SHARD: cfg.shard} if cfg.shard else {})},
            min_incarnation=known + 1,
        )
        session = RegisteredWorker(
            worker_id=req.worker_id,
            incarnation=record.incarnation,
            address=req.address,
            model=req.model or cfg.default_model,
            policy_version=req.policy_version,
            external=req.external,
            total_pages=req.total_pages,
            host_pages=req.host_pages,
            lease_deadline=self._clock() + cfg.lease_ms / 1000,
            owner=self.replica_id,
            http_url=req.http_url,
        )
        self.install(session, "worker re-registered: this stream's incarnation is stale")
        self._replication.registered(session)
        log.info(
            "worker.registered", worker=req.worker_id, incarnation=record.incarnation,
            address=req.address, policy_version=req.policy_version,
        )
        return Registration(
            incarnation=record.incarnation,
            policy=self._policy.record,
            lease_ms=cfg.lease_ms,
            heartbeat_ms=cfg.heartbeat_ms,
            max_events_per_batch=cfg.max_events_per_batch,
            max_message_bytes=cfg.max_message_bytes,
        )

    async def deregister(self, worker_id: str, incarnation: int) -> None:
        """Remove a worker for good (graceful shutdown, a pod's preStop); refused for a stale
        incarnation. Its stream ends with FAILED_PRECONDITION, reason DEREGISTERED, which a
        worker takes as final (it does not register again)."""
        self._fleet.require(worker_id, incarnation)
        await self._store.deregister_worker(worker_id, incarnation)
        self._drop(worker_id, reason="deregistered", final=True)

    def served_versions_of(self, worker_id: str) -> set[int] | None:
        """The versions the worker's current incarnation served, or, for a worker dropped less
        than ``drop_grace_ms`` ago, the last incarnation's (its in-flight generations' rollout
        records may still arrive); None for a worker never heard of."""
        session = self._fleet.get(worker_id)
        if session is not None:
            return session.served_versions
        departed = self._departed.get(worker_id)
        if departed is None or departed[1] <= self._clock():
            return None
        return set(departed[0])

    def install(self, session: RegisteredWorker, message: str) -> None:
        """Make ``session`` the worker's current one: an older incarnation's entries go, and
        its stream (if on this replica) ends with FAILED_PRECONDITION, reason REREGISTER, and
        ``message``."""
        self.high_water.saw_incarnation(session.worker_id, session.incarnation)
        if self._fleet.put(session) is not None:
            self._index.drop_worker(session.worker_id)
        self._streams.close(session.worker_id, message, Reason.REREGISTER)
        self._resyncs.discard(session.worker_id)

    def is_local(self, session: RegisteredWorker) -> bool:
        """Whether this replica owns the worker (holds, or last held, its stream)."""
        return session.owner == self.replica_id or self._streams.has_stream(session.worker_id)

    def _drop(self, worker_id: str, *, reason: str, final: bool = False) -> None:
        session = self._fleet.get(worker_id)
        if session is not None and self.is_local(session):
            self._replication.dropped(session, reason)
        self.forget(worker_id, reason, final=final)

    def forget(self, worker_id: str, reason: str, *, final: bool = False) -> None:
        """Remove the worker and its entries here (its stream, if any, ends: with reason
        DEREGISTERED when ``final``, else REREGISTER)."""
        session = self._fleet.remove(worker_id)
        if session is not None:
            grace = self._config.drop_grace_ms / 1000
            self._departed[worker_id] = (frozenset(session.served_versions),
                                         self._clock() + grace)
        dropped = self._index.drop_worker(worker_id)
        if final:
            self._streams.close(worker_id, f"worker {DEREGISTERED}: it left the fleet",
                         Reason.DEREGISTERED)
        else:
            self._streams.close(worker_id, f"worker dropped ({reason}): re-register",
                                Reason.REREGISTER)
        self._resyncs.discard(worker_id)
        log.info("worker.dropped", worker=worker_id, reason=reason, entries=dropped)

    # ------------------------------------------------------------------ the Sync stream

    def hello(
        self, worker_id: str, incarnation: int, last_acked_seq: int, close: StreamCloser,
        send: StreamSender,
    ) -> tuple[RegisteredWorker, int, list[Outbound]]:
        """Attach a stream to a session. A newer stream supersedes an older one (the worker
        reconnected before we noticed the old one die): the older one is closed with
        FAILED_PRECONDITION, reason SUPERSEDED, at once. ``close`` ends this stream with an
        error later (``WorkerStreams.close``); ``send`` pushes a coordinator-initiated message
        (a policy command) onto it. Returns (session, stream id, replies)."""
        # Kept even when refused: a worker a restarted coordinator forgot says here which
        # incarnation it had, and its next registration must get a higher one.
        self.high_water.saw_incarnation(worker_id, incarnation)
        session = self._fleet.require(worker_id, incarnation)
        stream_id = self._streams.attach(worker_id, close, send)
        session.connected = True
        session.disconnected_at = None
        session.lease_deadline = self._clock() + self._config.lease_ms / 1000
        session.owner = self.replica_id
        self._fleet.changed()
        self._replication.attached(session)
        replies: list[Outbound] = [Welcome(session.next_seq)]
        if session.resync_id is not None:
            # The stream that carried the open resync died: ask again on this one, or the
            # worker (which never saw the request) would wait forever for acks.
            replies.append(self._start_resync(session, "resync interrupted by reconnect"))
        elif last_acked_seq >= session.next_seq:
            # The worker saw acks we have no memory of: our view of it cannot be trusted.
            replies.append(self._start_resync(session, "acked sequence ahead of coordinator"))
        log.info("worker.connected", worker=worker_id, incarnation=incarnation, stream=stream_id)
        return session, stream_id, replies

    def owns(self, session: RegisteredWorker, stream_id: int) -> bool:
        """Whether ``stream_id`` is still the stream attached to ``session``."""
        return (self._streams.is_current(session.worker_id, stream_id)
                and self._fleet.get(session.worker_id) is session)

    def disconnect(self, session: RegisteredWorker, stream_id: int) -> None:
        """The stream ended: the worker is unroutable from now on (entries kept for the grace)."""
        if not self.owns(session, stream_id):
            return
        self._streams.release(session.worker_id, stream_id)
        session.connected = False
        session.disconnected_at = self._clock()
        self._fleet.changed()
        self._replication.detached(session)
        log.info("worker.disconnected", worker=session.worker_id, stream=stream_id)

    def _start_resync(self, session: RegisteredWorker, reason: str) -> Resync:
        self.counters.resyncs += 1
        return self._resyncs.open(session, reason)

    def events(
        self, session: RegisteredWorker, seq: int, events: Sequence[PageEvent]
    ) -> list[Outbound]:
        """Apply one event batch in order; a gap answers with a resync request, never a guess.

        Every check runs before any state changes: a refused batch (over a limit) leaves the
        index and the expected sequence number as they were, so the worker's reconnect is
        told to send it again."""
        if len(events) > self._config.max_events_per_batch:
            raise InvalidArgument(
                f"event batch has {len(events)} events, over the limit of "
                f"{self._config.max_events_per_batch}"
            )
        verdict = session.check_batch(seq)
        if verdict is BatchVerdict.SKIP:
            return []
        if verdict is BatchVerdict.GAP:
            return [self._start_resync(session, f"sequence gap: got {seq}, "
                                                f"expected {session.next_seq}")]
        self._check_page_limit(session, sum(len(e.keys) for e in events
                                              if type(e) is PagesStored))
        session.advance(seq)
        self._index.apply(session.worker_id, events)
        session.observe_page_events(events, self._clock())
        self.counters.events_applied += len(events)
        self._replication.pages(session, seq, events)
        return [Ack(seq)]

    def _check_page_limit(self, session: RegisteredWorker, stored: int) -> None:
        """ResourceExhausted when ``stored`` more keys could take the worker past
        ``max_pages_per_worker`` or its ``page_bound`` (4x its device and host pages). Counted
        before de-duplication: a bound, never a guess."""
        cap = self._config.max_pages_per_worker
        limit = min(cap, session.page_bound)
        held = self._index.held_count(session.worker_id)
        if held + stored > limit:
            which = "max_pages_per_worker" if limit == cap else (
                f"{PAGE_BOUND_FACTOR}x its {session.total_pages} device and "
                f"{session.host_pages} host pages")
            raise ResourceExhausted(
                f"worker {session.worker_id!r} holds {held} pages; {stored} more would pass "
                f"the limit of {limit} ({which})",
                reason=Reason.PAGE_CAP, metadata={"limit": str(limit)},
            )

    async def heartbeat(self, session: RegisteredWorker, beat: HeartbeatIn) -> list[Outbound]:
        """Renew the lease (in the store, so every replica sees it) and take the load report."""
        await self.keep_alive(session)
        try:
            if not session.external:
                await self._policy.worker_reported(beat.policy_version)
        except StoreUnavailable as exc:  # checked again at the next heartbeat or poll
            log.warning("worker.version_not_checked", worker=session.worker_id,
                        version=beat.policy_version, error=str(exc))
        session.report_load(beat.load, beat.completed_routes)
        if beat.policy_version != session.policy_version:
            # The worker says which weights it has loaded (after a LoadWeights, an APPLY, or a
            # fenced worker catching up): route it under that version from now on.
            self.set_version(session, beat.policy_version, publish=False)
        self._replication.state(session, beat.completed_routes)
        return []

    async def keep_alive(self, session: RegisteredWorker) -> None:
        """Renew the worker's lease: on its heartbeat, or while this replica holds its stream
        back (``server.sync_stream``: the worker is talking, we are not reading)."""
        cfg = self._config
        try:
            renewed = await self._store.renew_lease(
                session.worker_id, session.incarnation, cfg.lease_ms
            )
        except StoreUnavailable as exc:
            # Redis is down: the worker is alive (it is talking to us), so keep routing to it
            # from memory rather than fail the whole fleet with the store; the lease is renewed
            # in the store with the first heartbeat after it is back.
            log.warning("worker.lease_not_renewed", worker=session.worker_id, error=str(exc))
            renewed = True
        if not renewed:
            raise FailedPrecondition(
                f"lease of worker {session.worker_id!r} incarnation {session.incarnation} "
                "is gone (expired or superseded): re-register", reason=Reason.REREGISTER,
            )
        session.lease_deadline = self._clock() + cfg.lease_ms / 1000

    async def held_alive(self, session: RegisteredWorker) -> None:
        """``keep_alive`` for a stream this replica holds back, told to the other replicas
        too (as a heartbeat's ``State`` would, with no load report of its own)."""
        await self.keep_alive(session)
        self._replication.state(session, 0)

    def set_version(self, session: RegisteredWorker, version: int, *, publish: bool = True) -> None:
        """The worker now serves ``version`` (its keys are hashed under it); ``publish`` tells
        the other replicas."""
        old = self._fleet.set_serving_version(session, version)
        log.info("worker.version", worker=session.worker_id, old=old, new=version)
        if publish:
            self._replication.state(session, 0)

    def inventory(self, session: RegisteredWorker, chunk: InventoryIn) -> list[Outbound]:
        """Stage a resync inventory; the last chunk replaces the worker's holdings at once."""
        keys_by_tier = self._resyncs.add(session, chunk)
        if keys_by_tier is None:
            return []
        self._index.replace_worker(session.worker_id, keys_by_tier)
        session.next_seq = chunk.seq + 1
        self._replication.replaced(session, chunk.seq, keys_by_tier)
        log.info("worker.resynced", worker=session.worker_id,
                 pages=sum(len(keys) for keys in keys_by_tier.values()), seq=chunk.seq)
        return [Ack(chunk.seq)]

    # ------------------------------------------------------------------ liveness

    def reap(self) -> None:
        """Mark lapsed leases unroutable, drop entries of workers gone past the grace period and
        expire old pending entries. Called periodically by the server."""
        now = self._clock()
        for session in self._fleet.lapsed(now):
            session.connected = False
            session.disconnected_at = now
            if self.is_local(session):
                self._replication.detached(session)
            self._streams.close(session.worker_id, "lease lapsed", Reason.LEASE_LAPSED)
            self._fleet.changed()
            log.warning("worker.lease_lapsed", worker=session.worker_id)
        for session in self._fleet.expired(now, self._config.drop_grace_ms / 1000):
            self._drop(session.worker_id, reason="gone past grace period")
        for worker_id in [w for w, (_, until) in self._departed.items() if until <= now]:
            del self._departed[worker_id]
        self._index.expire_pending()

