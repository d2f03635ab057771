"""``kvcoord epp``: build the endpoint picker from the gateway's config and serve Envoy's
ext_proc streams until SIGINT/SIGTERM.

The picker's gRPC server also answers gRPC health checking for ``liveness`` (serving while
the process runs), ``readiness`` (the gateway's readiness: the coordinator answers and an
engine is routable), the ext_proc service's own name and ``""``, refreshed every
``HEALTH_PERIOD_S``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from grpc import aio
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.client import AsyncCoordinatorClient
from coordinator.client.types import WorkerInfo
from coordinator.config import CoordinatorConfig
from coordinator.metrics_http import serve_metrics
from coordinator.process_gc import settle_after_start
from coordinator.server.main import RunningCoordinator
from coordinator.stop_signals import stop_requested
from kvcoord.epp.metrics import PickerMetrics
from kvcoord.epp.picker import EndpointPicker
from kvcoord.gateway.config import ConfigError, GatewayConfig
from kvcoord.gateway.main import coordinator_client, coordinator_readiness, load_tokenizer
from kvcoord.gateway.requests import RequestReader
from kvcoord.gateway.routing import RouteFinder

log = structlog.get_logger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_PERIOD_S = 1.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class RunningPicker:
    """A started picker: its port, metrics, and what ``stop`` closes."""

    server: aio.Server
    client: AsyncCoordinatorClient
    picker: EndpointPicker
    health: health_aio.HealthServicer
    port: int
    metrics_port: int | None
    _health_task: asyncio.Task[None]
    embedded: RunningCoordinator | None = None

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting streams; those open get ``grace_s`` to end; routes still open end."""
        self._health_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._health_task
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        await self.picker.routes.ends.flush()
        await self.client.close()
        if self.embedded is not None:  # last: the ends above went to it
            await self.embedded.stop()


async def start_epp(config: GatewayConfig, *, token: str | None = None,
                    embedded: CoordinatorConfig | None = None) -> RunningPicker:
    """A started picker on ``config.listen`` (gRPC), routing through ``config.coordinator``,
    or through ``embedded``, a coordinator started in this process (``--embed-coordinator``,
    as the gateway's; stopped last by ``stop``). ``token``: its own identity, only for
    readiness. ConfigError for a tokenizer, an address or a metrics port it cannot use, with
    nothing left running."""
    tokenizer = load_tokenizer(config)
    client, running = await coordinator_client(config, embedded)

    async def fleet(caller_token: str | None) -> tuple[list[WorkerInfo], int]:
        caller = client.as_caller(caller_token)
        workers, policy = await asyncio.gather(caller.workers(), caller.policy())
        return workers, policy.version

    metrics = PickerMetrics()
    picker = EndpointPicker(
        RequestReader(config, tokenizer),
        RouteFinder(client, model=config.model, drain_wait_s=config.drain_wait_ms / 1000),
        fleet, metrics, max_body_bytes=config.max_body_bytes)
    server = aio.server(options=[("grpc.max_receive_message_length",
                                  config.max_body_bytes + (1 << 20))])
    external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(picker, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    metrics_port = None
    try:
        port = server.add_insecure_port(config.listen)
        if config.metrics_port is not None:
            metrics_port = serve_metrics(metrics.registry, config.metrics_bind_host(),
                                         config.metrics_port)
    except (RuntimeError, ConfigError) as exc:
        await client.close()
        if running is not None:
            await running.stop()
        raise ConfigError(f"cannot listen on {config.listen}: {exc}") from None
    for service in ("liveness", EXT_PROC_SERVICE, ""):
        await health.set(service, SERVING)
    await health.set("readiness", NOT_SERVING)
    readiness = coordinator_readiness(client.as_caller(token))
    task = asyncio.get_running_loop().create_task(_keep_readiness(health, readiness))
    await server.start()
    log.info("epp.serving", listen=config.listen, port=port, coordinator=config.coordinator,
             model=config.model, tokenizer=tokenizer.source, metrics_port=metrics_port)
    return RunningPicker(server, client, picker, health, port, metrics_port, task, running)


async def _keep_readiness(health: health_aio.HealthServicer,
                          readiness: Callable[[], Awaitable[str | None]]) -> None:
    """Set ``readiness`` from the coordinator's answer every ``HEALTH_PERIOD_S``."""
    was: str | None = "unknown"
    while True:
        why = await readiness()
        await health.set("readiness", SERVING if why is None else NOT_SERVING)
        if why != was:
            log.info("epp.readiness", ready=why is None, reason=why)
            was = why
        await asyncio.sleep(HEALTH_PERIOD_S)


async def serve_forever(config: GatewayConfig,
                        embedded: CoordinatorConfig | None = None) -> int:
    """Serve until SIGINT/SIGTERM, then stop within ``shutdown_grace_ms``; the exit status."""
    running = await start_epp(config, token=config.own_token(), embedded=embedded)
    settle_after_start()
    stop = stop_requested()
    await stop.wait()
    log.info("epp.stopping", grace_ms=config.shutdown_grace_ms)
    await running.stop(config.shutdown_grace_ms / 1000)
    return 0
