"""Prometheus metrics of one worker (``kvcoord_worker_*``), on a registry of its own so several
workers in one process (tests) never collide. Runtime state is read at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from worker.runtime import RuntimeStats
from worker.sync.sync_metrics import SyncCollector
from worker.sync.sync_protocol import SyncCounters


class WorkerMetrics:
    """Counters fed by the server wrapper and the policy command handler; gauges from ``stats``
    and the Sync client's ``sync`` counts per scrape."""

    def __init__(
        self, stats: Callable[[], RuntimeStats] | None = None, sync: SyncCounters | None = None
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvcoord_worker_requests_total", "Worker RPCs answered, by method and status code",
            ["method", "code"], registry=r,
        )
        self.latency = Histogram(
            "kvcoord_worker_request_duration_seconds", "Worker RPC handling time", ["method"],
            registry=r, buckets=(1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0),
        )
        self.prompt_tokens = Counter(
            "kvcoord_worker_prompt_tokens_total", "Prompt tokens of answered Generate calls, "
            "by whether they came from cached pages or were computed", ["source"], registry=r,
        )
        self.cache_hit_tokens = Counter(
            "kvcoord_worker_cache_hit_tokens_total", "Prompt tokens served from cached KV, by "
            "the tier it was found in (cpu: copied back from the host tier)", ["tier"],
            registry=r,
        )
        self.generated_tokens = Counter(
            "kvcoord_worker_generated_tokens_total", "Completion tokens generated", registry=r,
        )
        self.sync_policy_commands = Counter(
            "kvcoord_worker_sync_policy_commands_total", "Policy commands handled, by kind",
            ["kind"], registry=r,
        )
        if stats is not None:
            r.register(_RuntimeCollector(stats))
        if sync is not None:
            r.register(SyncCollector(sync, "kvcoord_worker_sync"))


class _RuntimeCollector(Collector):
    def __init__(self, stats: Callable[[], RuntimeStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        gauges = [
            ("kvcoord_worker_pages_total", "KV pages in the pool", s.total_pages),
            ("kvcoord_worker_pages_free", "KV pages holding nothing", s.free_pages),
            ("kvcoord_worker_pages_cached", "Reusable KV pages no request references",
             s.cached_pages),
            ("kvcoord_worker_running_requests", "Generate calls running", s.running_requests),
            ("kvcoord_worker_queued_tokens", "Tokens waiting to be computed", s.queued_tokens),
            ("kvcoord_worker_policy_version", "Policy version of the loaded weights",
             s.policy_version),
        ]
        if s.copies is not None:
            gauges += [
                ("kvcoord_worker_host_pages_total", "KV pages in the host-memory tier",
                 s.host_total_pages),
                ("kvcoord_worker_host_pages_free", "Host-tier pages holding nothing",
                 s.host_free_pages),
                ("kvcoord_worker_host_pages_cached", "Reusable KV pages in the host tier",
                 s.host_cached_pages),
            ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        if s.copies is not None:
            c = s.copies
            for name, doc, to_host, to_device in (
                ("kvcoord_worker_tier_copy_bytes_total",
                 "KV bytes copied between the device and the host tier",
                 c.bytes_to_host, c.bytes_to_device),
                ("kvcoord_worker_tier_copy_seconds_total",
                 "Time spent copying KV between the device and the host tier",
                 c.seconds_to_host, c.seconds_to_device),
            ):
                counter = CounterMetricFamily(name, doc, labels=["direction"])
                counter.add_metric(["to_host"], to_host)
                counter.add_metric(["to_device"], to_device)
                yield counter

