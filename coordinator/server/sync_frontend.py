"""A sync frontend: a process that terminates workers' ``Sync`` streams for its replica.

Reading a stream's messages and writing its acks through grpc aio is most of what ingest
costs a replica (ARCHITECTURE §10), and it runs on the event loop that also serves routes. A
replica started with ``--sync-frontends N`` moves that work into N of these processes: each
serves ``Sync`` alone on a port of its own (``RegisterResponse.sync_port`` sends a worker
there), authenticates and paces the stream exactly as the replica would (the same guard and
error mapping), and relays each message's bytes, unparsed, to the replica over a Unix socket
(``server.relay_frames``); the replica's answers come back the same way. What a stream means,
its order and every decision stay in the replica (``server.sync_stream``): a frontend holds no
state but open calls.

Flow control: a frontend forwards at most ``CREDIT_WINDOW`` requests of a stream that the
replica has not yet consumed; past that it stops reading the call, and HTTP/2 pushes back on
the worker, as the replica itself would. Frontends run at a lower CPU priority (``NICE``)
than their replica: where they share a core, routes come first and ingest lag grows.

Run by the replica (``server.sync_relay``), never by hand:
``python -m coordinator.server.sync_frontend FD HOST:PORT`` with the coordinator's settings as
JSON on stdin.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

import grpc
import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram

from coordinator.client.channels import channel_options
from coordinator.config import CoordinatorConfig
from coordinator.core.errors import DomainError
from coordinator.logs import configure_logging
from coordinator.rpc.guard import Guard, ServerSecurity, caller
from coordinator.rpc.identities import COORDINATOR_PERMISSIONS
from coordinator.rpc.interceptor import ErrorMappingInterceptor
from coordinator.server import relay_frames as frames
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.wire import Reason

log = structlog.get_logger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"]
CREDIT_WINDOW = 16
"""Requests of one stream forwarded to the replica and not yet consumed by it."""
NICE = 19
"""How much lower than its replica a frontend's CPU priority is (see the module doc): the
lowest, so that on a core they share the replica takes what routes need and the frontend the
rest (at 5 it still took a quarter of the core and routes waited seconds at 1,024 workers,
``kvcoord bench fleet``'s frontend_same_core case)."""


class RelayedError(DomainError):
    """The error the replica ended a stream with, raised here so that the same error mapping
    answers the worker with the same status, reason and retry delay."""

    def __init__(self, status_name: str, message: str, reason: str | None,
                 retry_after_ms: int | None, metadata: dict[str, str]) -> None:
        super().__init__(message, reason=Reason(reason) if reason else None,
                         retry_after_ms=retry_after_ms, metadata=metadata)
        self.status_name = status_name


class _Call:
    """One relayed call: the replica's answers and the requests it may still be sent."""

    def __init__(self) -> None:
        self.answers: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
        self.credit = CREDIT_WINDOW
        self.credit_back = asyncio.Event()
        self.ended = False  # the replica ended it (DONE or FAILED)


class SyncFrontend:
    """The ``Sync`` handler of a frontend process, relaying to its replica."""

    def __init__(self, writer: frames.FrameWriter) -> None:
        self._writer = writer
        self._calls: dict[int, _Call] = {}
        self._next_id = 0

    async def Sync(self, requests: AsyncIterator[bytes],
                   context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """Relay one stream (admitted, paced and error-mapped by the wrapping guard)."""
        self._next_id += 1
        stream = self._next_id
        call = self._calls[stream] = _Call()
        self._writer.send((frames.OPEN, stream, caller()))
        pump = asyncio.create_task(self._forward(stream, call, requests))
        try:
            while (answer := await call.answers.get()) is not None:
                if isinstance(answer, BaseException):
                    raise answer
                yield answer
        finally:
            pump.cancel()
            del self._calls[stream]
            if not call.ended:
                self._writer.send((frames.GONE, stream))

    async def _forward(self, stream: int, call: _Call, requests: AsyncIterator[bytes]) -> None:
        async for raw in requests:
            while call.credit <= 0:
                call.credit_back.clear()
                await call.credit_back.wait()
            call.credit -= 1
            self._writer.send((frames.REQUEST, stream, raw))
        self._writer.send((frames.HALF_CLOSE, stream))

    def receive(self, messages: list[tuple[Any, ...]]) -> None:
        """The replica's messages, one frame's worth."""
        for message in messages:
            call = self._calls.get(message[1])
            if call is None:
                continue  # the call ended here first
            kind = message[0]
            if kind == frames.RESPONSE:
                call.answers.put_nowait(message[2])
            elif kind == frames.CREDIT:
                call.credit += message[2]
                call.credit_back.set()
            elif kind == frames.DONE:
                call.ended = True
                call.answers.put_nowait(None)
            elif kind == frames.FAILED:
                call.ended = True
                call.answers.put_nowait(RelayedError(*message[2:]))

    def replica_gone(self) -> None:
        """The replica closed the socket: end every call (workers reconnect)."""
        for call in self._calls.values():
            call.ended = True
            call.answers.put_nowait(RelayedError(
                "UNAVAILABLE", "the replica behind this sync frontend stopped", None, 1000, {}))


class _UnexportedMetrics:
    """The error mapping's counters, kept in a registry of this process alone: a frontend
    serves no ``/metrics``; the replica counts every relayed stream under ``Sync``."""

    def __init__(self) -> None:
        registry = CollectorRegistry()
        self.requests = Counter("relayed", "", ["method", "code"], registry=registry)
        self.latency = Histogram("relayed_seconds", "", ["method"], registry=registry)


async def serve(fd: int, listen: str, config: CoordinatorConfig) -> None:
    """Serve ``Sync`` on ``listen`` until the replica closes socket ``fd``."""
    sock = socket.socket(fileno=fd)
    reader, raw_writer = await asyncio.open_unix_connection(sock=sock)
    writer = frames.FrameWriter(raw_writer)
    frontend = SyncFrontend(writer)
    security = ServerSecurity.from_config(config)
    errors = ErrorMappingInterceptor(_UnexportedMetrics(), guard=Guard(security))
    wrapped = errors.wrap(frontend, SERVICE, COORDINATOR_PERMISSIONS, only=frozenset({"Sync"}))
    server = grpc.aio.server(options=channel_options(config.max_message_bytes))
    # No (de)serializers: the frontend relays each message's bytes as they came.
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        SERVICE.full_name, {"Sync": grpc.stream_stream_rpc_method_handler(wrapped.Sync)})])
    try:
        port = security.bind(server, listen)
    except RuntimeError:  # grpc's "Failed to bind"
        port = 0
    if port == 0:
        raise OSError(f"sync frontend: cannot bind {listen}")
    await server.start()
    writer.send((frames.READY, port))
    log.info("sync_frontend.serving", port=port, pid=os.getpid())
    try:
        async for messages in frames.read_frames(reader):
            frontend.receive(messages)
    finally:
        frontend.replica_gone()
        await server.stop(1.0)
        log.info("sync_frontend.stopped", port=port)


def main() -> None:
    fd, listen = int(sys.argv[1]), sys.argv[2]
    settings = json.load(sys.stdin)
    names = {f.name for f in dataclasses.fields(CoordinatorConfig)}
    config = CoordinatorConfig(**{k: v for k, v in settings.items() if k in names})
    configure_logging(config.log_level)
    os.nice(NICE)
    try:
        asyncio.run(serve(fd, listen, config))
    except OSError as exc:  # its replica says which port, and why, in one line
        print(exc, file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
