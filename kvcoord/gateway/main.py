"""``kvcoord gateway``: build the gateway from its config and serve until SIGINT/SIGTERM, which
stops accepting and lets the requests in flight finish for a grace period."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping

import structlog

from coordinator.client import AsyncCoordinatorClient, ClientTls, KvcoordError
from coordinator.config import CoordinatorConfig
from coordinator.metrics_http import serve_metrics
from coordinator.process_gc import settle_after_start
from coordinator.server.in_process import InProcessStub
from coordinator.server.main import RunningCoordinator, start_coordinator
from coordinator.stop_signals import stop_requested
from kvcoord.gateway.config import ConfigError, GatewayConfig
from kvcoord.gateway.routing import RouteFinder
from kvcoord.gateway.server import GatewayServer
from worker.text.tokenizer import TextTokenizer, TokenizerError, reference_tokenizer

log = structlog.get_logger(__name__)

READINESS_TIMEOUT_S = 2.0


def load_tokenizer(config: GatewayConfig) -> TextTokenizer:
    """The configured tokenizer (the shipped one by default); ConfigError naming the problem."""
    try:
        if config.tokenizer is None:
            return reference_tokenizer()
        return TextTokenizer.load(config.tokenizer, max_context=config.max_context)
    except TokenizerError as exc:
        raise ConfigError(f"tokenizer: {exc}") from None


def embedded_coordinator_config(config: GatewayConfig, env: Mapping[str, str], *,
                                coordinator_given: bool) -> CoordinatorConfig | None:
    """The coordinator ``--embed-coordinator`` runs in this process: its ``listen`` is that
    address, the rest from ``env``'s ``KVCOORD_*`` variables as ``kvcoord coordinator`` reads
    them. None without it. ConfigError when a coordinator to route through was given too, or
    when the variables do not make a coordinator."""
    if config.embed_coordinator is None:
        return None
    if coordinator_given:
        raise ConfigError("give --coordinator (route through a coordinator elsewhere) or "
                          "--embed-coordinator (run one here), not both")
    coordinator = CoordinatorConfig.from_sources({"listen": config.embed_coordinator}, env)
    if coordinator.metrics_port is not None and coordinator.metrics_port == config.metrics_port:
        raise ConfigError(f"the embedded coordinator's metrics port ({coordinator.metrics_port}, "
                          "KVCOORD_METRICS_PORT) is the gateway's --metrics-port: give it "
                          "another, or none")
    return coordinator


async def coordinator_client(config: GatewayConfig, embedded: CoordinatorConfig | None,
                             ) -> tuple[AsyncCoordinatorClient, RunningCoordinator | None]:
    """The client a front door routes through: to ``embedded``, started here and called in
    process (no RPC), when given (returned too: the caller stops it last); else to
    ``config.coordinator`` over gRPC (TLS with ``tls_ca``)."""
    if embedded is not None:
        running = await start_coordinator(embedded)
        return AsyncCoordinatorClient.over_stub(InProcessStub(running.servicer),
                                                f"127.0.0.1:{running.port}"), running
    tls = None if config.tls_ca is None else ClientTls.from_files(config.tls_ca)
    return AsyncCoordinatorClient(config.coordinator, tls=tls), None


def coordinator_readiness(own: AsyncCoordinatorClient) -> Callable[[], Awaitable[str | None]]:
    """``readiness()`` for a front door that routes through ``own`` (its own identity): None
    when requests can be served, else why not (the coordinator does not answer; no worker is
    routable outside a sync drain, which leaves none routable for a moment)."""

    async def readiness() -> str | None:
        # ListWorkers and GetPolicy: calls every role may make, so a front door's own
        # identity needs no more than a scheduler's.
        try:
            workers, policy = await asyncio.wait_for(
                asyncio.gather(own.workers(), own.policy()), READINESS_TIMEOUT_S)
        except (KvcoordError, TimeoutError) as exc:
            return f"the coordinator does not answer: {exc}"
        if any(w.state == "ready" for w in workers) or (workers and policy.phase != "serving"):
            return None
        return "no routable worker"

    return readiness


async def start_gateway(config: GatewayConfig, *, token: str | None = None,
                        embedded: CoordinatorConfig | None = None,
                        ) -> tuple[GatewayServer, AsyncCoordinatorClient]:
    """A started gateway and its coordinator client (close both: ``server.stop()``, then the
    client). ``token``: the gateway's own identity, used only to ask whether it is ready.
    ``/metrics`` (with ``metrics_port``) is bound before the gateway listens; a host or port it
    cannot bind raises ConfigError with nothing left running. ``embedded``: the coordinator to
    run in this process and route to in process (``server.embedded``; stopped by
    ``server.stop()``)."""
    tokenizer = load_tokenizer(config)
    client, running = await coordinator_client(config, embedded)
    readiness = coordinator_readiness(client.as_caller(token))

    routes = RouteFinder(client, model=config.model, drain_wait_s=config.drain_wait_ms / 1000)
    server = GatewayServer(config, routes, tokenizer, readiness, embedded=running)
    if config.metrics_port is not None:  # first: a host that cannot be bound starts nothing
        try:
            server.metrics_port = serve_metrics(
                server.metrics.registry, config.metrics_bind_host(), config.metrics_port)
        except ConfigError:
            await client.close()
            if running is not None:
                await running.stop()
            raise
    await server.start()
    return server, client


async def serve_forever(config: GatewayConfig,
                        embedded: CoordinatorConfig | None = None) -> int:
    """Serve until SIGINT/SIGTERM (stop accepting, finish what is in flight within
    ``shutdown_grace_ms``, then stop the embedded coordinator, if any); returns the exit
    status."""
    server, client = await start_gateway(config, token=config.own_token(), embedded=embedded)
    settle_after_start()
    stop = stop_requested()
    await stop.wait()
    log.info("gateway.stopping", grace_ms=config.shutdown_grace_ms)
    await server.stop()
    await client.close()
    return 0
