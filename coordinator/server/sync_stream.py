"""One worker's ``Sync`` stream on a replica: read what the worker sends, apply it, reply.

The stream is served the same way whether grpc terminates it in this process
(``CoordinatorServicer.Sync``) or a sync frontend process does and relays its messages
(``server.sync_relay``): ``serve_sync`` takes the worker's requests as an async iterator and
yields the replies.

Two tasks share a stream. The reader reads every message as it arrives; the applier applies,
in the stream's order, everything that must stay ordered (event batches, inventory, policy
acks, a heartbeat that changes the worker's version). Event batches wait for the ingest
budget (``control.sessions.ingest_governor``) in the applier, so a heartbeat behind a held
batch is not held with it: the reader takes it at once (it renews the lease and reports
load, neither of which depends on the pages before it). The ordered queue is bounded
(``HELD_MESSAGES``): past it the reader stops reading, and HTTP/2 flow control pushes back
on the worker, whose agent holds and coalesces what it has not sent. Its heartbeats may then
wait behind page events, but its liveness does not: while the replica holds anything of a
stream back, it renews the worker's lease itself every heartbeat period (the worker is
talking; we are not reading): every hold is a wait for the ingest budget, and the reaper
renews the leases of the streams waiting (``control.sessions.held_streams``). A batch with
nothing ahead of it and budget to spare is applied by the reader itself (``offer``), with no
hop to the applier: the common case costs what one task did.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from coordinator.control.sessions.delayed_acks import DelayedAcks
from coordinator.control.sessions.sync_messages import Outbound
from coordinator.core.errors import FailedPrecondition, InvalidArgument
from coordinator.core.fleet import RegisteredWorker
from coordinator.replica import CoordinatorReplica
from coordinator.rpc.guard import caller
from coordinator.rpc.identities import check_worker
from coordinator.rpc.versions import check_protocol
from coordinator.server import convert
from coordinator.sync_codec import events_from_pb
from coordinator.v1 import coordinator_pb2 as pb

HELD_MESSAGES = 64
"""Ordered messages (mostly event batches) one stream may have read but not yet applied: at
an engine's 5 batches a second, over 12 s of held ingest before the stream pushes back."""

_END = None


Emit = Callable[["pb.SyncResponse | BaseException | None"], None]
"""Where a stream's output goes, in order: a reply, then at the end None (a clean end) or the
exception to end the stream with."""


async def serve_sync(
    service: CoordinatorReplica, requests: AsyncIterator[pb.SyncRequest],
) -> AsyncIterator[pb.SyncResponse]:
    """The replies to one worker's Sync stream, in order; raises the error that ends it."""
    outgoing: asyncio.Queue[pb.SyncResponse | BaseException | None] = asyncio.Queue()
    stream = SyncStream(service, outgoing.put_nowait)
    task = asyncio.create_task(stream.run(requests))
    try:
        while True:
            item = await outgoing.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        task.cancel()


class SyncStream:
    """The reader and applier of one stream (see the module doc)."""

    def __init__(self, service: CoordinatorReplica, emit: Emit) -> None:
        """``emit``: where the output goes, in order."""
        self._service = service
        self._sessions = service.worker_sync
        self._emit = emit
        self._acks = DelayedAcks(self._write, service.ingest.ack_delay_s,
                                 self._sessions.counters)
        self._ordered: asyncio.Queue[pb.SyncRequest | None] = asyncio.Queue(HELD_MESSAGES)
        self._session: RegisteredWorker | None = None
        self._stream_id = 0
        self._applying = False  # the applier is inside an ordered message (it may await)

    def _write(self, replies: list[Outbound]) -> None:
        for reply in replies:
            self._emit(convert.outbound_to_pb(reply))

    def offer(self, request: pb.SyncRequest) -> bool:
        """Apply an event batch now, without a task switch, when nothing is ahead of it: the
        stream is attached, nothing read waits to be applied and the ingest budget has room
        (a relayed stream's common case, ``server.sync_relay``). False: nothing was done,
        feed it to ``run``'s requests instead. Raises what applying it raised (the stream
        must then end with it)."""
        if (self._session is None or self._applying or not self._ordered.empty()
                or request.WhichOneof("body") != "events"):
            return False
        if not self._service.ingest.admits_now() or not self._owned():
            return False
        self._apply_batch(request)
        return True

    def _apply_batch(self, request: pb.SyncRequest) -> None:
        """Apply an admitted event batch, reply, and charge its time to the ingest budget."""
        assert self._session is not None
        began = time.perf_counter()
        events = events_from_pb(request.events)
        self._acks.reply(self._sessions.events(self._session, request.events.seq, events))
        self._service.ingest.applied(time.perf_counter() - began)

    def _owned(self) -> bool:
        assert self._session is not None
        return self._sessions.owns(self._session, self._stream_id)

    async def run(self, requests: AsyncIterator[pb.SyncRequest]) -> None:
        """Serve the stream until it ends; the outcome goes to ``emit`` (None: a clean
        end, an exception: the error to end the stream with)."""
        applier: asyncio.Task[bool] | None = None
        try:
            if not await self._hello(requests):
                self._emit(None)
                return
            applier = asyncio.create_task(self._apply_ordered())
            if await _first_to_fail(self._read(requests), applier):
                self._acks.flush()
                self._emit(None)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._acks.flush()
            self._emit(exc)
        finally:
            if applier is not None:
                applier.cancel()
            self._acks.discard()
            if self._session is not None:
                self._sessions.disconnect(self._session, self._stream_id)

    async def _admit_keeping_alive(self) -> None:
        """Wait for the ingest budget to admit this stream's next batch. Everything held back
        of the stream is behind this wait (the ordered queue, a relay's queue, the worker's
        own sends), its heartbeats included, so meanwhile the replica renews the worker's
        lease itself (``control.sessions.held_streams``)."""
        ingest = self._service.ingest
        if ingest.admits_now():
            return
        held = self._service.held_streams
        assert self._session is not None
        held.hold(self._session)
        try:
            await ingest.admit()
        finally:
            held.release(self._session)

    async def _hello(self, requests: AsyncIterator[pb.SyncRequest]) -> bool:
        """Attach the stream to its worker's session; False when it ended before a hello."""
        first = await anext(aiter(requests), None)
        if first is None:
            return False
        check_protocol(first.protocol_version)
        if first.WhichOneof("body") != "hello":
            raise FailedPrecondition("the first Sync message must be a hello")
        hello = first.hello
        check_worker(caller(), hello.worker_id)
        await self._service.before_hello(hello.worker_id, hello.incarnation,
                                         hello.last_acked_seq)
        send = self._acks.reply
        self._session, self._stream_id, replies = self._sessions.hello(
            hello.worker_id, hello.incarnation, hello.last_acked_seq,
            close=self._emit,
            send=lambda message: send([message]),
        )
        send(replies)
        await self._service.updates.reconnected(self._session)
        return True

    async def _read(self, requests: AsyncIterator[pb.SyncRequest]) -> bool:
        """Read until the worker closes the stream (True) or it is superseded (False); hand
        ordered messages to the applier, take in-order-free heartbeats at once."""
        session = self._session
        assert session is not None
        async for request in requests:
            check_protocol(request.protocol_version)
            if not self._owned():
                return False  # WorkerStreams.close queued the FAILED_PRECONDITION that ends us
            body = request.WhichOneof("body")
            if body == "heartbeat" and request.heartbeat.policy_version == session.policy_version:
                self._acks.reply(await self._dispatch(request))
                continue
            if body == "events" and self.offer(request):
                continue  # nothing ahead of it and the budget had room: applied here
            await self._ordered.put(request)
        await self._ordered.put(_END)
        return True

    async def _apply_ordered(self) -> bool:
        """Apply ordered messages until the reader's end mark (True) or the stream is no
        longer this session's (False)."""
        while (request := await self._ordered.get()) is not _END:
            self._applying = True
            events = request.WhichOneof("body") == "events"
            if events:
                await self._admit_keeping_alive()  # within the loop's budget for page events
            if not self._owned():
                return False
            if events:
                self._apply_batch(request)
            else:
                self._acks.reply(await self._dispatch(request))
            self._applying = False
        return True

    async def _dispatch(self, request: pb.SyncRequest) -> list[Outbound]:
        sessions = self._sessions
        session = self._session
        assert session is not None
        body = request.WhichOneof("body")  # event batches: _apply_batch
        if body == "heartbeat":
            return await sessions.heartbeat(session, convert.heartbeat_from(request.heartbeat))
        if body == "inventory":
            return sessions.inventory(session, convert.inventory_from(request.inventory))
        if body == "hello":
            raise FailedPrecondition("hello sent twice on one stream")
        if body == "policy_ack":
            stage = convert.ACK_STAGE_FROM_PB.get(request.policy_ack.stage)
            if stage is None:
                raise InvalidArgument(f"unknown policy ack stage {request.policy_ack.stage}")
            await self._service.updates.ack(session, stage, request.policy_ack.version,
                                            request.policy_ack.reason)
            return []
        raise InvalidArgument("empty Sync message: set one body")


async def _first_to_fail(reading: Awaitable[bool], applier: asyncio.Task[bool]) -> bool:
    """Run the reader beside the applier; True when both ended cleanly, False when the stream
    was superseded; raises the first error of either. A clean end waits for the applier to
    reach the end mark the reader queued, so every batch read is applied first."""
    reader = asyncio.ensure_future(reading)
    pending: set[asyncio.Future[bool]] = {reader, applier}
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if not task.result():  # raises the task's error, if it failed
                    return False
        return True
    finally:
        for task in (reader, applier):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(reader, applier, return_exceptions=True)
