"""The worker side of the ``Sync`` protocol, once, for every worker that keeps itself in sync: the
reference worker's agent (``worker.agent``) and the bridge of an unmodified engine
(``worker.bridge.bridge``). The scripted worker of the tests and benches
(``bench/scripted_worker.py``) builds its messages with the same ``worker.sync.sync_protocol`` and
``worker.sync.event_log`` code but sends them one step at a time (tests need the violations this
loop never commits). Protocol: docs/PROTOCOL.md §4.

``Register`` (a new incarnation) -> one Sync stream: hello with the last acknowledged sequence ->
welcome(next_seq). Page events are batched and numbered by the ``EventLog``, kept until
acknowledged and resent from ``welcome.next_seq`` after a reconnect. A heartbeat carries the
owner's load every heartbeat period (sooner after ``beat_soon``). A resync request is answered
with the owner's holdings in chunks under the message limit; a new incarnation announces them as
STORED batches from seq 1. Policy commands go to the owner. A broken stream is reopened with
exponential backoff and jitter, on the next target when this one is unreachable. What the
coordinator said when it ended a stream decides what comes next, by its reason only
(``coordinator.client.outcomes``): register again, leave for good, or reconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any

import grpc
import structlog

from coordinator.core.index import PageEvent, PagesRemoved, PagesStored
from coordinator.sync_codec import KIND_TO_PB, tier_to_pb
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from coordinator.wire import PROTOCOL_VERSION
from worker.sync.coordinator_channels import CoordinatorChannels
from worker.sync.event_log import EventLog
from worker.sync.sync_protocol import (
    RegistrationRefused,
    StreamEnd,
    SyncCounters,
    SyncOwner,
    SyncSettings,
    WorkerIdentity,
    hello_request,
    refused_for_good,
    register_request,
    stream_end,
)

log = structlog.get_logger(__name__)


# Minimum spacing of early heartbeats (each renews the lease in the store, so this also bounds
# store writes per worker).
BEAT_COALESCE_S = 0.02


class SyncClient:
    """One worker identity's registration and Sync stream (see the module docstring).

    Runs on the event loop. ``synced`` is set while a stream is welcomed; ``failed`` once the
    coordinator refused the registration for good (``error`` says why); ``left`` once it
    removed the worker for good (it never registers again).
    """

    def __init__(
        self, identity: WorkerIdentity, settings: SyncSettings, owner: SyncOwner, *,
        counters: SyncCounters | None = None,
    ) -> None:
        self.identity = identity
        self.settings = settings
        self.counters = counters or SyncCounters()
        self.incarnation = 0
        self.synced = asyncio.Event()
        self.failed = asyncio.Event()
        self.left = asyncio.Event()
        self.error: BaseException | None = None
        self._owner = owner
        self._log = EventLog(
            max_unacked=settings.max_unacked_batches,
            max_message_bytes=settings.max_message_bytes,
            max_pending_keys=settings.max_pending_keys,
        )
        self._channels = CoordinatorChannels.from_settings(settings)
        self._registration: pb.RegisterResponse | None = None
        self._outbox: asyncio.Queue[pb.SyncRequest] | None = None
        self._announced = False  # this incarnation's holdings are queued (seq 1...)
        self._holding = False  # a holdings snapshot is being sent: no batch may be cut
        self._flush_timer: asyncio.TimerHandle | None = None
        self._beat_soon = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Open the channels and start registering and syncing in the background."""
        self._channels.open()
        self._task = asyncio.create_task(self._run(), name=f"sync-{self.identity.worker_id}")

    async def stop(self, *, deregister: bool = True) -> None:
        """Stop syncing; with ``deregister`` remove this worker and its pages from the
        coordinator at once (graceful shutdown) instead of waiting for the lease to run out."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if deregister and self.incarnation and not self.left.is_set() and self._channels.is_open:
            request = pb.DeregisterRequest(
                protocol_version=PROTOCOL_VERSION, worker_id=self.identity.worker_id,
                incarnation=self.incarnation,
            )
            try:
                await self.stub().Deregister(request, timeout=self.settings.rpc_timeout_s)
                log.info("sync.deregistered", worker=self.identity.worker_id,
                         incarnation=self.incarnation)
            except grpc.RpcError as exc:
                log.warning("sync.deregister_failed", worker=self.identity.worker_id,
                            code=exc.code().name)
        await self._channels.close()

    def stub(self) -> pb_grpc.CoordinatorStub:
        """A stub on the coordinator in use (after ``start``)."""
        return self._channels.stub()

    async def cordon_self(self) -> None:
        """Ask the coordinator to stop routing here now (best effort, short): the start of a
        graceful stop, so no route lands here while running generations drain."""
        if not self.incarnation or self.left.is_set() or not self._channels.is_open:
            return
        request = pb.CordonRequest(protocol_version=PROTOCOL_VERSION,
                                   worker_id=self.identity.worker_id, cordoned=True)
        try:
            await self.stub().Cordon(request, timeout=min(2.0, self.settings.rpc_timeout_s))
            log.info("sync.cordoned", worker=self.identity.worker_id)
        except grpc.RpcError as exc:
            log.warning("sync.cordon_failed", worker=self.identity.worker_id, code=exc.code().name)

    # ------------------------------------------------------------------ what the owner sends

    def page_event(self, event: PageEvent) -> None:
        """One page event (on the loop): batch it; cut now when a batch is full (or on a
        CLEARED event), else within ``event_flush_ms``."""
        match event:
            case PagesStored():
                self.counters.keys_stored += len(event.keys)
            case PagesRemoved():
                self.counters.keys_removed += len(event.keys)
        if self._log.add(KIND_TO_PB[type(event)], event.keys, tier_to_pb(event)):
            self.flush()
        elif self._flush_timer is None:
            loop = asyncio.get_running_loop()
            self._flush_timer = loop.call_later(self.settings.event_flush_ms / 1000, self.flush)

    def send(self, request: pb.SyncRequest) -> bool:
        """Queue one message (a policy acknowledgement) on the current stream; False when
        there is none."""
        if self._outbox is None:
            return False
        request.protocol_version = PROTOCOL_VERSION
        self._outbox.put_nowait(request)
        return True

    async def sent(self, timeout_s: float) -> bool:
        """Wait until every queued message was handed to the stream (a last ack before the
        owner stops the client), up to ``timeout_s``; False when it was not."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._outbox is not None and not self._outbox.empty():
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the writer took it; let the write itself complete
        return self._outbox is not None

    def beat_soon(self) -> None:
        """Send the next heartbeat soon rather than after the full period (a finished
        generation: a route still counted as queued work would push the conversation's next
        turn away from its own cache)."""
        self._beat_soon.set()

    def flush(self) -> None:
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

    # ------------------------------------------------------------------ registration

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
                log.error("sync.registration_refused", worker=self.identity.worker_id,
                          error=str(exc))
                return
            except grpc.RpcError as exc:
                if self._stream_ended(stream_end(exc), exc):
                    return
            except (ConnectionError, TimeoutError) as exc:
                log.warning("sync.stream_failed", worker=self.identity.worker_id, error=str(exc))
            except Exception:
                log.exception("sync.bug", worker=self.identity.worker_id)  # keep syncing
            finally:
                self._disconnected()
            attempt += 1
            await asyncio.sleep(self.settings.reconnect_delay_s(attempt))

    def _stream_ended(self, end: StreamEnd, exc: grpc.RpcError) -> bool:
        """Act on why the stream or registration ended; True when the client must stop."""
        details = exc.details() or ""
        if end is StreamEnd.LEAVE:
            # Removed on purpose (a pod's preStop, an operator): final. The worker keeps
            # answering what it runs until it is stopped; it never comes back.
            self.left.set()
            log.info("sync.left_fleet", worker=self.identity.worker_id, details=details)
            return True
        if end is StreamEnd.REGISTER_AGAIN:
            self.incarnation = 0  # forgotten by the coordinator: a new incarnation
            self._announced = False
        elif end is StreamEnd.NEXT_TARGET:
            self._channels.next_target()
        log.warning("sync.stream_failed", worker=self.identity.worker_id, code=exc.code().name,
                    details=details, reregister=not self.incarnation)
        return False

    def _disconnected(self) -> None:
        self.synced.clear()
        self._outbox = None
        self._holding = False

    async def _register(self) -> None:
        me, version = self.identity, self._owner.policy_version()
        request = register_request(me, version)
        try:
            response = await self.stub().Register(request, timeout=self.settings.rpc_timeout_s)
        except grpc.RpcError as exc:
            if refused_for_good(exc):
                raise RegistrationRefused(exc.details() or exc.code().name) from None
            raise
        self._registration = response
        self.incarnation = response.incarnation
        self._announced = False
        self._log.restart()
        self._log.max_events = response.max_events_per_batch or self._log.max_events
        self._log.max_message_bytes = min(
            self.settings.max_message_bytes,
            response.max_message_bytes or self.settings.max_message_bytes,
        )
        self.counters.registrations += 1
        log.info("sync.registered", worker=me.worker_id, incarnation=self.incarnation,
                 address=me.address, policy_version=version, lease_ms=response.lease_ms,
                 heartbeat_ms=response.heartbeat_ms)
        await self._owner.registered(response)

    # ------------------------------------------------------------------ the stream

    async def _sync(self) -> None:
        """One Sync stream, from hello until it ends (raises the stream's error)."""
        assert self._registration is not None
        call = (await self._channels.sync_stub(self._registration.sync_port)).Sync()
        await call.write(hello_request(self.identity.worker_id, self.incarnation,
                                       self._log.last_acked))
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
        self.counters.streams += 1
        log.info("sync.synced", worker=self.identity.worker_id, incarnation=self.incarnation,
                 next_seq=first.welcome.next_seq, resent=outbox.qsize())
        self.flush()
        await _until_first_ends(call, [
            self._write(call, outbox), self._heartbeats(), self._read(call),
        ])

    async def _announce(self, outbox: asyncio.Queue[pb.SyncRequest]) -> None:
        """A new incarnation starts with nothing indexed: send every held page (seq 1...)."""
        self._log.restart()  # pending events are reflected in the snapshot
        holdings = await self._owner.holdings()
        for batch in self._log.inventory_batches(holdings):
            self._enqueue_batch(outbox, batch)
        self._announced = True
        log.info("sync.announced", worker=self.identity.worker_id,
                 pages=sum(len(keys) for keys in holdings.values()), seq=self._log.seq)

    def _resume(self, next_seq: int, outbox: asyncio.Queue[pb.SyncRequest]) -> None:
        resume = self._log.resume(next_seq)
        for batch in resume.batches:
            self._enqueue_batch(outbox, batch)
        if resume.gap_seq is not None:
            log.warning("sync.batches_lost", worker=self.identity.worker_id, next_seq=next_seq)
            outbox.put_nowait(pb.SyncRequest(protocol_version=PROTOCOL_VERSION,
                                             events=pb.EventBatch(seq=resume.gap_seq)))

    def _enqueue_batch(self, outbox: asyncio.Queue[pb.SyncRequest], batch: pb.EventBatch) -> None:
        outbox.put_nowait(pb.SyncRequest(protocol_version=PROTOCOL_VERSION, events=batch))
        self.counters.batches += 1

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
                self._owner.command(message.command)
            else:
                log.warning("sync.unexpected_message", worker=self.identity.worker_id, body=body)

    async def _answer_resync(self, resync: pb.ResyncRequest) -> None:
        """Send the full holdings in chunks under the message limit; ``seq`` = last sent."""
        self._holding = True
        try:
            self._log.rebase()
            holdings = await self._owner.holdings()
            for chunk in self._log.inventory_chunks(holdings, resync.resync_id):
                self.send(pb.SyncRequest(inventory=chunk))
        finally:
            self._holding = False
        self.counters.resyncs += 1
        log.info("sync.resync_answered", worker=self.identity.worker_id, resync=resync.resync_id,
                 reason=resync.reason, pages=sum(len(keys) for keys in holdings.values()),
                 seq=self._log.seq)
        self.flush()

    async def _heartbeats(self) -> None:
        registration = self._registration
        assert registration is not None  # set by _register before any stream
        period = (self.settings.heartbeat_ms or registration.heartbeat_ms or 1000) / 1000
        while True:
            self._beat_soon.clear()
            beat = self._owner.heartbeat()
            beat.policy_version = self._owner.policy_version()
            self.send(pb.SyncRequest(heartbeat=beat))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._beat_soon.wait(), period)
            await asyncio.sleep(BEAT_COALESCE_S)  # a burst of early beats becomes one


async def _until_first_ends(call: Any, jobs: list[Awaitable[None]]) -> None:
    """Run the stream's writer, heartbeats and reader (``jobs``, the reader last) until one
    ends; raise the stream's error, the reader's first: a write into a stream the coordinator
    just ended fails with a bare transport error, while the reader receives the status that
    says why (fenced, superseded...)."""
    tasks = [asyncio.ensure_future(job) for job in jobs]
    reader = tasks[-1]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        if reader not in done:
            await asyncio.wait([reader], timeout=1.0)
            if reader.done():
                done = {reader, *done}
        for task in sorted(done, key=lambda t: t is not reader):
            task.result()
        raise ConnectionError("the coordinator closed the Sync stream")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        call.cancel()

