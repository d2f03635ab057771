"""A bridge whose engine holds 2,000,000 blocks resyncs through a real coordinator.

The bridge once answered a resync with one message per tier: past about a million 16-byte keys
that message is over the 16 MiB limit, so such an engine could never resync. Now the answer is
cut into inventory chunks under the limit (``worker.sync.event_log.inventory_chunks``). The resync
comes about as it does in production: the coordinator is out of reach while the engine keeps
publishing more than the bridge's event log holds, so the bridge comes back with a sequence gap
and the coordinator asks for everything.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from coordinator.core.index import Tier
from tests.coordinator_fixtures import eventually, running_coordinator
from tests.engine_publisher import EnginePublisher, Stored
from worker.bridge.bridge import Bridge, BridgeConfig

pytestmark = pytest.mark.slow

BLOCKS = 2_000_000
BLOCKS_PER_EVENT = 50_000
PAGE = 16  # one page per engine block
WORKER = "engine-2m"


class CuttableRelay:
    """A loopback TCP relay in front of the coordinator that the test can cut: ``cut`` closes
    every relayed connection and turns new ones away until ``restore``."""

    def __init__(self, target_port: int) -> None:
        self._target_port = target_port
        self._writers: set[asyncio.StreamWriter] = set()
        self._cut = False
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def cut(self) -> None:
        self._cut = True
        for writer in list(self._writers):
            writer.close()

    def restore(self) -> None:
        self._cut = False

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target_port)
        self._writers.update((writer, up_writer))
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    writer.close()


@contextlib.asynccontextmanager
async def relay_to(port: int) -> AsyncIterator[CuttableRelay]:
    relay = CuttableRelay(port)
    await relay.start()
    try:
        yield relay
    finally:
        await relay.close()


def engine_blocks(publisher: EnginePublisher) -> int:
    """Publish ``BLOCKS`` one-page blocks as chains of ``BLOCKS_PER_EVENT``; the last seq."""
    seq = -1
    for start in range(0, BLOCKS, BLOCKS_PER_EVENT):
        hashes = range(start + 1, start + BLOCKS_PER_EVENT + 1)
        tokens = [start // BLOCKS_PER_EVENT % 50_000] * (PAGE * BLOCKS_PER_EVENT)
        seq = publisher.publish(Stored(hashes=list(hashes), parent=None, tokens=tokens,
                                       block_size=PAGE))
    return seq


async def test_a_bridge_holding_two_million_blocks_resyncs_in_chunks_under_the_limit() -> None:
    engine = EnginePublisher(replay=None)
    try:
        # A lease and a grace long enough that the coordinator keeps the session through the
        # cut: the
        # bridge comes back under the same incarnation, with a gap, not as a new worker.
        async with running_coordinator(page_size=PAGE, lease_ms=120_000,
                                       drop_grace_ms=120_000) as coord, \
                relay_to(coord.port) as relay:
            bridge = Bridge(BridgeConfig(
                events=engine.events, coordinator=f"127.0.0.1:{relay.port}", worker_id=WORKER,
                worker_address="127.0.0.1:9", model="m", page_size=PAGE, heartbeat_ms=200,
            ))
            await bridge.start()
            try:
                await engine.wait_subscribed()
                incarnation = bridge.incarnation
                relay.cut()
                await eventually(_async(lambda: not bridge.synced.is_set()),
                                 what="the bridge to see the coordinator gone")
                last = engine_blocks(engine)
                await eventually(_async(lambda: bridge.last_seq == last), timeout=120,
                                 what="the bridge to take in every block")
                assert len(bridge.blocks) == BLOCKS
                relay.restore()
                index = coord.service.index
                await eventually(_async(lambda: index.held_count(WORKER) == BLOCKS),
                                 timeout=120, what="the coordinator to index every block")
                assert bridge.incarnation == incarnation  # resynced, never re-registered
                assert bridge.sync.counters.resyncs == 1
                assert bridge.sync.counters.registrations == 1
                # Far over one message: the answer went as several chunks.
                assert BLOCKS * 16 > 16 * 1024 * 1024
                some = bridge.blocks.inventory()[Tier.GPU][:3]
                assert [index.tier_of(WORKER, key) for key in some] == [Tier.GPU] * 3
            finally:
                await bridge.stop()
    finally:
        engine.close()


def _async(predicate):  # type: ignore[no-untyped-def]
    async def check() -> bool:
        return bool(predicate())
    return check
