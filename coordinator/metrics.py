"""Prometheus metrics of one coordinator (``kvcoord_*``), on a registry of its own so several
coordinators in one process (tests, benchmarks) never collide."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from coordinator.service import CoordinatorService, StatsSnapshot


class CoordinatorMetrics:
    """Request counters and latencies observed by the interceptor; state gauges read lazily from
    the service at scrape time (no work on the request path)."""

    def __init__(self, service: CoordinatorService | None = None) -> None:
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

    def _bind(self, service: CoordinatorService) -> None:
        def gauge(name: str, doc: str, read: Callable[[StatsSnapshot], float]) -> None:
            Gauge(name, doc, registry=self.registry).set_function(lambda: read(service.stats()))

        gauge("kvcoord_coordinator_workers", "Registered workers", lambda s: s.workers)
        gauge("kvcoord_coordinator_routable_workers", "Workers that can take routes",
              lambda s: s.routable_workers)
        gauge("kvcoord_index_keys", "Distinct page keys in the global index", lambda s: s.index_keys)
        gauge("kvcoord_index_entries", "(key, worker) holdings in the global index",
              lambda s: s.index_entries)
        gauge("kvcoord_index_pending_entries", "Pending (routed, unconfirmed) entries",
              lambda s: s.pending_entries)
        gauge("kvcoord_route_prompt_tokens", "Prompt tokens routed since start",
              lambda s: s.prompt_tokens)
        gauge("kvcoord_route_cached_tokens", "Routed prompt tokens already cached on the target",
              lambda s: s.cached_tokens)
        gauge("kvcoord_sync_events_applied", "Page events applied from workers",
              lambda s: s.events_applied)
        gauge("kvcoord_sync_resyncs", "Resync requests sent to workers", lambda s: s.resyncs)
        gauge("kvcoord_policy_version", "Current policy version", lambda s: s.policy.version)

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Expose ``/metrics`` over HTTP; returns the bound port (``port=0`` picks a free one)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return int(server.server_port)
