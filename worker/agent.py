"""The coordinator agent of a reference worker: its ``SyncClient`` (``worker.sync.sync_client``)
with
the runtime as the owner, the policy command handler, and the rollout reporter.

The runtime's page events reach it through ``worker.sync.relay.EventRelay``; its holdings are the
runtime's cached pages by tier (device, and host when it has a host tier); a heartbeat carries
the runtime's load and the routes finished since the last one, and a finished generation asks
for the next heartbeat early. A new registration loads
the version the coordinator names and reopens the generation gate. ``stop`` flushes the rollout
reporter, then deregisters. Every call carries the worker's bearer token when ``token_file`` is
set, and the channels are TLS when ``tls_ca`` is (see ``WorkerConfig``).
"""

from __future__ import annotations

import asyncio

import structlog

from coordinator.sync_codec import TIER_TO_PB
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from worker.config import WorkerConfig
from worker.metrics import WorkerMetrics
from worker.runtime.runtime import WorkerRuntime
from worker.serving.gate import GenerationGate
from worker.serving.policy_commands import PolicyCommandHandler
from worker.sync.event_log import Holdings
from worker.sync.rollout_reporter import RolloutReporter
from worker.sync.sync_client import SyncClient
from worker.sync.sync_protocol import (
    RegistrationRefused,
    SyncCounters,
    SyncSettings,
    WorkerIdentity,
)

__all__ = ["CoordinatorAgent", "RegistrationRefused"]

log = structlog.get_logger(__name__)


class CoordinatorAgent:
    """One reference worker's link to the coordinator (see the module docstring).

    ``synced`` is set while a stream is welcomed; ``failed`` once the coordinator refused the
    registration for good (``error`` says why); ``left`` once it removed the worker for good.
    """

    def __init__(
        self, config: WorkerConfig, runtime: WorkerRuntime, gate: GenerationGate, *,
        worker_id: str, address: str, metrics: WorkerMetrics, counters: SyncCounters,
        http_url: str = "",
    ) -> None:
        """``http_url``: the worker's OpenAI-compatible base URL, registered for gateways."""
        self.worker_id = worker_id
        self.address = address
        self._runtime = runtime
        self._gate = gate
        identity = WorkerIdentity(
            worker_id=worker_id, address=address, model=config.model_name,
            total_pages=config.pages, hash_config=config.hash_config(), http_url=http_url,
            host_pages=config.host_pages,
        )
        settings = SyncSettings(
            targets=config.coordinator, heartbeat_ms=config.heartbeat_ms,
            event_flush_ms=config.event_flush_ms, max_unacked_batches=config.max_unacked_batches,
            max_message_bytes=config.max_message_bytes,
            max_pending_keys=max(4 * (config.pages + config.host_pages), 65_536),
            rpc_timeout_s=config.rpc_timeout_ms / 1000,
            backoff_initial_ms=config.backoff_initial_ms, backoff_max_ms=config.backoff_max_ms,
            token=config.coordinator_token(), tls=config.client_tls(),
        )
        self.sync = SyncClient(identity, settings, self, counters=counters)
        self._commands = PolicyCommandHandler(runtime, gate, metrics, self.sync.send)
        self.rollouts = RolloutReporter(self._rollout_stub, worker_id=worker_id,
                                        rpc_timeout_s=settings.rpc_timeout_s)
        self._beats: asyncio.Task[None] | None = None

    @property
    def incarnation(self) -> int:
        return self.sync.incarnation

    @property
    def synced(self) -> asyncio.Event:
        return self.sync.synced

    @property
    def failed(self) -> asyncio.Event:
        return self.sync.failed

    @property
    def left(self) -> asyncio.Event:
        return self.sync.left

    @property
    def error(self) -> BaseException | None:
        return self.sync.error

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start registering and syncing in the background (returns at once)."""
        self.sync.start()
        self._beats = asyncio.create_task(self._early_beats(), name=f"beats-{self.worker_id}")
        self.rollouts.start()

    async def commands_idle(self) -> None:
        """Return once every policy command received so far has been handled."""
        await self._commands.idle()

    async def cordon_self(self) -> None:
        """Ask the coordinator to stop routing here now (see ``SyncClient.cordon_self``)."""
        await self.sync.cordon_self()

    async def stop(self, *, deregister: bool = True) -> None:
        """Stop syncing; with ``deregister`` remove this worker and its pages from the
        coordinator at once (graceful shutdown) instead of waiting for the lease to run out."""
        await self.rollouts.stop()  # first: it needs the stream's registration to be accepted
        if self._beats is not None:
            self._beats.cancel()
            await asyncio.gather(self._beats, return_exceptions=True)
        await self._commands.stop()
        await self.sync.stop(deregister=deregister)

    def _rollout_stub(self) -> pb_grpc.CoordinatorStub | None:
        """The stub rollouts go through: the synced coordinator's, None while not synced. After
        a deregistration the coordinator still takes this worker's last records for a while."""
        return self.sync.stub() if self.synced.is_set() or self.left.is_set() else None

    async def _early_beats(self) -> None:
        """A finished generation asks for the next heartbeat now: a route still counted as
        queued work would push the conversation's next turn away from its own cache."""
        while True:
            await self._gate.completion.wait()
            self._gate.completion.clear()
            self.sync.beat_soon()

    # ------------------------------------------------------------------ SyncOwner

    def policy_version(self) -> int:
        return self._runtime.policy_version

    async def holdings(self) -> Holdings:
        inventory = await asyncio.to_thread(self._runtime.inventory)
        return {TIER_TO_PB[tier]: keys for tier, keys in inventory.items()}

    def heartbeat(self) -> pb.Heartbeat:
        stats = self._runtime.stats()
        return pb.Heartbeat(
            running_requests=stats.running_requests, queued_tokens=stats.queued_tokens,
            free_pages=stats.free_pages, total_pages=stats.total_pages,
            completed_routes=self._gate.take_completed(),
        )

    async def registered(self, response: pb.RegisterResponse) -> None:
        """Serve the version the Register answer names (a worker fenced by a barrier, or one
        registering mid-update, must load it; it is unroutable until it does, and its
        heartbeats tell the coordinator when it has). A fresh registration also reopens the
        generation gate: a DRAIN whose RESUME never came (fenced) must not close it forever."""
        if response.policy_version != self._runtime.policy_version:
            log.info("agent.catching_up", worker=self.worker_id,
                     loaded=self._runtime.policy_version, version=response.policy_version)
            await asyncio.to_thread(self._runtime.load_weights, response.policy_version,
                                    response.weights_uri or None)
        self._gate.open()

    def command(self, command: pb.PolicyCommand) -> None:
        self._commands.handle(command)
