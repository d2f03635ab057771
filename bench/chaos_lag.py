"""The chaos bench's sustained-lag phase: a scripted worker on one replica sends page-event
batches at a steady rate; another replica's replication lag is read from its GetStats.

The probe behaves as a worker with a full pool of ``pool_pages`` pages does: every batch stores
``LAG_KEYS`` fresh pages and, once the pool is full, removes the ``LAG_KEYS`` oldest in the same
batch. So it never holds more than its pool, and the coordinator's per-worker page cap
(``max_pages_per_worker``, at most 4x the ``total_pages`` it registered) never ends its stream
however long it runs. If the stream does end (a refusal, a dropped replica), ``sustained_lag``
raises ``LagProbeEnded`` saying why: the run reports a failure, it never writes into an ended
call (``InvalidStateError: RPC already finished``).
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from bench.scripted_worker import ScriptedWorker
from coordinator.client import AsyncCoordinatorClient
from coordinator.core.hashing import DEV_HASH_KEY, HashConfig
from coordinator.v1 import coordinator_pb2 as pb

LAG_KEYS = 4  # pages per batch
LAG_POOL_PAGES = 1024  # the probe's registered total_pages, and the most it ever holds
LAG_WINDOW = 4096  # coordinator.replication._LAG_SAMPLES: the quantiles' window
HEARTBEAT_S = 0.3  # the cluster's heartbeat period: the probe's lease holds


class LagProbeEnded(RuntimeError):
    """The probe's Sync stream ended before the phase did; the message says how (status)."""


class _Probe:
    """A ``ScriptedWorker`` whose writes fail with ``LagProbeEnded`` once its stream is over."""

    def __init__(self, target: str, page_size: int, pool_pages: int) -> None:
        self.worker = ScriptedWorker(target, "lag-probe", total_pages=pool_pages,
                                     hash_config=HashConfig(DEV_HASH_KEY, page_size=page_size))
        self.pool_pages = pool_pages
        self.held: deque[bytes] = deque()  # oldest first
        self.ended: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.worker.start()
        self.ended = asyncio.create_task(self._read_until_end())

    async def _read_until_end(self) -> None:
        """Consume acks until the stream ends (next_message raises its error then)."""
        while True:
            await self.worker.next_message(timeout=3600)

    def check(self) -> None:
        """LagProbeEnded when the stream is over."""
        if self.ended is None or not self.ended.done():
            return
        error = self.ended.exception() if not self.ended.cancelled() else None
        status = self.worker.stream_error
        if isinstance(status, grpc.aio.AioRpcError):
            why = f"{status.code().name}: {status.details()}"
        else:
            why = f"{type(error).__name__}: {error}" if error else "closed"
        raise LagProbeEnded(f"the lag probe's Sync stream ended ({why})")

    async def _write(self, send: Callable[[], Awaitable[object]]) -> None:
        self.check()
        try:
            await send()
        except (asyncio.InvalidStateError, grpc.RpcError) as exc:
            await asyncio.sleep(0)  # let the reader record the stream's status
            self.check()
            raise LagProbeEnded(f"the lag probe's Sync stream ended ({exc!r})") from exc

    async def heartbeat(self) -> None:
        free = self.pool_pages - len(self.held)
        await self._write(lambda: self.worker.heartbeat(free_pages=free))

    async def batch(self) -> None:
        """``LAG_KEYS`` fresh pages stored; the oldest removed once the pool is full."""
        fresh = [os.urandom(16) for _ in range(LAG_KEYS)]
        events = [pb.PageEvent(kind=pb.PageEvent.KIND_STORED, page_keys=b"".join(fresh),
                               tier=pb.TIER_GPU)]
        self.held.extend(fresh)
        if len(self.held) > self.pool_pages:
            evicted = [self.held.popleft() for _ in range(len(self.held) - self.pool_pages)]
            events.append(pb.PageEvent(kind=pb.PageEvent.KIND_REMOVED,
                                       page_keys=b"".join(evicted)))
        await self._write(lambda: self.worker.send_events(events))

    async def close(self) -> None:
        if self.ended is not None:
            self.ended.cancel()
            await asyncio.gather(self.ended, return_exceptions=True)
        await self.worker.close()


async def sustained_lag(publish_target: str, observe_target: str, rate: int, seconds: float, *,
                        page_size: int, pool_pages: int = LAG_POOL_PAGES) -> dict[str, Any]:
    """The probe registers on ``publish_target`` and sends ``rate`` batches/s for ``seconds``;
    ``observe_target``'s replication stats are sampled every second. LagProbeEnded if the
    probe's stream ends before the phase does."""
    probe = _Probe(publish_target, page_size, pool_pages)
    observer = AsyncCoordinatorClient(observe_target, timeout=5.0)
    try:
        await probe.start()
        first = await observer.stats()
        loop = asyncio.get_running_loop()
        start, sent, samples, next_sample, next_beat = loop.time(), 0, [], 1.0, 0.0
        # One writer: grpc.aio refuses a second write while one is in flight.
        while (elapsed := loop.time() - start) < seconds:
            if elapsed >= next_beat:
                next_beat += HEARTBEAT_S
                await probe.heartbeat()
            while sent < int(elapsed * rate) + 1:
                await probe.batch()
                sent += 1
            if elapsed >= next_sample:
                next_sample += 1.0
                stats = await observer.stats()
                samples.append({"t_s": round(elapsed, 2), "applied": stats.replication_applied,
                                "lag_p50_ms": stats.replication_lag_p50_ms,
                                "lag_p99_ms": stats.replication_lag_p99_ms})
            await asyncio.sleep(1 / rate)
        took = loop.time() - start
        await asyncio.sleep(0.5)  # the last batches applied
        probe.check()  # ended at the very end is still a failure
        last = await observer.stats()
    finally:
        await probe.close()
        await observer.close()
    applied = last.replication_applied - first.replication_applied
    return {
        "rate_batches_per_s": rate, "pages_per_batch": LAG_KEYS, "pool_pages": pool_pages,
        "seconds": seconds, "sent_batches": sent, "sent_per_s": sent / took,
        "pages_sent": sent * LAG_KEYS, "applied_on_observer": applied,
        "window_holds_only_this_load": applied >= LAG_WINDOW,
        "lag_p50_ms": last.replication_lag_p50_ms, "lag_p99_ms": last.replication_lag_p99_ms,
        "lag_p99_ms_before": first.replication_lag_p99_ms, "samples": samples,
    }
