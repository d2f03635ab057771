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

from coordinator.config import CoordinatorConfig
from coordinator.replica import CoordinatorReplica
from coordinator.rpc.guard import acting_as
from coordinator.rpc.identities import Identity
from coordinator.rpc.interceptor import ErrorMappingInterceptor, Mapped, details
from coordinator.server import relay_frames as frames
from coordinator.server.sync_frontend import CREDIT_WINDOW
from coordinator.server.sync_stream import serve_sync
from coordinator.v1 import coordinator_pb2 as pb

log = structlog.get_logger(__name__)

START_TIMEOUT_S = 60.0
RESTART_DELAY_S = 1.0
STOP_WAIT_S = 2.0
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
        self.streams: dict[int, tuple[asyncio.Queue[bytes | None], asyncio.Task[None]]] = {}

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

    @property
    def ports(self) -> list[int]:
        """The ports of the frontends that are up."""
        return [f.port for f in self._frontends if f.up]

    def open_streams(self) -> dict[int, int]:
        """Streams each frontend that is up relays now, by its port."""
        return {f.port: len(f.streams) for f in self._frontends if f.up}

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
        """Start every frontend; returns once each serves (OSError when one cannot)."""
        for frontend in self._frontends:
            reader = await self._spawn(frontend)
            self._supervisors.append(asyncio.create_task(self._supervise(frontend, reader)))

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
            raise OSError(f"sync frontend {frontend.index} did not start on {frontend.listen} "
                          f"(exit status {process.returncode}; its log says why)")
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
                    self._receive(frontend, messages)
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
                    break
                except (TimeoutError, OSError) as exc:
                    log.error("sync_frontend.restart_failed", frontend=frontend.index,
                              error=str(exc))

    async def _end(self, frontend: _Frontend) -> None:
        """Close the socket, end the frontend's streams, and stop the process."""
        if frontend.writer is not None:
            frontend.writer.close()
            frontend.writer = None
        for _, task in frontend.streams.values():
            task.cancel()
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

    def _receive(self, frontend: _Frontend, messages: list[tuple[Any, ...]]) -> None:
        for message in messages:
            kind, stream = message[0], message[1]
            if kind == frames.REQUEST:
                entry = frontend.streams.get(stream)
                if entry is not None:
                    entry[0].put_nowait(message[2])
            elif kind == frames.OPEN:
                queue: asyncio.Queue[bytes | None] = asyncio.Queue()
                task = asyncio.create_task(self._serve(frontend, stream, message[2], queue))
                frontend.streams[stream] = (queue, task)
            elif kind == frames.HALF_CLOSE:
                entry = frontend.streams.get(stream)
                if entry is not None:
                    entry[0].put_nowait(None)
            elif kind == frames.GONE:
                entry = frontend.streams.pop(stream, None)
                if entry is not None:
                    entry[1].cancel()

    async def _serve(self, frontend: _Frontend, stream: int, identity: Identity,
                     queue: asyncio.Queue[bytes | None]) -> None:
        """One relayed stream, served as ``CoordinatorServicer.Sync`` serves its own."""
        acting_as(identity)  # this task's context: the stream's code sees its caller
        writer = frontend.writer
        assert writer is not None
        started = time.perf_counter()
        code = "OK"
        try:
            async for response in serve_sync(self._service, _requests(writer, stream, queue)):
                writer.send((frames.RESPONSE, stream, response.SerializeToString()))
            writer.send((frames.DONE, stream))
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        except Exception as exc:
            code, answer = self._errors.classify(exc, "Sync")
            answer = answer or Mapped("INTERNAL")
            message = "internal error" if answer.status == "INTERNAL" else details(exc)
            writer.send((frames.FAILED, stream, answer.status, message,
                         answer.reason.value if answer.reason is not None else None,
                         answer.retry_after_ms, dict(answer.metadata)))
        finally:
            frontend.streams.pop(stream, None)
            self._errors.record("Sync", code, started)


async def _requests(writer: frames.FrameWriter, stream: int,
                    queue: asyncio.Queue[bytes | None]) -> AsyncIterator[pb.SyncRequest]:
    """The relayed requests of one stream, parsed, crediting the frontend as they are taken."""
    consumed = 0
    while (raw := await queue.get()) is not None:
        consumed += 1
        if consumed == CREDIT_CHUNK:
            writer.send((frames.CREDIT, stream, consumed))
            consumed = 0
        yield pb.SyncRequest.FromString(raw)
