"""A Sync client's counts as Prometheus counters, for the worker's and the bridge's registries
(kept apart from ``worker.metrics``, which needs the torch runtime; the bridge runs without it)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from worker.sync.sync_protocol import SyncCounters


class SyncCollector(Collector):
    """A Sync client's counts as ``<prefix>_*_total`` counters (the worker's and the bridge's)."""

    def __init__(self, counters: SyncCounters, prefix: str) -> None:
        self._counters = counters
        self._prefix = prefix

    def collect(self) -> Iterator[Metric]:
        c, p = self._counters, self._prefix
        for name, doc, value in (
            ("registrations", "Register calls that succeeded", c.registrations),
            ("streams", "Sync streams opened (welcome received)", c.streams),
            ("batches", "Event batches queued for the coordinator (resends included)",
             c.batches),
            ("resyncs", "Resync requests answered with an inventory", c.resyncs),
        ):
            yield CounterMetricFamily(f"{p}_{name}", doc, value=value)
        keys = CounterMetricFamily(f"{p}_keys", "Page keys reported, by event kind",
                                   labels=["kind"])
        keys.add_metric(["stored"], c.keys_stored)
        keys.add_metric(["removed"], c.keys_removed)
        yield keys
