"""Ingest is bounded: page-event batches take at most ``ingest_max_share`` of the event loop;
past it their streams wait (flow control pushes back to the workers) while routes are answered,
and nothing a worker sent is lost or reordered. The governor alone, then a real coordinator
with a budget so small that nearly every batch waits."""

from __future__ import annotations

import asyncio
import os

import pytest

from bench.scripted_worker import ScriptedWorker
from coordinator.client import AsyncCoordinatorClient
from coordinator.config import ConfigError, CoordinatorConfig
from coordinator.control.sessions.ingest_governor import IngestGovernor
from coordinator.server.metrics import CoordinatorMetrics
from coordinator.v1 import coordinator_pb2 as pb
from tests.coordinator_fixtures import DEV_HASH, eventually, running_coordinator, target


async def test_a_batch_past_the_windows_budget_waits_for_the_next_window() -> None:
    waits: list[float] = []
    governor = IngestGovernor(0.5, window_s=0.2)
    governor.on_wait = waits.append
    await asyncio.wait_for(governor.admit(), 0.01)  # budget left: at once
    governor.applied(0.15)  # more than half of the window spent on events
    admitted = asyncio.create_task(governor.admit())
    await asyncio.sleep(0)
    assert not admitted.done() and governor.waiting == 1
    await asyncio.wait_for(admitted, 2.0)
    assert governor.waiting == 0 and governor.waited == 1 and len(waits) == 1


async def test_the_lag_watch_sleeps_while_no_batch_comes_and_wakes_with_the_next() -> None:
    # An idle replica must not tick 50 times a second for nothing: once no batch came for
    # idle_s and the share is whole, the watch ends; a batch restarts it.
    governor = IngestGovernor(0.5, idle_s=0.1)
    governor.start()
    assert governor.watching
    await asyncio.sleep(0.05)  # ticks while the start is recent
    assert governor.watching
    async def asleep() -> bool:
        return not governor.watching

    await eventually(asleep, timeout=2.0, what="the watch to stop")
    assert governor.share == governor.max_share
    await asyncio.wait_for(governor.admit(), 0.01)
    assert governor.watching
    await governor.stop()
    assert not governor.watching
    governor.applied(0.001)  # after stop, a batch starts nothing
    assert not governor.watching


async def test_unbounded_admits_everything_at_once() -> None:
    governor = IngestGovernor(1.0)
    governor.applied(100.0)
    await asyncio.wait_for(governor.admit(), 0.01)
    assert governor.waited == 0


@pytest.mark.parametrize("share", [0.0, -0.1, 1.5])
def test_a_share_outside_zero_to_one_is_refused(share: float) -> None:
    with pytest.raises(ConfigError, match="ingest_max_share"):
        CoordinatorConfig(ingest_max_share=share)
    with pytest.raises(ValueError, match="max_share"):
        IngestGovernor(share)


async def test_batches_held_back_are_all_applied_in_order_and_routes_still_answer() -> None:
    # A budget of 1 ms per 100 ms, and batches of 2,048 keys that each take longer than that
    # to apply: the second batch, sent right behind the first, must wait. The lease outlasts
    # the test: a held-back stream's heartbeats wait behind its batches too.
    async with running_coordinator(ingest_max_share=0.01, lease_ms=30_000) as running, \
            AsyncCoordinatorClient(target(running)) as client:
        metrics = CoordinatorMetrics(running.service)
        worker = ScriptedWorker(target(running), "w1", hash_config=DEV_HASH)
        await worker.start()
        await worker.heartbeat()
        batches = [[os.urandom(16) for _ in range(2048)] for _ in range(8)]
        try:
            for keys in batches:  # sent without waiting for acks: the stream backs up
                worker.held.update(keys)
                await worker.send_events([pb.PageEvent(kind=pb.PageEvent.KIND_STORED,
                                                       page_keys=b"".join(keys))])
            answered = await client.route(list(range(64)))  # not held back by the events
            assert answered.worker_id == "w1"
            # Acks are cumulative, and a replica that lagged merges them (DelayedAcks): read
            # until one covers the last batch, each covering more than the one before.
            acked = [0]
            while acked[-1] < len(batches):
                message = await worker.next_message(timeout=30)
                assert message.WhichOneof("body") == "ack", message
                assert message.ack.seq > acked[-1], f"acks out of order: {acked} then {message}"
                acked.append(message.ack.seq)
            assert acked[-1] == len(batches)

            async def all_indexed() -> bool:
                return (await client.stats()).index_keys == len(worker.held)

            await eventually(all_indexed, what="every batch's keys in the index")
            waited = metrics.registry.get_sample_value("kvcoord_ingest_waited_batches_total")
            assert waited is not None and waited > 0  # the budget did hold batches back
            assert metrics.registry.get_sample_value("kvcoord_ingest_wait_seconds_count") == waited
        finally:
            await worker.close()


async def test_a_heartbeat_behind_held_batches_is_taken_at_once() -> None:
    # 1 ms of each 100 ms for page events, and 48 batches of 4,096 keys that take several ms
    # each: applying them all takes seconds. A heartbeat sent behind them must report its load
    # (and renew the lease) while they are still held, not after the last is applied.
    async with running_coordinator(ingest_max_share=0.01, lease_ms=30_000) as running, \
            AsyncCoordinatorClient(target(running)) as client:
        worker = await _started_worker(target(running))
        try:
            await _send_batches_unacked(worker, 48, 4096)
            await worker.heartbeat(running_requests=7)

            async def load_reported() -> bool:
                (info,) = await client.workers()
                return info.running_requests == 7

            await eventually(load_reported, what="the heartbeat's load", timeout=5)
            indexed = (await client.stats()).index_keys
            assert indexed < len(worker.held), (
                "every batch was applied before the heartbeat: it waited behind them")

            async def all_indexed() -> bool:
                return (await client.stats()).index_keys == len(worker.held)

            await eventually(all_indexed, what="every held batch applied after", timeout=60)
        finally:
            await worker.close()


async def test_a_stream_held_back_past_its_lease_stays_live_without_heartbeats() -> None:
    # A lease of 1.5 s, and batches the 1% budget takes several seconds to apply: the worker
    # sends no heartbeat at all after the first, and its stream is held back all along. The
    # replica renews the lease of a stream it holds back, so the worker stays routable.
    async with running_coordinator(ingest_max_share=0.01, lease_ms=1500,
                                   heartbeat_ms=300) as running, \
            AsyncCoordinatorClient(target(running)) as client:
        worker = await _started_worker(target(running))
        try:
            await _send_batches_unacked(worker, 48, 4096)
            for _ in range(6):  # 3 s: two leases
                await asyncio.sleep(0.5)
                (info,) = await client.workers()
                assert info.state == "ready", info
            assert (await client.stats()).index_keys < len(worker.held)  # still held back
        finally:
            await worker.close()


async def _started_worker(coordinator: str) -> ScriptedWorker:
    """A worker streaming to ``coordinator``, room for 2^18 pages, one heartbeat sent."""
    worker = ScriptedWorker(coordinator, "w1", hash_config=DEV_HASH, total_pages=1 << 18)
    await worker.start()
    await worker.heartbeat()
    return worker


async def _send_batches_unacked(worker: ScriptedWorker, batches: int, keys: int) -> None:
    """``batches`` batches of ``keys`` new keys each, sent without waiting for their acks."""
    for _ in range(batches):
        batch = [os.urandom(16) for _ in range(keys)]
        worker.held.update(batch)
        await worker.send_events([pb.PageEvent(kind=pb.PageEvent.KIND_STORED,
                                               page_keys=b"".join(batch))])
