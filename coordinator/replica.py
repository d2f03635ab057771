"""The coordinator's domain service: the composition root that builds the index, fleet, router,
policy view, routing gate and updates, worker sessions and replication in dependency order, and
answers the operator questions (workers, stats, cordon, policy state).

The gRPC servicer is a thin adapter over this; tests and the benchmark can drive it directly.
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from coordinator.config import CoordinatorConfig
from coordinator.control.decision_log import DecisionLog
from coordinator.control.policy import HighWater, PolicyView
from coordinator.control.policy_updates import PolicyUpdates
from coordinator.control.replication_sink import NoReplication, ReplicationSink
from coordinator.control.rollouts import RolloutLog
from coordinator.control.routing_gate import RoutingGate
from coordinator.control.sessions import WorkerStreams, WorkerSync
from coordinator.control.sessions.held_streams import HeldStreams
from coordinator.control.sessions.ingest_governor import IngestGovernor
from coordinator.control.shard_members import ShardRecords
from coordinator.core.errors import NotFound
from coordinator.core.fleet import Fleet, RegisteredWorker, WorkerStatus
from coordinator.core.hashing import DEV_HASH_KEY, HashAlgorithm, HashConfig, PageHasher
from coordinator.core.index import PrefixIndex, Tier
from coordinator.core.policy_state import PolicyRecord
from coordinator.core.routing import Router, load_floor
from coordinator.core.routing.awaited_routes import AwaitedRoutes
from coordinator.logs import warn_development_key
from coordinator.replication.outbox import ReplicationOutbox
from coordinator.replication.replicator import Replicator, default_replica_id
from coordinator.store import open_store
from coordinator.store.protocol import MetadataStore, StoreUnavailable

log = structlog.get_logger(__name__)


def hash_config_from(config: CoordinatorConfig) -> HashConfig:
    """The deployment's hash configuration; the development key (with a warning) when unset."""
    algorithm = HashAlgorithm(config.hash_algorithm)
    if config.hash_key is None:
        warn_development_key()
        return HashConfig(key=DEV_HASH_KEY, algorithm=algorithm, page_size=config.page_size)
    return HashConfig.from_hex_key(
        config.hash_key, algorithm=algorithm, page_size=config.page_size
    )


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What operators see of one worker (ListWorkers, ``kvcoord status``)."""

    session: RegisteredWorker
    status: WorkerStatus
    cached_by_tier: dict[Tier, int]  # the index's holdings of the worker, every tier named
    prefill_backlog_tokens: float = 0.0  # kv_aware's books at the time of the view

    @property
    def cached_pages(self) -> int:
        return sum(self.cached_by_tier.values())


@dataclass(frozen=True, slots=True)
class StatsSnapshot:
    workers: int
    routable_workers: int
    index_keys: int
    index_entries: int
    pending_entries: int
    lookups: int
    routes: int
    prompt_tokens: int
    cached_tokens: int
    events_applied: int
    resyncs: int
    policy: PolicyRecord
    store: str
    replica_id: str = ""
    replicas: tuple[str, ...] = ()
    replication_published: int = 0
    replication_applied: int = 0
    replication_lag_p50_ms: float = 0.0
    replication_lag_p99_ms: float = 0.0
    acks_merged: int = 0

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class CoordinatorReplica:
    """Composition root of the coordinator's state. ``start``/``stop`` run the reaper task."""

    def __init__(
        self,
        config: CoordinatorConfig,
        store: MetadataStore,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        replicate: bool = False,
    ) -> None:
        """``replicate``: share the index with the other replicas on ``store`` through its
        events stream (``coordinator.replication``); on by default with Redis."""
        self.config = config
        self.store = store
        self.clock = clock
        # Parts in dependency order; each is handed what it uses, nothing is patched later.
        self.hash_config = hash_config_from(config)
        self.hasher = PageHasher(self.hash_config, cache_pages=config.hash_cache_pages)
        self.index = PrefixIndex(
            clock=clock,
            pending_ttl=config.pending_ttl_ms / 1000,
            max_pending=config.max_pending_entries,
        )
        weights = config.kv_weights()
        self.fleet = Fleet(load_floor=functools.partial(load_floor, weights=weights),
                           backlog_weight=weights.queued_token,
                           prefill_tokens_per_s=config.prefill_tokens_per_s)
        # What this process has seen of versions and incarnations: a store that forgets them
        # (Redis without persistence, the embedded store after a restart) is caught by it.
        high_water = HighWater()
        self.policy_view = PolicyView(config=config, store=store, high_water=high_water,
                                      clock=clock)
        self.outbox = ReplicationOutbox() if replicate else None
        shared_routes = self.outbox if self.outbox is not None and config.share_routes else None
        self.router = Router(
            hasher=self.hasher,
            index=self.index,
            fleet=self.fleet,
            page_size=config.page_size,
            default_model=config.default_model,
            default_routing=config.routing_policy,
            serving_version=self.policy_view.serving_version,
            servable_versions=self.policy_view.servable_versions,
            clock=clock,
            rng=rng if rng is not None or config.routing_seed is None
            else random.Random(config.routing_seed),
            weights=weights,
            max_inflight=config.max_inflight_per_worker,
            awaited=AwaitedRoutes(ttl_s=config.route_end_ttl_ms / 1000,
                                  capacity=config.max_inflight_per_worker),
            on_routed=shared_routes.routed if shared_routes else None,
            on_routes_ended=shared_routes.routes_ended if shared_routes else None,
            decision_sink=DecisionLog(self.fleet) if config.decision_log else None,
        )
        # What Route and RouteBatch call: a drain waited out, a fresh policy state, the router.
        self.routing_gate = RoutingGate(policy_view=self.policy_view, router=self.router)
        self.ingest = IngestGovernor(config.ingest_max_share,
                                     max_ack_delay_s=config.max_ack_delay_ms / 1000)
        self.streams = WorkerStreams()
        replication: ReplicationSink = self.outbox or NoReplication()
        # With shards, the other shards read this shard's workers from their store records.
        self.shard_records = ShardRecords(replication, store, refresh_s=config.lease_ms / 1000,
                                          clock=clock) if config.shard else None
        replication = self.shard_records or replication
        self.replication = replication
        self.worker_sync = WorkerSync(
            config=config,
            hash_config=self.hash_config,
            index=self.index,
            fleet=self.fleet,
            store=store,
            policy=self.policy_view,
            streams=self.streams,
            replication=replication,
            high_water=high_water,
            clock=clock,
            replica_id=config.replica_id or default_replica_id(),
        )
        # Streams waiting for the ingest budget: the reaper renews their workers' leases.
        self.held_streams = HeldStreams(self.worker_sync, config.heartbeat_ms / 1000, clock)
        self.updates = PolicyUpdates(
            config=config, store=store, fleet=self.fleet, view=self.policy_view,
            streams=self.streams, replication=replication, clock=clock,
        )
        self.replicator: Replicator | None = None
        if self.outbox is not None:
            self.replicator = Replicator(
                config=config, store=store, fleet=self.fleet, index=self.index,
                sessions=self.worker_sync, streams=self.streams, updates=self.updates,
                outbox=self.outbox, clock=clock,
                router=self.router if config.share_routes else None,
            )
        self.rollouts = RolloutLog(store, maxlen=config.max_rollouts)
        self._reaper: asyncio.Task[None] | None = None
        self._policy_reader: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def policy(self) -> PolicyRecord:
        """This coordinator's view of the policy state (the store holds the truth)."""
        return self.policy_view.record

    @classmethod
    async def open(cls, config: CoordinatorConfig, **kwargs: object) -> CoordinatorReplica:
        """Open the configured store (embedded when no Redis URL) and load the policy state."""
        # A store call must give up well inside a lease: a heartbeat waits on it, and an
        # unreachable (not refusing) Redis must not lapse every worker while it times out.
        timeout = min(5.0, config.lease_ms / 3000)
        store = await open_store(config.redis, namespace=config.store_namespace,
                                 timeout_s=timeout)
        kwargs.setdefault("replicate", config.redis is not None and config.replication)
        service = cls(config, store, **kwargs)  # type: ignore[arg-type]
        await service.policy_view.refresh()
        if config.redis is None:  # a fresh logger, as MemoryStore's own warning
            structlog.get_logger(__name__).warning(
                "coordinator.embedded_store_restarts",
                detail="with the embedded store a restart forgets the rollout records (by "
                "design: use --redis to keep them); the policy version and worker "
                "incarnations are recovered from what reconnecting workers report",
            )
        return service

    @property
    def replica_id(self) -> str:
        return self.worker_sync.replica_id

    async def start(self) -> None:
        """Start the reaper and, with replicas, replication (``wait_ready`` for its bootstrap)."""
        if self.replicator is not None:
            await self.replicator.start()
        self._reaper = asyncio.create_task(self._reap_forever(), name="kvcoord-reaper")
        self._policy_reader = asyncio.create_task(self._read_policy_forever(),
                                                  name="kvcoord-policy-reader")
        self.ingest.start()

    async def wait_ready(self) -> None:
        """Return once this replica's index holds the other replicas' workers (or they did not
        answer within the bootstrap timeout); at once without replication."""
        if self.replicator is not None:
            await self.replicator.wait_ready()

    async def before_hello(self, worker_id: str, incarnation: int, last_acked_seq: int) -> None:
        """A worker arriving from another replica may be ahead of what this replica has applied
        of the events stream: catch up first (briefly), so it resumes instead of resyncing."""
        if self.replicator is None:
            return
        session = self.fleet.get(worker_id)
        if session is None or session.incarnation < incarnation or (
                session.incarnation == incarnation and session.next_seq <= last_acked_seq):
            await self.replicator.caught_up(timeout=0.5)

    async def stop(self) -> None:
        self._stopping = True
        tasks = [t for t in (self._reaper, self._policy_reader) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)
        await self.ingest.stop()
        if self.shard_records is not None:
            await self.shard_records.stop()
        if self.replicator is not None:
            await self.replicator.flush()
            await self.replicator.stop()
        await self.store.close()

    async def _reap_forever(self) -> None:
        interval = self.config.reaper_interval_ms / 1000
        while not self._stopping:  # not only cancel: see Replicator._stopping
            await asyncio.sleep(interval)
            try:
                self.worker_sync.reap()
                await self.held_streams.renew(self.config.lease_ms / 1000)
                self.router.expire_awaited()
                await self.updates.expire()
            except Exception:  # the reaper must outlive any one bad pass
                log.exception("reaper.failed")

    async def _read_policy_forever(self) -> None:
        """Re-read the policy state every ``policy_read_s``: changes made through other
        replicas are followed, a store that went back is restored, and routes keep flowing
        only while these reads succeed (``PolicyView.check_fresh``)."""
        interval = self.config.policy_read_s
        failing = False
        while not self._stopping:
            await asyncio.sleep(interval)
            try:
                await self.updates.follow()
                if failing:
                    log.info("policy.read_recovered")
                failing = False
            except StoreUnavailable as exc:
                if not failing:  # once per outage; routes stop after policy_stale_ms
                    log.warning("policy.read_failed", error=str(exc),
                                stale_after_ms=self.config.policy_stale_s * 1000)
                failing = True
            except Exception:  # the reader must outlive any one bad pass
                log.exception("policy.read_crashed")

    async def refresh_policy(self) -> PolicyRecord:
        """Re-read the policy state from the store (the source of truth across replicas)."""
        return await self.policy_view.refresh()

    def workers(self) -> list[WorkerView]:
        now = self.clock()
        views = []
        for session in sorted(self.fleet, key=lambda s: s.worker_id):
            cached = self.index.held_by_tier(session.worker_id)
            views.append(WorkerView(session, session.status(now), cached,
                                    session.prefill_backlog(now)))
        return views

    def cordon(self, worker_id: str, cordoned: bool) -> WorkerView:
        """Take a worker out of (or back into) routing without disconnecting it."""
        session = self.fleet.get(worker_id)
        if session is None:
            raise NotFound(f"unknown worker {worker_id!r}")
        session.cordoned = cordoned
        self.fleet.changed()
        self.replication.cordoned(session)
        log.info("worker.cordoned" if cordoned else "worker.uncordoned", worker=worker_id)
        cached = self.index.held_by_tier(worker_id)
        now = self.clock()
        return WorkerView(session, session.status(now), cached, session.prefill_backlog(now))

    def stats(self) -> StatsSnapshot:
        now = self.clock()
        index = self.index.stats()
        counters = self.router.counters
        replication: dict[str, object] = {}
        replicator = self.replicator
        if replicator is not None:
            replication = {
                "replica_id": self.replica_id, "replicas": tuple(replicator.live),
                "replication_published": replicator.counters.published,
                "replication_applied": replicator.counters.applied,
                "replication_lag_p50_ms": replicator.lag_quantile(0.5) or 0.0,
                "replication_lag_p99_ms": replicator.lag_quantile(0.99) or 0.0,
            }
        return StatsSnapshot(
            workers=len(self.fleet),
            routable_workers=sum(
                1 for s in self.fleet if s.status(now) is WorkerStatus.READY
            ),
            index_keys=index.keys,
            index_entries=index.holdings,
            pending_entries=index.pending,
            lookups=counters.lookups,
            routes=counters.routes,
            prompt_tokens=counters.prompt_tokens,
            cached_tokens=counters.cached_tokens,
            events_applied=self.worker_sync.counters.events_applied,
            resyncs=self.worker_sync.counters.resyncs,
            acks_merged=self.worker_sync.counters.acks_merged,
            policy=self.policy,
            store=type(self.store).__name__,
            **replication,  # type: ignore[arg-type]
        )
