"""The coordinator agent: keeps the coordinator's index true about this worker's pages.

``Register`` (new incarnation) -> one ``Sync`` stream: hello -> welcome(next_seq); page events
from the runtime batched and numbered (``worker.event_log``); a heartbeat with the load every
``heartbeat_ms``; a resync request answered with the full inventory; policy commands handled
and acknowledged. On a broken stream it reconnects with exponential backoff and jitter across
the TARGETS list, resending unacknowledged batches from ``welcome.next_seq``. When the coordinator
no longer knows the incarnation (unknown worker, stale incarnation, lease gone: a coordinator
restart does this) it registers again and announces its whole inventory as STORED batches from
seq 1. It owns the worker's ``RolloutReporter`` (``rollouts``), which reports over the same
channel while a stream is up. ``stop`` flushes the reporter, then deregisters. Every call on
its channels (the reporter's too) carries the worker's bearer token when ``token_file`` is set,
and the channels are TLS when ``tls_ca`` is (see ``WorkerConfig``). Protocol: docs/PROTOCOL.md §4.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import Any

import grpc
import structlog

from coordinator.client.channels import channel_options, open_aio_channel
from coordinator.client.targets import Targets
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from coordinator.wire import PROTOCOL_VERSION
from worker.config import WorkerConfig
from worker.event_log import EventLog
from worker.gate import GenerationGate
from worker.metrics import WorkerMetrics
from worker.policy_commands import PolicyCommandHandler
from worker.rollout_reporter import RolloutReporter
from worker.runtime import WorkerRuntime

log = structlog.get_logger(__name__)

# Minimum spacing of heartbeats triggered by finished generations (each renews the lease in the
# store, so this also bounds store writes per worker).
COMPLETION_COALESCE_S = 0.02
# FAILED_PRECONDITION details meaning "this incarnation is gone": register again.
_REREGISTER = ("unknown worker", "stale incarnation", "re-register")
_DEREGISTERED = "worker deregistered"  # coordinator.control.worker_sync.DEREGISTERED's stream end


class RegistrationRefused(Exception):
    """The coordinator refused ``Register`` for good (hash key/config or protocol mismatch, bad
    identity): retrying cannot help, the worker's configuration must change."""


class CoordinatorAgent:
    """One worker identity's registration and Sync stream (see the module docstring).

    Runs on the event loop; ``page_event`` is its only entry point from the runtime (through
    ``worker.relay.EventRelay``). ``synced`` is set while a stream is welcomed; ``failed`` once the
    coordinator refused the registration for good (``error`` says why).
    """

    def __init__(
        self, config: WorkerConfig, runtime: WorkerRuntime, gate: GenerationGate, *,
        worker_id: str, address: str, metrics: WorkerMetrics,
    ) -> None:
        self.config = config
        self.worker_id = worker_id
        self.address = address
        self.incarnation = 0
        self.synced = asyncio.Event()
        self.failed = asyncio.Event()
        self.left = asyncio.Event()  # deregistered from outside: never registers again
        self.error: BaseException | None = None
        self._runtime = runtime
        self._gate = gate
        self._metrics = metrics
        self._hash = config.hash_config()
        self._log = EventLog(
            max_unacked=config.max_unacked_batches, max_message_bytes=config.max_message_bytes,
            max_pending_keys=max(4 * config.pages, 65_536),
        )
        self._policy = PolicyCommandHandler(runtime, gate, metrics, self._send)
        self._targets = Targets.parse(config.coordinator)
        self._target = 0  # index of the target in use; moves on when it is unreachable
        self._channels: list[grpc.aio.Channel] = []
        self._registration: pb.RegisterResponse | None = None
        self._outbox: asyncio.Queue[pb.SyncRequest] | None = None
        self._announced = False  # this incarnation's inventory is queued (seq 1...)
        self._holding = False  # an inventory snapshot is being sent: no batch may be cut
        self._flush_timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self.rollouts = RolloutReporter(self._rollout_stub, worker_id=worker_id,
                                        rpc_timeout_s=config.rpc_timeout_ms / 1000)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start registering and syncing in the background (returns at once)."""
        cfg = self.config
        options = [
            *channel_options(cfg.max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", cfg.backoff_initial_ms),
            ("grpc.min_reconnect_backoff_ms", cfg.backoff_initial_ms),
            ("grpc.max_reconnect_backoff_ms", cfg.backoff_max_ms),
        ]
        # The token goes on through an interceptor: the rollout reporter calls through these
        # channels too, with stubs it builds itself.
        tls, token = cfg.client_tls(), cfg.coordinator_token()
        self._channels = [open_aio_channel(t, options, tls, token=token) for t in self._targets]
        self._task = asyncio.create_task(self._run(), name=f"agent-{self.worker_id}")
        self.rollouts.start()

    async def commands_idle(self) -> None:
        """Return once every policy command received so far has been handled."""
        await self._policy.idle()

    async def stop(self, *, deregister: bool = True) -> None:
        """Stop syncing; with ``deregister`` remove this worker and its pages from the
        coordinator at once (graceful shutdown) instead of waiting for the lease to run out."""
        await self.rollouts.stop()  # first: it needs the stream's registration to be accepted
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._policy.stop()
        if deregister and self.incarnation and not self.left.is_set():
            request = pb.DeregisterRequest(
                protocol_version=PROTOCOL_VERSION, worker_id=self.worker_id,
                incarnation=self.incarnation,
            )
            try:
                await self._stub().Deregister(request, timeout=self.config.rpc_timeout_ms / 1000)
                log.info("agent.deregistered", worker=self.worker_id, incarnation=self.incarnation)
            except grpc.RpcError as exc:
                log.warning("agent.deregister_failed", worker=self.worker_id, code=exc.code().name)
        for channel in self._channels:
            await channel.close()

    def _stub(self) -> pb_grpc.CoordinatorStub:
        return pb_grpc.CoordinatorStub(self._channels[self._target])

    def _rollout_stub(self) -> pb_grpc.CoordinatorStub | None:
        """The stub rollouts go through: the synced coordinator's, None while not synced. After
        a deregistration the coordinator still takes this worker's last records for a while."""
        return self._stub() if self.synced.is_set() or self.left.is_set() else None

    async def cordon_self(self) -> None:
        """Ask the coordinator to stop routing here now (best effort, short): the start of a
        graceful stop, so no route lands here while running generations drain."""
        if not self.incarnation or self.left.is_set():
            return
        request = pb.CordonRequest(protocol_version=PROTOCOL_VERSION, worker_id=self.worker_id,
                                   cordoned=True)
        try:
            await self._stub().Cordon(request, timeout=min(2.0, self.config.rpc_timeout_ms / 1000))
            log.info("agent.cordoned", worker=self.worker_id)
        except grpc.RpcError as exc:
            log.warning("agent.cordon_failed", worker=self.worker_id, code=exc.code().name)

    async def _run(self) -> None:
        attempt = 0
        while True:
            try:
                if not self.incarnation:
                    await self._register()
                await self._sync()  # returns only when the coordinator closed the stream
                attempt = 0
            except RegistrationRefused as exc:
                self.error = exc
                self.failed.set()
                log.error("agent.registration_refused", worker=self.worker_id, error=str(exc))
                return
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details() or ""
                if code == grpc.StatusCode.FAILED_PRECONDITION and _DEREGISTERED in details:
                    # Removed on purpose (a pod's preStop, an operator): final. The process
                    # keeps answering what it runs until it is stopped; it never comes back.
                    self.left.set()
                    self._disconnected()
                    log.info("agent.left_fleet", worker=self.worker_id, details=details)
                    return
                if code == grpc.StatusCode.FAILED_PRECONDITION and any(
                    s in details for s in _REREGISTER
                ):
                    self.incarnation = 0  # forgotten by the coordinator: a new incarnation
                    self._announced = False
                elif code == grpc.StatusCode.UNAVAILABLE:
                    self._target = (self._target + 1) % len(self._channels)
                log.warning("agent.stream_failed", worker=self.worker_id, code=code.name,
                            details=details, reregister=not self.incarnation)
            except (ConnectionError, TimeoutError) as exc:
                log.warning("agent.stream_failed", worker=self.worker_id, error=str(exc))
            except Exception:
                log.exception("agent.bug", worker=self.worker_id)  # keep syncing regardless
            finally:
                self._disconnected()
            attempt += 1
            await asyncio.sleep(self._backoff(attempt))

    def _backoff(self, attempt: int) -> float:
        """Exponential in ``attempt`` (1-based), capped, with equal jitter."""
        cfg = self.config
        ceiling: float = min(cfg.backoff_max_ms, cfg.backoff_initial_ms << min(attempt - 1, 16))
        return (ceiling / 2 + random.uniform(0, ceiling / 2)) / 1000

    def _disconnected(self) -> None:
        self.synced.clear()
        self._outbox = None
        self._holding = False

    async def _register(self) -> None:
        cfg, stats = self.config, self._runtime.stats()
        request = pb.RegisterRequest(
            protocol_version=PROTOCOL_VERSION, worker_id=self.worker_id, address=self.address,
            hash_config=pb.HashConfig(
                algorithm=self._hash.algorithm.value, page_size=self._hash.page_size,
                fingerprint=self._hash.fingerprint(),
            ),
            total_pages=stats.total_pages, policy_version=stats.policy_version,
            model=cfg.model_name,
        )
        try:
            response = await self._stub().Register(request, timeout=cfg.rpc_timeout_ms / 1000)
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION,
                              grpc.StatusCode.INVALID_ARGUMENT):
                raise RegistrationRefused(exc.details() or exc.code().name) from None
            raise
        self._registration = response
        self.incarnation = response.incarnation
        self._announced = False
        self._log.restart()
        self._log.max_events = response.max_events_per_batch or self._log.max_events
        self._log.max_message_bytes = min(cfg.max_message_bytes,
                                          response.max_message_bytes or cfg.max_message_bytes)
        self._metrics.sync_registrations.inc()
        log.info("agent.registered", worker=self.worker_id, incarnation=self.incarnation,
                 address=self.address, policy_version=stats.policy_version,
                 lease_ms=response.lease_ms, heartbeat_ms=response.heartbeat_ms)
        await self._catch_up(response.policy_version, response.weights_uri)

    async def _catch_up(self, version: int, weights_uri: str) -> None:
        """Serve the version the Register answer names (a worker fenced by a barrier, or one
        registering mid-update, must load it; it is unroutable until it does, and its
        heartbeats tell the coordinator when it has). A fresh registration also reopens the
        generation gate: a DRAIN whose RESUME never came (fenced) must not close it forever."""
        if version != self._runtime.policy_version:
            log.info("agent.catching_up", worker=self.worker_id,
                     loaded=self._runtime.policy_version, version=version)
            await asyncio.to_thread(self._runtime.load_weights, version, weights_uri or None)
        self._gate.open()

    # ------------------------------------------------------------------ the stream

    async def _sync(self) -> None:
        """One Sync stream, from hello until it ends (raises the stream's error)."""
        call = self._stub().Sync()
        hello = pb.SyncHello(worker_id=self.worker_id, incarnation=self.incarnation,
                             last_acked_seq=self._log.last_acked)
        await call.write(pb.SyncRequest(protocol_version=PROTOCOL_VERSION, hello=hello))
        first = await call.read()
        if first is grpc.aio.EOF or first.WhichOneof("body") != "welcome":
            raise ConnectionError(f"expected a welcome, got {first!r}")
        outbox: asyncio.Queue[pb.SyncRequest] = asyncio.Queue()
        if not self._announced:
            await self._announce(outbox)
        else:
            self._resume(first.welcome.next_seq, outbox)
        self._outbox = outbox
        self.synced.set()
        self._metrics.sync_streams.inc()
        log.info("agent.synced", worker=self.worker_id, incarnation=self.incarnation,
                 next_seq=first.welcome.next_seq, resent=outbox.qsize())
        self._flush()
        tasks = [
            asyncio.create_task(self._write(call, outbox)),
            asyncio.create_task(self._heartbeats()),
            asyncio.create_task(self._read(call)),
        ]
        reader = tasks[2]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if reader not in done:
                # A write into a stream the coordinator just ended fails with a bare transport
                # error; the reader receives the status that says why (fenced, superseded...).
                await asyncio.wait([reader], timeout=1.0)
                if reader.done():
                    done = {reader, *done}
            for task in sorted(done, key=lambda t: t is not reader):
                task.result()  # raises the stream's error, the reader's first
            raise ConnectionError("the coordinator closed the Sync stream")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            call.cancel()

    async def _announce(self, outbox: asyncio.Queue[pb.SyncRequest]) -> None:
        """A new incarnation starts with nothing indexed: send every held page (seq 1...)."""
        self._log.restart()  # pending events are reflected in the snapshot
        keys = await asyncio.to_thread(self._runtime.inventory)
        for batch in self._log.inventory_batches(keys):
            self._enqueue_batch(outbox, batch)
        self._announced = True
        log.info("agent.announced", worker=self.worker_id, pages=len(keys), seq=self._log.seq)

    def _resume(self, next_seq: int, outbox: asyncio.Queue[pb.SyncRequest]) -> None:
        resume = self._log.resume(next_seq)
        for batch in resume.batches:
            self._enqueue_batch(outbox, batch)
        if resume.gap_seq is not None:
            log.warning("agent.batches_lost", worker=self.worker_id, next_seq=next_seq)
            outbox.put_nowait(pb.SyncRequest(protocol_version=PROTOCOL_VERSION,
                                             events=pb.EventBatch(seq=resume.gap_seq)))

    def _enqueue_batch(self, outbox: asyncio.Queue[pb.SyncRequest], batch: pb.EventBatch) -> None:
        outbox.put_nowait(pb.SyncRequest(protocol_version=PROTOCOL_VERSION, events=batch))
        self._metrics.sync_batches.inc()

    def _send(self, request: pb.SyncRequest) -> bool:
        """Queue one message on the current stream; False when there is none."""
        if self._outbox is None:
            return False
        request.protocol_version = PROTOCOL_VERSION
        self._outbox.put_nowait(request)
        return True

    async def _write(self, call: Any, outbox: asyncio.Queue[pb.SyncRequest]) -> None:
        while True:
            await call.write(await outbox.get())

    async def _read(self, call: Any) -> None:
        # read(), not `async for`: grpc.aio forbids mixing the iterator with read/write.
        while (message := await call.read()) is not grpc.aio.EOF:
            body = message.WhichOneof("body")
            if body == "ack":
                self._log.ack(message.ack.seq)
            elif body == "resync":
                await self._answer_resync(message.resync)
            elif body == "command":
                self._policy.handle(message.command)
            else:
                log.warning("agent.unexpected_message", worker=self.worker_id, body=body)

    async def _answer_resync(self, resync: pb.ResyncRequest) -> None:
        """Send the full inventory in chunks under the message limit; ``seq`` = last sent."""
        self._holding = True
        try:
            seq = self._log.rebase()
            keys = await asyncio.to_thread(self._runtime.inventory)
            per = self._log.keys_per_message()
            chunks = [keys[i:i + per] for i in range(0, len(keys), per)] or [[]]
            for i, chunk in enumerate(chunks):
                self._send(pb.SyncRequest(inventory=pb.InventoryChunk(
                    resync_id=resync.resync_id, page_keys=b"".join(chunk), tier=pb.TIER_GPU,
                    last=i == len(chunks) - 1, seq=seq,
                )))
        finally:
            self._holding = False
        self._metrics.sync_resyncs.inc()
        log.info("agent.resync_answered", worker=self.worker_id, resync=resync.resync_id,
                 reason=resync.reason, pages=len(keys), seq=seq)
        self._flush()

    async def _heartbeats(self) -> None:
        registration = self._registration
        assert registration is not None  # set by _register before any stream
        period = (self.config.heartbeat_ms or registration.heartbeat_ms or 1000) / 1000
        while True:
            stats = self._runtime.stats()
            self._gate.completion.clear()
            self._send(pb.SyncRequest(heartbeat=pb.Heartbeat(
                running_requests=stats.running_requests, queued_tokens=stats.queued_tokens,
                free_pages=stats.free_pages, total_pages=stats.total_pages,
                completed_routes=self._gate.take_completed(),
                policy_version=stats.policy_version,
            )))
            # Next beat after the period, or soon after a generation finishes (a route that
            # is still counted as queued work would push the conversation's next turn away
            # from its own cache). The short pause coalesces a burst into one heartbeat.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._gate.completion.wait(), period)
            await asyncio.sleep(COMPLETION_COALESCE_S)

    # ------------------------------------------------------------------ page events

    def page_event(self, kind: pb.PageEvent.Kind, keys: list[bytes]) -> None:
        """One runtime event (on the loop): batch it; cut now when a batch is full, else
        within ``event_flush_ms``."""
        self._metrics.sync_keys.labels("stored" if kind == pb.PageEvent.KIND_STORED
                                       else "removed").inc(len(keys))
        if self._log.add(kind, keys):
            self._flush()
        elif self._flush_timer is None:
            loop = asyncio.get_running_loop()
            self._flush_timer = loop.call_later(self.config.event_flush_ms / 1000, self._flush)

    def _flush(self) -> None:
        """Cut every pending event into batches and queue them (kept until acked, so a batch
        cut while disconnected is sent after the reconnect)."""
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        if self._holding or not self._announced:
            return
        while (batch := self._log.cut()) is not None:
            if self._outbox is not None:
                self._enqueue_batch(self._outbox, batch)
