"""Build and run a coordinator gRPC server: servicer, health, reflection, metrics, shutdown."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from google.protobuf.message import DecodeError
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2

from coordinator.client.channels import channel_options
from coordinator.config import CoordinatorConfig
from coordinator.control.shard_routing import ShardRouting
from coordinator.core import accel
from coordinator.metrics_http import host_of, serve_metrics
from coordinator.process_gc import settle_after_start
from coordinator.replica import CoordinatorReplica
from coordinator.rpc.guard import Guard, ServerSecurity
from coordinator.rpc.health import add_health_and_reflection, warn_if_open
from coordinator.rpc.identities import COORDINATOR_PERMISSIONS
from coordinator.rpc.interceptor import ErrorMappingInterceptor, Mapped
from coordinator.server.metrics import CoordinatorMetrics
from coordinator.server.peer_shards import peer_shards
from coordinator.server.servicer import CoordinatorServicer
from coordinator.server.sync_relay import SyncFrontends
from coordinator.stop_signals import stop_requested
from coordinator.store.protocol import StoreUnavailable
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from coordinator.wire import Reason

log = structlog.get_logger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
# A store outage is usually a Redis restart or failover: seconds, not milliseconds.
STORE_RETRY_MS = 1000


@dataclass(slots=True)
class RunningCoordinator:
    """A started coordinator: its bound port, metrics port and a ``stop`` that drains."""

    server: grpc.aio.Server
    service: CoordinatorReplica
    health: health_aio.HealthServicer
    port: int
    metrics_port: int | None
    sync_frontends: SyncFrontends | None = None
    shards: ShardRouting | None = None
    servicer: Any = None
    """The servicer as the server serves it (guarded, errors mapped): what
    ``in_process.InProcessStub`` calls for a gateway embedding this coordinator."""

    async def stop(self, grace: float = 2.0) -> None:
        """Report NOT_SERVING, let in-flight calls finish for ``grace`` seconds, then close."""
        await self.health.enter_graceful_shutdown()
        if self.sync_frontends is not None:
            await self.sync_frontends.stop()
        await self.server.stop(grace)
        if self.shards is not None:
            await self.shards.close()
        await self.service.stop()
        log.info("coordinator.stopped", port=self.port)


async def start_coordinator(config: CoordinatorConfig) -> RunningCoordinator:
    """Open the store, bind ``config.listen`` (port 0 picks a free one) and start serving."""
    service = await CoordinatorReplica.open(config)
    metrics = CoordinatorMetrics(service)
    server = grpc.aio.server(options=channel_options(config.max_message_bytes))
    security = ServerSecurity.from_config(config)
    errors = ErrorMappingInterceptor(
        metrics,
        {
            StoreUnavailable: Mapped("UNAVAILABLE", retry_after_ms=STORE_RETRY_MS,
                                     reason=Reason.STORE_UNAVAILABLE),
            # A Sync message that does not parse surfaces in our reader (a unary request that
            # does not parse is answered by grpc before any handler runs).
            DecodeError: Mapped("INVALID_ARGUMENT"),
        },
        Guard(security),
    )
    descriptor = pb.DESCRIPTOR.services_by_name["Coordinator"]
    frontends = SyncFrontends(service, errors, config) if config.sync_frontends else None
    if frontends is not None:
        metrics.watch_frontends(frontends)
    shards = shard_routing_of(config, service)
    if shards is not None:
        metrics.watch_shards(shards)
    servicer = errors.wrap(
        CoordinatorServicer(service, frontends.sync_port if frontends else lambda: 0, shards),
        descriptor, COORDINATOR_PERMISSIONS)
    pb_grpc.add_CoordinatorServicer_to_server(servicer, server)
    health = add_health_and_reflection(server, errors, SERVICE_NAME)
    port = security.bind(server, config.listen)
    if port == 0:
        raise OSError(f"could not bind {config.listen}")
    # Probes see NOT_SERVING until this replica's index holds the other replicas' workers (set
    # before the server starts: grpc's health servicer begins with "" SERVING).
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    await health.set("", not_serving)
    await health.set(SERVICE_NAME, not_serving)
    metrics_port = None
    if config.metrics_port is not None:  # before serving: a bad host exits with nothing up
        metrics_port = serve_metrics(metrics.registry, config.metrics_host
                                     or host_of(config.listen), config.metrics_port)
    if frontends is not None:  # before serving (Register names their ports) and before the
        await frontends.start()  # service, so a port in use leaves nothing running
    await service.start()
    await server.start()
    await service.wait_ready()
    serving = health_pb2.HealthCheckResponse.SERVING
    await health.set("", serving)
    await health.set(SERVICE_NAME, serving)
    log.info(
        "coordinator.serving", listen=config.listen, port=port, metrics_port=metrics_port,
        store=type(service.store).__name__, page_size=config.page_size,
        policy_version=service.policy.version, index_core=accel.status(),
        sync_frontends=frontends.ports if frontends else [], shard=config.shard or None,
        peer_shards=sorted(config.peer_shard_targets()),
        **security.describe(),
    )
    warn_if_open(config.listen, security)
    return RunningCoordinator(server, service, health, port, metrics_port, frontends, shards,
                              servicer)


def shard_routing_of(config: CoordinatorConfig,
                     service: CoordinatorReplica) -> ShardRouting | None:
    """Routes over every shard when ``peer_shards`` names others (the routing gate then
    decides through them); None otherwise."""
    targets = config.peer_shard_targets()
    if not targets:
        return None
    shards = ShardRouting(service.router, peer_shards(
        targets, page_size=config.page_size, max_message_bytes=config.max_message_bytes))
    service.routing_gate.span(shards)
    return shards


async def serve_forever(config: CoordinatorConfig) -> None:
    """Run until SIGINT/SIGTERM, then drain (the k8s termination path)."""
    running = await start_coordinator(config)
    settle_after_start()
    stop = stop_requested()
    await stop.wait()
    await running.stop()
