"""The producers of ``kvcoord bench transport`` (bench/bench_transport.py): a process of its own,
pinned to a core of its own there, so their CPU never enters the consumer's figures.

``workers`` emulated workers each publish ``batches`` event batches, one every 1/``rate`` s,
their first ones staggered across the first period, over the transport the config names:

- ``grpc``: each worker its own connection and bidirectional ``Sync`` stream, as a worker
  process dials the coordinator (or, ``one_connection``, every stream on one connection, as
  bench fleet's generator does); a ``hello`` first, answered before the window starts; then one
  ``SyncRequest`` per batch. The acks are read after the window and counted.
- ``redis``: each worker its own connection; one stream (``<name>``, the consumer's shard);
  a batch is one ``XADD`` of ``{w: worker id, b: SyncRequest}``, awaited (its reply says the
  server holds it).
- ``nats``: workers in groups share a connection; a batch is one JetStream publish to the
  worker's subject (``<name>.<group>.<worker>``), awaited for its ``PubAck`` (stored).

A batch is a serialized ``SyncRequest{events: EventBatch}`` the size of the fleet bench's at its
steady state: 64 random 16-byte keys stored and 64 removed (~2.1 KB). Its ``seq`` carries the
publish time (``time.monotonic_ns``, one clock for every process of the host), from which the
consumer reads the end-to-end latency.

Prints one JSON object: batches sent, the window's seconds, the rate reached, this process's
CPU share, and (gRPC) the acks received. Run: ``python -m bench.transport_producer CONFIG``.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import sys
import time
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

import grpc
import nats

from coordinator.v1 import coordinator_pb2 as pb

SYNC_METHOD = "/coordinator.v1.Coordinator/Sync"
GROUP_SIZE = 64
"""Workers per NATS connection."""
KEYS_PER_BATCH = 64
KEY_BYTES = 16
PROTOCOL_VERSION = 2  # coordinator.wire.PROTOCOL_VERSION; only its encoded size matters here


@dataclass(frozen=True, slots=True)
class Config:
    transport: str
    address: str
    name: str
    """The Redis stream / NATS subject prefix of this run."""
    workers: int
    batches: int
    """Per worker."""
    rate: float = 5.0
    """Batches a second per worker."""
    one_connection: bool = False
    """gRPC: every worker's stream on one connection, instead of one connection each."""


def batch_template() -> pb.SyncRequest:
    """One worker's batch: 64 keys stored, 64 removed; ``events.seq`` is set at each publish."""
    stored = pb.PageEvent(kind=pb.PageEvent.KIND_STORED,
                          page_keys=os.urandom(KEYS_PER_BATCH * KEY_BYTES))
    removed = pb.PageEvent(kind=pb.PageEvent.KIND_REMOVED,
                           page_keys=os.urandom(KEYS_PER_BATCH * KEY_BYTES))
    return pb.SyncRequest(protocol_version=PROTOCOL_VERSION,
                          events=pb.EventBatch(seq=time.monotonic_ns(), events=[stored, removed]))


def worker_id(worker: int) -> str:
    return f"w{worker:04d}"


def group_of(worker: int) -> int:
    return worker // GROUP_SIZE


def groups(workers: int) -> int:
    return group_of(workers - 1) + 1


class Sender(Protocol):
    async def open(self) -> None:
        """Connect every worker; return once each could publish."""

    async def send(self, worker: int, data: bytes) -> None:
        """Publish one batch for ``worker``; return once the transport took it."""

    async def close(self) -> dict[str, Any]:
        """Disconnect; what the transport reported back (acks), if anything."""


class GrpcSender:
    def __init__(self, config: Config) -> None:
        self._config = config
        self._channels: list[grpc.aio.Channel] = []
        self._calls: list[Any] = []

    async def open(self) -> None:
        # A channel of its own per worker (no shared subchannel): one connection each; or, with
        # ``one_connection``, every stream on one (bench fleet's way: HTTP/2 streams).
        own = [("grpc.use_local_subchannel_pool", 1)]
        shared = grpc.aio.insecure_channel(self._config.address)
        self._channels.append(shared)
        for worker in range(self._config.workers):
            channel = shared
            if not self._config.one_connection:
                channel = grpc.aio.insecure_channel(self._config.address, options=own)
                self._channels.append(channel)
            sync = channel.stream_stream(SYNC_METHOD, request_serializer=None,
                                         response_deserializer=pb.SyncResponse.FromString)
            call = sync()
            hello = pb.SyncRequest(protocol_version=PROTOCOL_VERSION,
                                   hello=pb.SyncHello(worker_id=worker_id(worker)))
            await call.write(hello.SerializeToString())
            self._calls.append(call)
        for call in self._calls:  # every stream answered: the server holds them all
            welcome = await call.read()
            if welcome is grpc.aio.EOF or welcome.WhichOneof("body") != "welcome":
                raise RuntimeError(f"the Sync stream did not welcome: {welcome}")

    async def send(self, worker: int, data: bytes) -> None:
        await self._calls[worker].write(data)

    async def close(self) -> dict[str, Any]:
        acks = 0
        for call in self._calls:
            await call.done_writing()
            while (reply := await call.read()) is not grpc.aio.EOF:
                acks += reply.WhichOneof("body") == "ack"
        for channel in self._channels:
            await channel.close()
        return {"acks": acks}


class RedisSender:
    """Raw RESP over asyncio streams, one connection per worker: with redis-py's asyncio client
    an ``XADD`` cost this process ~150 us, which at 5,120 batches a second saturated its core
    (shared with redis-server) and made the batches late."""

    def __init__(self, config: Config) -> None:
        self._config = config
        self._connections: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._heads = []  # XADD <stream> * w <worker id> b, then the batch's bulk string
        for worker in range(config.workers):
            words = [b"XADD", config.name.encode(), b"*", b"w",
                     worker_id(worker).encode(), b"b"]
            self._heads.append(b"*7\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(w), w)
                                                     for w in words))

    async def open(self) -> None:
        url = urlsplit(self._config.address)
        for _ in range(self._config.workers):
            self._connections.append(await asyncio.open_connection(url.hostname, url.port))

    async def send(self, worker: int, data: bytes) -> None:
        reader, writer = self._connections[worker]
        writer.write(b"%s$%d\r\n%s\r\n" % (self._heads[worker], len(data), data))
        reply = await reader.readline()  # $<n>: the entry's id follows
        if not reply.startswith(b"$"):
            raise RuntimeError(f"XADD refused: {reply!r}")
        await reader.readline()

    async def close(self) -> dict[str, Any]:
        for _, writer in self._connections:
            writer.close()
            await writer.wait_closed()
        return {}


class NatsSender:
    def __init__(self, config: Config) -> None:
        self._config = config
        self._connections: list[Any] = []
        self._streams: list[Any] = []
        self._subjects = [f"{config.name}.{group_of(w)}.{worker_id(w)}"
                          for w in range(config.workers)]

    async def open(self) -> None:
        for _ in range(groups(self._config.workers)):
            connection = await nats.connect(self._config.address, max_reconnect_attempts=0)
            self._connections.append(connection)
            self._streams.append(connection.jetstream())

    async def send(self, worker: int, data: bytes) -> None:
        await self._streams[group_of(worker)].publish(self._subjects[worker], data)

    async def close(self) -> dict[str, Any]:
        for connection in self._connections:
            await connection.close()
        return {}


SENDERS: dict[str, type[GrpcSender] | type[RedisSender] | type[NatsSender]] = {
    "grpc": GrpcSender, "redis": RedisSender, "nats": NatsSender}


async def _worker(sender: Sender, worker: int, config: Config, start: float,
                  late_s: list[float]) -> None:
    period = 1.0 / config.rate
    batch = batch_template()
    for step in range(config.batches):
        due = start + period * (step + worker / config.workers)
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            late_s.append(-delay)
        batch.events.seq = time.monotonic_ns()
        await sender.send(worker, batch.SerializeToString())


async def run(config: Config) -> dict[str, Any]:
    sender: Sender = SENDERS[config.transport](config)
    await sender.open()
    late_s: list[float] = []
    before = resource.getrusage(resource.RUSAGE_SELF)
    began = time.monotonic()
    start = began + 0.1
    await asyncio.gather(*(_worker(sender, w, config, start, late_s)
                           for w in range(config.workers)))
    elapsed = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    sent = config.workers * config.batches
    return {"sent": sent, "seconds": elapsed, "rate": sent / elapsed,
            "cpu_share": cpu / (time.monotonic() - began),
            # Batches published after their slot (this process saturating shows here).
            "late_batches": len(late_s), "late_max_ms": max(late_s, default=0.0) * 1000,
            **await sender.close()}


def main() -> None:
    config = Config(**json.loads(sys.argv[1]))
    print(json.dumps(asyncio.run(run(config))))


if __name__ == "__main__":
    main()
