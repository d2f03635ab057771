"""GetStats answers the index digest the chaos bench compares across replicas
(``bench.chaos_round.index_digest``), only when asked: the digest of exactly the confirmed
entries the coordinator holds."""

from __future__ import annotations

import asyncio
import time

import grpc

from bench.chaos_round import index_digest
from bench.scripted_worker import ScriptedWorker
from coordinator.core.index import PrefixIndex, Tier
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from coordinator.wire import PROTOCOL_VERSION
from tests.coordinator_fixtures import DEV_HASH, running_coordinator, target


async def test_get_stats_answers_the_digest_of_the_confirmed_entries_when_asked() -> None:
    # The scripted worker sends no heartbeat: a lease longer than the test keeps a loaded
    # machine's slow digest call from lapsing it (the fixture's 2 s lapsed once in CI).
    async with running_coordinator(lease_ms=60_000) as running:
        worker = ScriptedWorker(target(running), "w1", hash_config=DEV_HASH)
        await worker.start()
        try:
            empty = await asyncio.to_thread(index_digest, target(running))
            keys = worker.keys(list(range(64)))
            await worker.store(keys[:2])
            await worker.store(keys[2:], tier=pb.TIER_CPU)
            held = await asyncio.to_thread(index_digest, target(running))
            async with grpc.aio.insecure_channel(target(running)) as channel:
                plain = await pb_grpc.CoordinatorStub(channel).GetStats(
                    pb.GetStatsRequest(protocol_version=PROTOCOL_VERSION))
        finally:
            await worker.close()
    expected = PrefixIndex(clock=time.monotonic)
    expected.store("w1", keys[:2], Tier.GPU)
    expected.store("w1", keys[2:], Tier.CPU)
    assert empty == bytes(16).hex()
    assert held == expected.digest().hex() != empty
    assert plain.index_digest == b""  # not asked: not computed
