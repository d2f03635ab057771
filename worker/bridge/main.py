"""Run a bridge until SIGINT/SIGTERM, with its counters on ``/metrics`` (``kvcoord_bridge_*``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from coordinator.client.channels import ClientTls
from coordinator.metrics_http import serve_metrics
from coordinator.process_gc import settle_after_start
from coordinator.stop_signals import stop_requested
from worker.bridge.bridge import Bridge, BridgeConfig
from worker.bridge.engine_control import EngineStepFailed, MissingEndpoint
from worker.bridge.policy_member import PolicyMember
from worker.sync.sync_metrics import SyncCollector
from worker.sync.sync_protocol import RegistrationRefused

log = structlog.get_logger(__name__)


class BridgeCollector(Collector):
    """The bridge's counters, read at scrape time."""

    def __init__(self, bridge: Bridge) -> None:
        self._bridge = bridge

    def collect(self) -> Iterator[Metric]:
        b = self._bridge
        skipped = CounterMetricFamily("kvcoord_bridge_malformed",
                                      "Engine input skipped, by kind", labels=["kind"])
        for kind, count in sorted(b.malformed.items()):
            skipped.add_metric([kind], count)
        yield skipped
        events = CounterMetricFamily("kvcoord_bridge_engine_events",
                                     "Engine events applied, by type", labels=["type"])
        for kind, count in sorted(b.applied.items()):
            events.add_metric([kind], count)
        yield events
        yield CounterMetricFamily("kvcoord_bridge_replays", "Gaps filled by replay",
                                  value=b.replays)
        yield CounterMetricFamily("kvcoord_bridge_rebuilds",
                                  "Gaps that dropped the worker's entries (no replay)",
                                  value=b.rebuilds)
        yield GaugeMetricFamily("kvcoord_bridge_blocks", "Engine blocks held", value=len(b.blocks))
        yield GaugeMetricFamily("kvcoord_bridge_last_seq", "Last engine sequence number applied",
                                value=b.last_seq)
        gauges = None if b.gauges is None else b.gauges.read_now()  # the engine's, now
        if gauges is not None:
            requests = GaugeMetricFamily("kvcoord_bridge_engine_requests", "The engine's "
                                         "requests, by state (its /metrics)", labels=["state"])
            requests.add_metric(["running"], gauges.running)
            requests.add_metric(["waiting"], gauges.waiting)
            yield requests
            free, total = gauges.pages(b.config.page_size)
            yield GaugeMetricFamily("kvcoord_bridge_engine_free_pages", "Pages the engine can "
                                    "fill without evicting a running request (heartbeats)",
                                    value=free)
            yield GaugeMetricFamily("kvcoord_bridge_engine_total_pages",
                                    "The engine's KV cache, in pages", value=total)
        if b.member is not None:
            yield from _policy_metrics(b.member)


def _policy_metrics(member: PolicyMember) -> Iterator[Metric]:
    counters = member.driver.counters
    stages = CounterMetricFamily("kvcoord_bridge_policy_stages",
                                 "Policy stages the engine completed", labels=["stage"])
    for stage, count in sorted(counters.stages.items()):
        stages.add_metric([stage], count)
    yield stages
    failures = CounterMetricFamily("kvcoord_bridge_policy_failures",
                                   "Policy stages the engine failed (each fenced it), by step",
                                   labels=["step"])
    for step, count in sorted(counters.failures.items()):
        failures.add_metric([step], count)
    yield failures
    checks = CounterMetricFamily("kvcoord_bridge_weight_checks",
                                 "Weight loads by their check: weights changed (checked), "
                                 "unchanged (failed: fenced), no checksums (unchecked)",
                                 labels=["outcome"])
    for outcome, count in counters.weight_checks.items():
        checks.add_metric([outcome], count)
    yield checks
    yield GaugeMetricFamily("kvcoord_bridge_fenced",
                            "1 while the engine is fenced (never routed, at any version)",
                            value=int(counters.fenced))
    yield GaugeMetricFamily("kvcoord_bridge_policy_version",
                            "The weight version the engine confirmed", value=member.version)
    yield GaugeMetricFamily("kvcoord_bridge_last_pause_seconds",
                            "The last update's pause, gate closed to gate open",
                            value=counters.last_pause_s)
    yield CounterMetricFamily("kvcoord_bridge_recoveries",
                              "Times a fenced engine caught up with the fleet",
                              value=member.recoveries)
    yield CounterMetricFamily("kvcoord_bridge_rollouts_sent",
                              "Rollout records of the engine's answers accepted",
                              value=member.rollouts.sent)


def bridge_registry(bridge: Bridge, registry: CollectorRegistry | None = None
                    ) -> CollectorRegistry:
    """What ``/metrics`` serves: the bridge's counters and its Sync client's, added to
    ``registry`` (a new one by default)."""
    registry = CollectorRegistry() if registry is None else registry
    registry.register(BridgeCollector(bridge))
    registry.register(SyncCollector(bridge.sync.counters, "kvcoord_bridge_sync"))
    return registry


async def serve_bridge(
    config: BridgeConfig, *, token: str | None = None, tls: ClientTls | None = None,
) -> int:
    """``token``/``tls``: how the bridge authenticates to the coordinator (a worker identity
    whose worker_id is ``config.worker_id``). ``/metrics`` (with ``config.metrics_port``) is
    bound first, on ``config.metrics_bind_host()``: a host or port it cannot bind raises
    ConfigError (exit 2) before the bridge is built."""
    registry = CollectorRegistry()
    if config.metrics_port is not None:
        serve_metrics(registry, config.metrics_bind_host(), config.metrics_port)
    bridge = Bridge(config, token=token, tls=tls)
    bridge_registry(bridge, registry)
    stop = stop_requested()
    try:
        await bridge.start()
        settle_after_start()
    except RegistrationRefused as exc:  # a hash key or protocol mismatch: retrying cannot help
        log.error("bridge.exit", worker=config.worker_id, reason=str(exc))
        await bridge.stop()
        return 1
    except MissingEndpoint as exc:  # the engine was started without its RL endpoints
        print(f"kvcoord bridge: {exc}", file=sys.stderr)
        await bridge.stop()
        return 2
    except EngineStepFailed as exc:  # the engine cannot be reached or refused a first call
        log.error("bridge.exit", worker=config.worker_id, reason=str(exc))
        print(f"kvcoord bridge: the engine at {config.engine_url}: {exc}", file=sys.stderr)
        await bridge.stop()
        return 1
    await stop.wait()
    await bridge.stop()
    log.info("bridge.stopped", worker=config.worker_id)
    return 0
