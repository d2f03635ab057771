"""Prometheus metrics of the endpoint picker (``kvcoord_epp_*``), on a registry of its own.

Picker CPU per request is ``rate(process_cpu_seconds_total) /
rate(kvcoord_epp_requests_total)`` (the process collector is on the same registry)."""

from __future__ import annotations

from prometheus_client import PROCESS_COLLECTOR, CollectorRegistry, Counter, Histogram

# Fine at the low end: the pick is the picker's whole added latency.
_PICK = (2.5e-4, 5e-4, 1e-3, 2e-3, 3e-3, 5e-3, 7.5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)


class PickerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        r.register(PROCESS_COLLECTOR)
        self.picks = Counter(
            "kvcoord_epp_requests_total", "Requests seen, by outcome: picked, refused_STATUS "
            "(answered at once: 400, 404, 413, 429, 503...) or ended_before_body (the stream "
            "ended first)", ["outcome"], registry=r)
        self.pick_seconds = Histogram(
            "kvcoord_epp_pick_seconds", "From the body's last byte to the pick (read, "
            "tokenized, routed; a drain waited out is counted in it)", buckets=_PICK,
            registry=r)
        self.served = Counter(
            "kvcoord_epp_served_total", "Answers whose serving endpoint Envoy reported "
            "(upstream.address), by where: picked, or elsewhere (another endpoint than the "
            "one picked: its route ended at once)", ["where"], registry=r)
