"""The consumer of ``kvcoord bench transport`` (bench/bench_transport.py): the coordinator's
side of the event transport, without the index, in a process of its own (pinned to core 0
there), whose CPU is what the bench compares.

Every transport does the same work per batch, :meth:`Tally.record`: parse the
``SyncRequest`` (protobuf), read its ``seq`` (the publish time) and touch its events' keys.
Around that, each does what its transport needs:

- ``grpc``: a ``grpc.aio`` server with one bidirectional ``Sync`` stream per worker; the
  generated deserializer parses each message, the handler answers the ``hello`` and writes one
  ``EventAck`` per batch (the coordinator's transport, less its reader task, queue and merged
  acks: gRPC at its leanest);
- ``redis``: ``XREADGROUP COUNT 512`` on the shard's stream (blocking while empty), then one
  ``XACK`` of what the read returned; redis-py's asyncio client with its own reply parser
  (pure Python) or hiredis's (C), as the case says;
- ``nats``: a durable JetStream pull consumer (file storage, ack-all), ``fetch(512)``, then one
  ack of the last message fetched.

With ``linger_ms`` a bulk read that was not full is followed by that pause, so the next finds
more waiting: the consumer, not the producers' cadence, sets how often it reads.

CPU is this process's (``getrusage``, every thread: grpc's C-core ones too), from the first
batch parsed to the last; the broker's (redis-server, nats-server) is read from /proc over the
same span when its pid is known. Latency: each batch's publish time to its parse. A read is one
gRPC message, one ``XREADGROUP`` reply or one ``fetch``.

Prints a JSON line ``{"ready": ADDRESS}`` (or ``{"skipped": REASON}`` where the transport cannot
be reached) once producers may start, then one JSON object of results when the ``expected``
batches have arrived or ``wait_s`` has passed. Run: ``python -m bench.transport_consumer CONFIG``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import nats
import redis.asyncio as aioredis
from nats.js.api import AckPolicy, ConsumerConfig, StorageType, StreamConfig
from redis._parsers import _AsyncHiredisParser, _AsyncRESP2Parser

from bench.transport_producer import KEY_BYTES
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc

BULK = 512
"""Batches a bulk read asks for (per stream, for Redis)."""
GROUP = "coordinator"
POLL_S = 0.5
"""How long a bulk read blocks while nothing is there (then the deadline is checked)."""
WELCOME = pb.SyncResponse(welcome=pb.SyncWelcome(next_seq=1))


@dataclass(frozen=True, slots=True)
class Config:
    transport: str
    address: str
    """Redis URL, NATS URL; for gRPC ignored (the server takes a free port)."""
    name: str
    workers: int
    expected: int
    """Batches the producers will publish."""
    wait_s: float
    """Give up this long after ready (a transport that drops batches ends here)."""
    broker_pid: int | None = None
    parser: str = "python"
    """Redis: the reply parser, ``python`` (redis-py's own) or ``hiredis`` (its C one)."""
    linger_ms: float = 0.0
    """Redis, NATS: after a read that was not full, wait this long before the next (bulk
    grows with it, and latency by up to it)."""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True, slots=True)
class Mark:
    wall: float
    cpu: float
    broker_cpu: float | None


@dataclass(slots=True)
class Tally:
    """What arrived. ``record`` is the per-batch work every transport shares."""

    config: Config
    batches: int = 0
    reads: int = 0
    keys: int = 0
    latencies_ns: list[int] = field(default_factory=list)
    first: Mark | None = None
    last: Mark | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    deadline: float = 0.0
    broker_version: str | None = None

    def mark(self) -> Mark:
        pid = self.config.broker_pid
        return Mark(time.monotonic(), _own_cpu(), cpu_seconds(pid) if pid else None)

    def record(self, request: pb.SyncRequest) -> None:
        if self.first is None:
            self.first = self.mark()
        batch = request.events
        self.latencies_ns.append(time.monotonic_ns() - batch.seq)
        self.keys += sum(len(event.page_keys) for event in batch.events) // KEY_BYTES
        self.batches += 1
        if self.batches == self.config.expected:
            self.last = self.mark()
            self.done.set()

    def finished(self) -> bool:
        return self.done.is_set() or time.monotonic() > self.deadline

    def result(self) -> dict[str, Any]:
        first, last = self.first, self.last or self.mark()
        if first is None:
            return {"batches": 0, "expected": self.config.expected,
                    "broker_version": self.broker_version}
        seconds = max(last.wall - first.wall, 1e-9)
        cpu = last.cpu - first.cpu
        ordered = sorted(self.latencies_ns)

        def quantile_ms(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e6

        out = {"batches": self.batches, "expected": self.config.expected, "reads": self.reads,
               "keys": self.keys, "batches_per_read": self.batches / max(1, self.reads),
               "seconds": seconds, "rate": self.batches / seconds, "cpu_share": cpu / seconds,
               "cpu_us_per_batch": cpu / self.batches * 1e6,
               "cpu_us_per_read": cpu / max(1, self.reads) * 1e6,
               "latency_p50_ms": quantile_ms(0.5), "latency_p99_ms": quantile_ms(0.99),
               "latency_max_ms": ordered[-1] / 1e6, "broker_version": self.broker_version}
        if first.broker_cpu is not None and last.broker_cpu is not None:
            broker = last.broker_cpu - first.broker_cpu
            out |= {"broker_cpu_share": broker / seconds,
                    "broker_cpu_us_per_batch": broker / self.batches * 1e6}
        return out


Ready = Callable[[str], None]


class SyncHandler(pb_grpc.CoordinatorServicer):
    """``Sync`` only: answer the hello, then parse each batch and ack it."""

    def __init__(self, tally: Tally) -> None:
        self._tally = tally
        self.open_streams = 0

    async def Sync(self, request_iterator: Any, context: Any) -> None:
        self.open_streams += 1
        try:
            if await context.read() is grpc.aio.EOF:  # the hello
                return
            await context.write(WELCOME)
            while (request := await context.read()) is not grpc.aio.EOF:
                self._tally.record(request)
                self._tally.reads += 1
                await context.write(pb.SyncResponse(ack=pb.EventAck(seq=request.events.seq)))
        finally:
            self.open_streams -= 1


async def consume_grpc(config: Config, tally: Tally, ready: Ready) -> None:
    server = grpc.aio.server()
    handler = SyncHandler(tally)
    pb_grpc.add_CoordinatorServicer_to_server(handler, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ready(f"127.0.0.1:{port}")
    with contextlib.suppress(TimeoutError):  # the deadline passed: report what arrived
        await asyncio.wait_for(tally.done.wait(), tally.deadline - time.monotonic())
    print(json.dumps(tally.result()), flush=True)  # before the producers hang up
    deadline = time.monotonic() + 30
    while handler.open_streams and time.monotonic() < deadline:  # they read their acks
        await asyncio.sleep(0.05)
    await server.stop(grace=1)


async def consume_redis(config: Config, tally: Tally, ready: Ready) -> None:
    parser = _AsyncHiredisParser if config.parser == "hiredis" else _AsyncRESP2Parser
    client = aioredis.Redis.from_url(config.address, parser_class=parser)
    await client.xgroup_create(config.name, GROUP, id="0", mkstream=True)
    tally.broker_version = (await client.info("server"))["redis_version"]
    ready(config.address)
    while not tally.finished():
        reply = await client.xreadgroup(GROUP, "c0", {config.name: ">"}, count=BULK,
                                        block=int(POLL_S * 1000))
        if not reply:
            continue
        tally.reads += 1
        [(_, entries)] = reply
        for _, fields in entries:
            tally.record(pb.SyncRequest.FromString(fields[b"b"]))
        await client.xack(config.name, GROUP, *(entry_id for entry_id, _ in entries))
        if config.linger_ms and len(entries) < BULK:
            await asyncio.sleep(config.linger_ms / 1000)
    await client.aclose()


async def consume_nats(config: Config, tally: Tally, ready: Ready) -> None:
    connection = await nats.connect(config.address, connect_timeout=2,
                                    max_reconnect_attempts=0, allow_reconnect=False)
    stream = connection.jetstream()
    try:
        await stream.add_stream(StreamConfig(name=config.name, subjects=[f"{config.name}.>"],
                                             storage=StorageType.FILE))
        pull = await stream.pull_subscribe(
            f"{config.name}.>", durable=GROUP, stream=config.name,
            config=ConsumerConfig(ack_policy=AckPolicy.ALL, max_ack_pending=1 << 16))
        version = connection.connected_server_version
        tally.broker_version = f"{version.major}.{version.minor}.{version.patch}"
        ready(config.address)
        while not tally.finished():
            try:
                messages = await pull.fetch(BULK, timeout=POLL_S)
            except TimeoutError:  # nats-py raises its own and asyncio's: nothing came
                continue
            tally.reads += 1
            for message in messages:
                tally.record(pb.SyncRequest.FromString(message.data))
            await messages[-1].ack()
            if config.linger_ms and len(messages) < BULK:
                await asyncio.sleep(config.linger_ms / 1000)
    finally:
        await stream.delete_stream(config.name)
        await connection.close()


CONSUMERS: dict[str, Callable[[Config, Tally, Ready], Awaitable[None]]] = {
    "grpc": consume_grpc, "redis": consume_redis, "nats": consume_nats}


async def reachable(config: Config) -> str | None:
    """Why the transport cannot be used here, or None (NATS: a JetStream server answers)."""
    if config.transport != "nats":
        return None
    try:
        connection = await nats.connect(config.address, connect_timeout=2,
                                        max_reconnect_attempts=0, allow_reconnect=False)
    except Exception as exc:  # any failure to connect means: skip, with its reason
        return f"no NATS server at {config.address}: {type(exc).__name__}: {exc}"
    try:
        await connection.jetstream().account_info()
    except Exception as exc:
        return f"NATS at {config.address} has no JetStream: {type(exc).__name__}: {exc}"
    finally:
        await connection.close()
    return None


async def run(config: Config) -> None:
    lacking = await reachable(config)
    if lacking is not None:
        print(json.dumps({"skipped": lacking}), flush=True)
        return
    tally = Tally(config)

    def ready(address: str) -> None:
        tally.deadline = time.monotonic() + config.wait_s
        print(json.dumps({"ready": address}), flush=True)

    await CONSUMERS[config.transport](config, tally, ready)
    if config.transport != "grpc":  # gRPC printed before its streams closed
        print(json.dumps(tally.result()), flush=True)


def main() -> None:
    asyncio.run(run(Config(**json.loads(sys.argv[1]))))


if __name__ == "__main__":
    main()
