"""Prometheus metrics of one coordinator (``kvcoord_*``), on a registry of its own so several
coordinators in one process (tests, benchmarks) never collide."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from coordinator.control.shard_routing import ShardRouting
from coordinator.replica import CoordinatorReplica
from coordinator.server.sync_relay import SyncFrontends


class CoordinatorMetrics:
    """Request counters and latencies observed by the interceptor; state gauges read lazily from
    the service at scrape time (no work on the request path)."""

    def __init__(self, service: CoordinatorReplica | None = None) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvcoord_coordinator_requests_total", "RPCs answered, by method and status code",
            ["method", "code"], registry=self.registry,
        )
        self.latency = Histogram(
            "kvcoord_coordinator_request_duration_seconds", "Coordinator RPC handling time",
            ["method"], registry=self.registry,
            buckets=(5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.25, 1.0),
        )
        if service is not None:
            self._bind(service)

    def _bind(self, service: CoordinatorReplica) -> None:
        self.registry.register(_StateCollector(service))
        self.ingest_wait = Histogram(
            "kvcoord_ingest_wait_seconds", "How long event batches waited for the ingest "
            "budget (ingest_max_share of the event loop): the lag admission adds",
            registry=self.registry,
            buckets=(1e-3, 5e-3, 2.5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
        service.ingest.on_wait = self.ingest_wait.observe


    def watch_frontends(self, frontends: SyncFrontends) -> None:
        """Export the replica's sync frontends (``server.sync_relay``) at scrape time."""
        self.registry.register(_FrontendCollector(frontends))


    def watch_shards(self, shards: ShardRouting) -> None:
        """Export the shards routes span (``control.shard_routing``) at scrape time."""
        self.registry.register(_ShardCollector(shards))


class _ShardCollector(Collector):
    def __init__(self, shards: ShardRouting) -> None:
        self._shards = shards

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("kvcoord_peer_shards", "Other shards every route is decided "
                                "over", value=len(self._shards.peers))
        unanswered = CounterMetricFamily(
            "kvcoord_shard_unanswered", "Calls to another shard left out of a decision, "
            "lookup or route end (no answer in time, or unavailable)", labels=["shard"])
        for peer in self._shards.peers:
            unanswered.add_metric([peer.name], self._shards.unanswered[peer.name])
        yield unanswered


class _FrontendCollector(Collector):
    def __init__(self, frontends: SyncFrontends) -> None:
        self._frontends = frontends

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("kvcoord_sync_frontends", "Sync frontend processes serving now",
                                value=len(self._frontends.ports))
        by_frontend = GaugeMetricFamily("kvcoord_sync_frontend_streams",
                                        "Sync streams each frontend relays now (0 while down)",
                                        labels=["frontend"])
        for index, count in sorted(self._frontends.streams_by_frontend().items()):
            by_frontend.add_metric([str(index)], count)
        yield by_frontend
        yield CounterMetricFamily("kvcoord_sync_frontend_restarts", "Sync frontends started "
                                  "again after they exited", value=self._frontends.restarts)


class _StateCollector(Collector):
    """Reads the service's stats once per scrape and exposes them as gauges and counters."""

    def __init__(self, service: CoordinatorReplica) -> None:
        self._service = service

    def collect(self) -> Iterator[Metric]:
        s = self._service.stats()
        gauges: list[tuple[str, str, float]] = [
            ("kvcoord_coordinator_workers", "Registered workers", s.workers),
            ("kvcoord_coordinator_routable_workers", "Workers that can take routes",
             s.routable_workers),
            ("kvcoord_index_keys", "Distinct page keys in the global index", s.index_keys),
            ("kvcoord_index_entries", "(key, worker) holdings in the global index",
             s.index_entries),
            ("kvcoord_index_pending_entries", "Pending (routed, unconfirmed) entries",
             s.pending_entries),
            ("kvcoord_policy_version", "Current policy version", s.policy.version),
        ]
        ingest = self._service.ingest
        gauges += [("kvcoord_ingest_waiting_streams", "Sync streams whose next event batch "
                    "waits for the ingest budget now", ingest.waiting),
                   ("kvcoord_ingest_share", "Share of the event loop event batches may take now "
                    "(follows the loop's lag, at most ingest_max_share)", ingest.share)]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = [
            ("kvcoord_lookups", "Lookups answered", s.lookups),
            ("kvcoord_routes", "Prompts routed", s.routes),
            ("kvcoord_route_prompt_tokens", "Prompt tokens routed", s.prompt_tokens),
            ("kvcoord_route_cached_tokens", "Routed prompt tokens already cached on the target",
             s.cached_tokens),
            ("kvcoord_sync_events_applied", "Page events applied from workers",
             s.events_applied),
            ("kvcoord_sync_resyncs", "Resync requests sent to workers", s.resyncs),
            ("kvcoord_sync_acks_merged", "Event-batch acks not written because a later "
             "(cumulative) one covered them (a busy replica's delayed acks)",
             s.acks_merged),
            ("kvcoord_ingest_waited_batches", "Event batches that waited for the ingest budget",
             self._service.ingest.waited),
            ("kvcoord_policy_version_restored",
             "Times the store's policy state was found behind what this coordinator had seen "
             "(data lost) and restored", self._service.policy_view.restores),
        ]
        if s.replica_id:
            counters += [
                ("kvcoord_replication_published", "Replication events this replica published",
                 s.replication_published),
                ("kvcoord_replication_applied", "Other replicas' events this replica applied",
                 s.replication_applied),
            ]
            lag = GaugeMetricFamily(
                "kvcoord_replication_lag_seconds",
                "Publish-to-apply lag of recently applied replication events", labels=["quantile"],
            )
            lag.add_metric(["0.5"], s.replication_lag_p50_ms / 1000)
            lag.add_metric(["0.99"], s.replication_lag_p99_ms / 1000)
            yield lag
            yield GaugeMetricFamily("kvcoord_replicas", "Live coordinator replicas on the store",
                                    value=len(s.replicas))
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
