"""``SyncFrontends``: the replica's side of its sync frontend processes
(``server.sync_frontend`` says why they exist).

The replica starts each frontend with one end of a Unix socket pair and serves every stream it
relays with the same code that serves a stream grpc terminates here (``server.sync_stream``),
fed from the relayed bytes and answering through the socket. ``sync_port`` is what
``Register`` tells a worker: each frontend that is up in turn, or 0 (open Sync here)
when none is up. A frontend that exits ends its streams (their workers reconnect and are sent
to another) and is started again on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import structlog

from coordinator.config import ConfigError, CoordinatorConfig
from coordinator.replica import CoordinatorReplica
from coordinator.rpc.guard import acting_as
from coordinator.rpc.identities import Identity
from coordinator.rpc.interceptor import ErrorMappingInterceptor, Mapped, details
from coordinator.server import relay_frames as frames
from coordinator.server.sync_frontend import CREDIT_WINDOW
from coordinator.server.sync_stream import SyncStream
from coordinator.v1 import coordinator_pb2 as pb

log = structlog.get_logger(__name__)

START_TIMEOUT_S = 60.0
RESTART_DELAY_S = 1.0
STOP_WAIT_S = 2.0
RECEIVE_SLICE_S = 0.002
CREDIT_CHUNK = CREDIT_WINDOW // 2
"""Consumed requests are credited back in chunks of this many (it divides the window, so a
frontend that used its whole window always gets it back)."""


class _Frontend:
    """One frontend process, seen from the replica."""

    def __init__(self, index: int, listen: str) -> None:
        self.index = index
        self.listen = listen
        self.port = 0
        self.process: asyncio.subprocess.Process | None = None
        self.writer: frames.FrameWriter | None = None
        self.streams: dict[int, _RelayedStream] = {}

    @property
    def up(self) -> bool:
        return self.writer is not None


class SyncFrontends:
    def __init__(self, service: CoordinatorReplica, errors: ErrorMappingInterceptor,
                 config: CoordinatorConfig) -> None:
        self._service = service
        self._errors = errors
        self._config = config
        host, _, port = config.listen.rpartition(":")
        first = int(port) + 1 if int(port) else 0
        self._frontends = [_Frontend(i, f"{host}:{first + i if first else 0}")
                           for i in range(config.sync_frontends)]
        self._supervisors: list[asyncio.Task[None]] = []
        self._stopping = False
        self._turn = 0
        self.restarts = 0
        """Frontends started again after they exited, since start."""

    @property
    def ports(self) -> list[int]:
        """The ports of the frontends that are up."""
        return [f.port for f in self._frontends if f.up]

    def streams_by_frontend(self) -> dict[int, int]:
        """Streams each frontend relays now, by its index (0 for one that is down)."""
        return {f.index: len(f.streams) for f in self._frontends}

    def pids(self) -> list[int]:
        """The frontend processes running now."""
        return [f.process.pid for f in self._frontends if f.process is not None]

    def sync_port(self) -> int:
        """Where a registering worker should open its stream (0: here)."""
        live = [f for f in self._frontends if f.up]
        if not live:
            return 0
        # In turn: a stream opens after its Register, so counting open streams would send a
        # burst of registrations all to one frontend.
        self._turn += 1
        return live[self._turn % len(live)].port

    async def start(self) -> None:
        """Start every frontend; returns once each serves. ConfigError naming the port when
        one cannot serve (the ones started are stopped again)."""
        try:
            for frontend in self._frontends:
                reader = await self._spawn(frontend)
                self._supervisors.append(asyncio.create_task(self._supervise(frontend, reader)))
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        self._stopping = True
        for task in self._supervisors:
            task.cancel()
        for task in self._supervisors:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for frontend in self._frontends:
            await self._end(frontend)

    async def _spawn(self, frontend: _Frontend) -> asyncio.StreamReader:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "coordinator.server.sync_frontend", str(theirs.fileno()),
                frontend.listen, stdin=asyncio.subprocess.PIPE, pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()
        assert process.stdin is not None
        process.stdin.write(json.dumps(dataclasses.asdict(self._config)).encode())
        process.stdin.close()
        frontend.process = process
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        first = await asyncio.wait_for(anext(aiter(frames.read_frames(reader)), None),
                                       START_TIMEOUT_S)
        if not first or first[0][0] != frames.READY:
            await self._end(frontend)
            raise ConfigError(
                f"sync frontend {frontend.index} cannot serve on {frontend.listen} "
                "(--sync-frontends takes the ports after --listen's: is one in use?)")
        frontend.port = first[0][1]
        frontend.writer = frames.FrameWriter(writer)
        log.info("sync_frontend.started", frontend=frontend.index, port=frontend.port,
                 pid=process.pid)
        return reader

    async def _supervise(self, frontend: _Frontend, reader: asyncio.StreamReader) -> None:
        """Serve what the frontend relays; start it again on its port when it exits."""
        while True:
            try:
                async for messages in frames.read_frames(reader):
                    await self._receive(frontend, messages)
            except (OSError, ValueError) as exc:
                log.error("sync_frontend.broken", frontend=frontend.index, error=str(exc))
            if self._stopping:
                return
            await self._end(frontend)
            log.error("sync_frontend.exited", frontend=frontend.index, port=frontend.port,
                      status=frontend.process.returncode if frontend.process else None)
            # Same port again, so a worker told it earlier finds it.
            frontend.listen = f"{frontend.listen.rpartition(':')[0]}:{frontend.port}"
            while True:
                await asyncio.sleep(RESTART_DELAY_S)
                try:
                    reader = await self._spawn(frontend)
                    self.restarts += 1
                    break
                except (ConfigError, OSError, TimeoutError) as exc:
                    log.error("sync_frontend.restart_failed", frontend=frontend.index,
                              error=str(exc))

    async def _end(self, frontend: _Frontend) -> None:
        """Close the socket, end the frontend's streams, and stop the process."""
        if frontend.writer is not None:
            frontend.writer.close()
            frontend.writer = None
        for relayed in frontend.streams.values():
            if relayed.task is not None:
                relayed.task.cancel()
        frontend.streams.clear()
        process, frontend.process = frontend.process, None
        if process is None:
            return
        # The closed socket is its signal to stop (it ends its calls UNAVAILABLE first).
        for stop in (None, process.terminate, process.kill):
            if stop is not None:
                with contextlib.suppress(ProcessLookupError):
                    stop()
            try:
                await asyncio.wait_for(process.wait(), STOP_WAIT_S)
                return
            except TimeoutError:
                continue

    async def _receive(self, frontend: _Frontend, messages: list[tuple[Any, ...]]) -> None:
        """One frame's messages, in order. Batches applied here take the loop without a task
        switch, so every ``RECEIVE_SLICE_S`` of that the loop is let go once: a route that
        arrived meanwhile waits one slice, never a whole frame (hundreds of batches)."""
        slice_end = time.perf_counter() + RECEIVE_SLICE_S
        for message in messages:
            if time.perf_counter() > slice_end:
                await asyncio.sleep(0)
                slice_end = time.perf_counter() + RECEIVE_SLICE_S
            kind, stream = message[0], message[1]
            if kind == frames.REQUEST:
                relayed = frontend.streams.get(stream)
                if relayed is not None:
                    relayed.receive(message[2])
            elif kind == frames.OPEN:
                self._open(frontend, stream, message[2])
            elif kind == frames.HALF_CLOSE:
                relayed = frontend.streams.get(stream)
                if relayed is not None:
                    relayed.half_close()
            elif kind == frames.GONE:
                relayed = frontend.streams.pop(stream, None)
                if relayed is not None and relayed.task is not None:
                    relayed.task.cancel()

    def _open(self, frontend: _Frontend, stream: int, identity: Identity) -> None:
        writer = frontend.writer
        assert writer is not None
        relayed = _RelayedStream(self._service, self._errors, writer, stream)
        frontend.streams[stream] = relayed
        relayed.task = asyncio.create_task(relayed.serve(identity))
        relayed.task.add_done_callback(lambda _: frontend.streams.pop(stream, None))


class _RelayedStream:
    """One relayed stream: served by a ``SyncStream`` as ``CoordinatorServicer.Sync`` serves
    its own, except that an event batch with nothing ahead of it is applied as its frame is
    read (``SyncStream.offer``), with no task switch, and replies go straight into the next
    frame."""

    def __init__(self, service: CoordinatorReplica, errors: ErrorMappingInterceptor,
                 writer: frames.FrameWriter, stream: int) -> None:
        self._errors = errors
        self._writer = writer
        self._id = stream
        self._queue: asyncio.Queue[pb.SyncRequest | None] = asyncio.Queue()
        self._sync = SyncStream(service, self._emit)
        self._consumed = 0
        self._ended = False
        self._started = time.perf_counter()
        self.task: asyncio.Task[None] | None = None

    def receive(self, raw: bytes) -> None:
        """A request relayed by the frontend, in stream order."""
        if self._ended:
            return
        try:
            request = pb.SyncRequest.FromString(raw)
            if self._queue.empty() and self._sync.offer(request):
                self._credit()
                return
        except Exception as exc:  # the stream ends with it, as a read of its own would
            self._emit(exc)
            if self.task is not None:
                self.task.cancel()
            return
        self._queue.put_nowait(request)

    def half_close(self) -> None:
        self._queue.put_nowait(None)

    def _credit(self) -> None:
        self._consumed += 1
        if self._consumed == CREDIT_CHUNK:
            self._writer.send((frames.CREDIT, self._id, self._consumed))
            self._consumed = 0

    async def _requests(self) -> AsyncIterator[pb.SyncRequest]:
        while (request := await self._queue.get()) is not None:
            self._credit()
            yield request

    async def serve(self, identity: Identity) -> None:
        acting_as(identity)  # this task's context: the stream's code sees its caller
        try:
            await self._sync.run(self._requests())
        finally:
            if not self._ended:  # cancelled: the frontend said the call is gone
                self._ended = True
                self._errors.record("Sync", "CANCELLED", self._started)

    def _emit(self, item: pb.SyncResponse | BaseException | None) -> None:
        if self._ended:
            return
        if isinstance(item, pb.SyncResponse):
            self._writer.send((frames.RESPONSE, self._id, item.SerializeToString()))
            return
        self._ended = True
        if item is None:
            self._writer.send((frames.DONE, self._id))
            self._errors.record("Sync", "OK", self._started)
            return
        if not isinstance(item, Exception):
            item = RuntimeError(repr(item))
        code, answer = self._errors.classify(item, "Sync")
        answer = answer or Mapped("INTERNAL")
        message = "internal error" if answer.status == "INTERNAL" else details(item)
        self._writer.send((frames.FAILED, self._id, answer.status, message,
                           answer.reason.value if answer.reason is not None else None,
                           answer.retry_after_ms, dict(answer.metadata)))
        self._errors.record("Sync", code, self._started)
