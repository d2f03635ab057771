"""Delayed acks (control.delayed_acks): while the replica is busy a stream's acks merge into
one cumulative ack, nothing overtakes a waiting ack, and an idle replica acks at once; the
governor says busy while its budget is cut or a stream waits. Real event loop, real timers."""

from __future__ import annotations

import asyncio

from coordinator.control.sessions import SyncCounters
from coordinator.control.sessions.delayed_acks import DelayedAcks
from coordinator.control.sessions.ingest_governor import IngestGovernor
from coordinator.control.sessions.sync_messages import Ack, Outbound, Resync


def stream(delay: float) -> tuple[DelayedAcks, list[Outbound], SyncCounters]:
    written: list[Outbound] = []
    counters = SyncCounters()
    return DelayedAcks(written.extend, lambda: delay, counters), written, counters


async def test_an_idle_replica_acks_every_batch_at_once() -> None:
    acks, written, counters = stream(0.0)
    for seq in (1, 2, 3):
        acks.reply([Ack(seq)])
    assert written == [Ack(1), Ack(2), Ack(3)] and counters.acks_merged == 0


async def test_a_busy_replica_merges_acks_and_sends_the_last_when_the_delay_ends() -> None:
    acks, written, counters = stream(0.05)
    for seq in (1, 2, 3):
        acks.reply([Ack(seq)])
    assert written == []
    await asyncio.sleep(0.1)
    assert written == [Ack(3)] and counters.acks_merged == 2
    acks.reply([Ack(4)])
    await asyncio.sleep(0.1)
    assert written == [Ack(3), Ack(4)]


async def test_no_reply_overtakes_a_waiting_ack() -> None:
    acks, written, _ = stream(10.0)
    acks.reply([Ack(7)])
    acks.reply([Resync(1, "gap")])
    assert written == [Ack(7), Resync(1, "gap")]
    acks.reply([Ack(8)])
    acks.flush()  # the stream ends: what waits is sent
    acks.reply([Ack(9)])
    acks.discard()  # the stream is gone: nothing more is written
    await asyncio.sleep(0)
    assert written == [Ack(7), Resync(1, "gap"), Ack(8)]


async def test_the_governor_delays_acks_only_while_busy() -> None:
    governor = IngestGovernor(0.7, max_ack_delay_s=1.0)
    assert governor.ack_delay_s() == 0.0
    governor.share = 0.3  # the loop fell behind: the budget was cut
    assert governor.ack_delay_s() == 1.0
    assert IngestGovernor(0.7).ack_delay_s() == 0.0  # max_ack_delay 0: never
