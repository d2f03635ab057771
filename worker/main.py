"""Build and run a worker process: runtime, ``worker.v1.Worker`` gRPC service (health and
reflection), metrics, and the coordinator agent; shutdown stops admitting, drains, flushes the
rollout reporter, then deregisters."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from dataclasses import dataclass

import grpc
import structlog
import torch
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2

from coordinator.client.channels import channel_options
from coordinator.metrics_http import host_of, serve_metrics
from coordinator.process_gc import settle_after_start
from coordinator.rpc.guard import Guard, ServerSecurity
from coordinator.rpc.health import add_health_and_reflection, warn_if_open
from coordinator.rpc.identities import WORKER_PERMISSIONS
from coordinator.rpc.interceptor import ErrorMappingInterceptor, Mapped
from coordinator.stop_signals import stop_requested
from coordinator.wire import Reason
from worker.agent import CoordinatorAgent
from worker.config import ConfigError, WorkerConfig
from worker.http_api.server import OpenAIServer
from worker.http_api.serving import bind_http
from worker.metrics import WorkerMetrics
from worker.runtime import GenerationAborted, InvalidRequest, PoolExhausted
from worker.runtime.engine import ModelConfig
from worker.runtime.kv_tier_copy import HostMemoryShort
from worker.runtime.model_sizes import MODEL_SIZES
from worker.runtime.runtime import WorkerRuntime
from worker.serving.gate import Draining, GenerationGate
from worker.serving.generations import GenerationRunner, SyncState
from worker.serving.servicer import WorkerServicer
from worker.sync.relay import EventRelay
from worker.sync.sync_protocol import SyncCounters
from worker.text.tokenizer import TextTokenizer, TokenizerError, reference_tokenizer
from worker.v1 import worker_pb2 as wpb
from worker.v1 import worker_pb2_grpc as wpb_grpc

log = structlog.get_logger(__name__)

SERVICE_NAME = wpb.DESCRIPTOR.services_by_name["Worker"].full_name
DRAIN_RETRY_MS = 100  # a drain or resume takes milliseconds to seconds
# Runtime errors by the status they are answered with; domain errors name their own.
EXPECTED_ERRORS = {
    InvalidRequest: Mapped("INVALID_ARGUMENT"),
    PoolExhausted: Mapped("RESOURCE_EXHAUSTED"),
    Draining: Mapped("UNAVAILABLE", retry_after_ms=DRAIN_RETRY_MS, reason=Reason.DRAINING),
    # Not retried on this worker: the caller re-routes (the fleet is moving to new weights).
    GenerationAborted: Mapped("ABORTED"),
}


@dataclass(slots=True)
class RunningWorker:
    """A started worker: its identity, bound ports, runtime and agent; ``stop`` drains."""

    config: WorkerConfig
    server: grpc.aio.Server
    runtime: WorkerRuntime
    agent: CoordinatorAgent
    health: health_aio.HealthServicer
    gate: GenerationGate
    port: int
    metrics_port: int | None
    http: OpenAIServer | None = None
    http_port: int | None = None

    @property
    def worker_id(self) -> str:
        return self.agent.worker_id

    @property
    def address(self) -> str:
        return self.agent.address

    async def stop(self, grace: float = 10.0, *, deregister: bool = True) -> None:
        """Report NOT_SERVING, close the generation gate (new Generate calls get UNAVAILABLE
        and are retried elsewhere) and cordon this worker (no new routes), let in-flight calls
        finish for up to ``grace`` seconds so their rollout records are reported, then flush the
        reporter and deregister (the coordinator forgets our pages), and close."""
        await self.health.enter_graceful_shutdown()
        self.gate.close()
        await self.agent.cordon_self()  # no new routes while the running ones finish
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.gate.wait_idle(), grace)
        if self.http is not None:
            await self.http.stop()
        await self.agent.stop(deregister=deregister)
        await self.server.stop(0)
        log.info("worker.stopped", worker=self.worker_id, port=self.port)


async def start_worker(config: WorkerConfig) -> RunningWorker:
    """Build the runtime (weights, KV buffers), bind ``config.listen`` (port 0 picks a free
    one), serve, and start registering with the coordinator in the background."""
    relay = EventRelay()
    device = config.resolved_device()
    try:
        runtime = await asyncio.to_thread(
            WorkerRuntime, model=MODEL_SIZES[config.model_size], pages=config.pages,
            page_size=config.page_size,
            hash_config=config.hash_config(), model_name=config.model_name,
            policy_version=config.policy_version, device=device,
            dtype=getattr(torch, config.dtype), weights_path=config.weights,
            prefix_caching=config.prefix_caching, events=relay,
            max_new_tokens_limit=config.max_new_tokens, host_pages=config.host_pages,
        )
    except HostMemoryShort as exc:  # a setting the machine cannot honour: say so, exit 2
        raise ConfigError(str(exc)) from None
    sync_counters = SyncCounters()
    metrics = WorkerMetrics(runtime.stats, sync=sync_counters)
    gate = GenerationGate()
    server = grpc.aio.server(options=channel_options(config.max_message_bytes))
    security = ServerSecurity.from_config(config)
    port = security.bind(server, config.listen)
    if port == 0:
        raise OSError(f"could not bind {config.listen}")
    worker_id, address = config.identity(port)
    # Bound before the agent starts: Register names the HTTP endpoint's URL.
    http_socket = None if config.http_listen is None else bind_http(config.http_listen)
    http_port = None if http_socket is None else int(http_socket.getsockname()[1])
    agent = CoordinatorAgent(
        config, runtime, gate, worker_id=worker_id, address=address, metrics=metrics,
        counters=sync_counters, http_url="" if http_port is None else config.http_url(http_port))

    def sync_state() -> SyncState:
        return SyncState(worker_id, agent.incarnation, agent.synced.is_set())

    generations = GenerationRunner(runtime, gate, metrics, sync_state, report=agent.rollouts.add)
    servicer = WorkerServicer(generations, gate, model=config.model_name, device=device)
    errors = ErrorMappingInterceptor(metrics, EXPECTED_ERRORS, Guard(security))
    wpb_grpc.add_WorkerServicer_to_server(
        errors.wrap(servicer, wpb.DESCRIPTOR.services_by_name["Worker"], WORKER_PERMISSIONS),
        server,
    )
    health = add_health_and_reflection(server, errors, SERVICE_NAME)
    http = None
    if http_socket is not None:
        http = OpenAIServer(generations, _http_tokenizer(config, runtime.model), Guard(security),
                            model=config.model_name, ssl_context=_http_tls(config))
        await http.start(http_socket)
    metrics_port = None
    if config.metrics_port is not None:
        metrics_port = serve_metrics(metrics.registry, config.metrics_host
                                     or host_of(config.listen), config.metrics_port)
    await server.start()
    serving = health_pb2.HealthCheckResponse.SERVING
    await health.set("", serving)
    await health.set(SERVICE_NAME, serving)
    relay.bind(asyncio.get_running_loop(), agent.sync)
    agent.start()
    log.info("worker.serving", worker=worker_id, listen=config.listen, port=port,
             address=address, metrics_port=metrics_port, http_port=http_port, device=device,
             model_size=config.model_size, pages=config.pages,
             page_size=config.page_size, policy_version=runtime.policy_version,
             coordinator=config.coordinator, **security.describe())
    warn_if_open(config.listen, security)
    return RunningWorker(config, server, runtime, agent, health, gate, port, metrics_port,
                         http, http_port)


def _http_tokenizer(config: WorkerConfig, model: ModelConfig) -> TextTokenizer:
    """The HTTP endpoint's tokenizer; ConfigError when it cannot serve this model."""
    try:
        tokenizer = (reference_tokenizer() if config.tokenizer is None
                     else TextTokenizer.load(config.tokenizer))
    except TokenizerError as exc:
        raise ConfigError(f"tokenizer: {exc}") from None
    if tokenizer.vocab_size > model.vocab_size:
        raise ConfigError(f"tokenizer: {tokenizer.source} has {tokenizer.vocab_size} ids, more "
                          f"than the model's vocabulary of {model.vocab_size}")
    return tokenizer


def _http_tls(config: WorkerConfig) -> ssl.SSLContext | None:
    """The HTTP endpoint serves TLS with the gRPC service's certificate, when it has one."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(config.tls_cert, config.tls_key)
    return context


async def serve_forever(config: WorkerConfig) -> int:
    """Run until SIGINT/SIGTERM (deregister, then drain: the k8s termination path) or until the
    coordinator refuses the registration for good. Returns the process exit status."""
    running = await start_worker(config)
    settle_after_start()
    stop = stop_requested()
    stopped = asyncio.create_task(stop.wait())
    failed = asyncio.create_task(running.agent.failed.wait())
    await asyncio.wait([stopped, failed], return_when=asyncio.FIRST_COMPLETED)
    for task in (stopped, failed):
        task.cancel()
    await running.stop()
    if running.agent.error is not None:
        log.error("worker.exit", reason=str(running.agent.error))
        return 1
    return 0
