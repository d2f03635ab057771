"""Replication between coordinator replicas on one Redis: what it costs the owner, how far
behind the other replicas are, and how long a new replica takes to bootstrap.

Everything runs in this process against a redis-server this benchmark starts (no persistence),
with scripted workers speaking the real Sync stream over gRPC:

- ``bench_ingest``: page-event batches/s one coordinator acks (4 workers, 64 new keys a batch,
  each worker waits for its ack) with replication on, against the same coordinator with
  replication off (``replication=False``), measured in the same run. "On" is measured twice:
  alone (what publishing costs the owner: encoding, the pipelined XADDs, reading its own entries
  back) and with a peer replica (a ``kvcoord coordinator`` process, as in a deployment) applying
  everything — on a 2-core machine the peer and Redis then share the second core with the
  owner's workers, so that figure measures the machine as much as the owner.
- ``bench_lag``: publish-to-apply lag on the peer (its ``Replicator.lags_ms`` samples) while the
  owner takes a steady ``rate`` batches/s; p50/p99/max, and how soon after the run the peer's
  index equals the owner's (``PrefixIndex.digest``: every confirmed (worker, key, tier)).

Invariants (must hold, bench/invariants.py): no acked page missing from the owner's index
(``lost_pages``), the peer's index equal to the owner's within 2 s of the last batch
(``indexes_equal``), and the new replica's index complete (``index_complete``).
- ``bench_bootstrap``: time for a new replica to report SERVING (snapshots of every worker
  taken) while the others hold 16 workers x 4,096 pages.

Run: ``kvcoord bench replication``; it prints the table and writes
bench/results/replication.json.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

from bench.scripted_worker import ScriptedWorker
from coordinator.config import CoordinatorConfig
from coordinator.core.hashing import DEV_HASH_KEY, HashConfig
from coordinator.server.main import RunningCoordinator, start_coordinator
from coordinator.store.redis_store import RedisStore
from kvcoord import child_process
from tests.redis_server import RedisServer

WORKERS = 4
HASH = HashConfig(key=DEV_HASH_KEY)
KNOBS: dict[str, Any] = {"lease_ms": 10_000, "heartbeat_ms": 2_000, "log_level": "warning"}


def _keys(n: int, rng: random.Random) -> list[bytes]:
    return [rng.randbytes(16) for _ in range(n)]


@asynccontextmanager
async def _replicas(url: str, *names: str, **knobs: Any) -> AsyncIterator[
        list[RunningCoordinator]]:
    async with AsyncExitStack() as stack:
        started = []
        for name in names:
            running = await start_coordinator(CoordinatorConfig(
                listen="127.0.0.1:0", redis=url, replica_id=name, **KNOBS, **knobs))
            stack.push_async_callback(running.stop, 0.2)
            started.append(running)
        yield started


async def _workers(target: str, n: int, prefix: str) -> list[ScriptedWorker]:
    workers = [ScriptedWorker(target, f"{prefix}{i}", hash_config=HASH, total_pages=1 << 20)
               for i in range(n)]
    for worker in workers:
        await worker.start()
    return workers


@asynccontextmanager
async def _peer_process(url: str) -> AsyncIterator[None]:
    """A replica in its own process, SERVING (listed as live) when this yields."""
    env = {**os.environ, "KVCOORD_LOG_LEVEL": "warning", "KVCOORD_REPLICA_ID": "peer"}
    proc = child_process.start(
        [sys.executable, "-m", "kvcoord.cli", "coordinator", "--redis", url, "--listen",
         "127.0.0.1:0"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    store = await RedisStore.connect(url, namespace="default")
    try:
        deadline = time.monotonic() + 30
        while "peer" not in await store.live_replicas():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the peer replica did not start")
            await asyncio.sleep(0.05)
        yield
    finally:
        await store.close()
        proc.terminate()
        proc.wait(10)


async def _ingest(url: str, replication: bool, seconds: float, *,
                  peer: bool = False) -> tuple[float, int]:
    """(acked batches/s, pages acked but missing from the owner's index afterwards)."""
    async with AsyncExitStack() as stack:
        if peer:
            await stack.enter_async_context(_peer_process(url))
        owner, = await stack.enter_async_context(
            _replicas(url, "owner", replication=replication))
        workers = await _workers(f"127.0.0.1:{owner.port}", WORKERS, "ingest")
        rng = random.Random(1)
        deadline = time.perf_counter() + seconds
        counts = [0] * len(workers)

        async def pump(i: int, worker: ScriptedWorker) -> None:
            while time.perf_counter() < deadline:
                await worker.store(_keys(64, rng))
                counts[i] += 1

        started = time.perf_counter()
        await asyncio.gather(*(pump(i, w) for i, w in enumerate(workers)))
        elapsed = time.perf_counter() - started
        lost = sum(counts) * 64 - owner.service.index.stats().holdings
        for worker in workers:
            await worker.close()
        return sum(counts) / elapsed, lost


def bench_ingest(seconds: float = 2.0) -> dict[str, float]:
    async def run() -> dict[str, float]:
        with RedisServer() as server:
            off, lost_off = await _ingest(server.url, False, seconds)
            alone, lost_alone = await _ingest(server.url, True, seconds)
            with_peer, lost_peer = await _ingest(server.url, True, seconds, peer=True)
        return {"lost_pages": lost_off + lost_alone + lost_peer,
                "batches_per_s.replication_off": off,
                "batches_per_s.replication_on": alone,
                "batches_per_s.replication_on_with_peer_process": with_peer,
                "ratio.on_vs_off": alone / off, "ratio.on_with_peer_vs_off": with_peer / off}

    return asyncio.run(run())


def bench_lag(rate: int = 500, seconds: float = 3.0) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        with RedisServer() as server:
            async with _replicas(server.url, "owner", "peer") as (owner, peer):
                workers = await _workers(f"127.0.0.1:{owner.port}", WORKERS, "lag")
                replicator = peer.service.replicator
                assert replicator is not None
                replicator.lags_ms.clear()
                rng = random.Random(2)
                per_worker = rate / len(workers)
                sent = [0]

                async def paced(worker: ScriptedWorker) -> None:
                    start = time.perf_counter()
                    n = 0
                    while (now := time.perf_counter()) - start < seconds:
                        due = start + n / per_worker
                        if due > now:
                            await asyncio.sleep(due - now)
                        await worker.store(_keys(16, rng))
                        n += 1
                        sent[0] += 1

                started = time.perf_counter()
                await asyncio.gather(*(paced(w) for w in workers))
                elapsed = time.perf_counter() - started
                settle = time.perf_counter()
                while not (equal := peer.service.index.digest() == owner.service.index.digest()
                           ) and time.perf_counter() - settle < 2.0:
                    await asyncio.sleep(0.005)
                agreed_after_ms = (time.perf_counter() - settle) * 1000
                lost = sent[0] * 16 - owner.service.index.stats().holdings
                lags = sorted(replicator.lags_ms)
                for worker in workers:
                    await worker.close()
                return {
                    "rate_batches_per_s.target": rate,
                    "rate_batches_per_s.achieved": sent[0] / elapsed,
                    "keys_per_batch": 16,
                    "lag_ms.p50": statistics.median(lags),
                    "lag_ms.p99": lags[min(len(lags) - 1, int(0.99 * len(lags)))],
                    "lag_ms.max": lags[-1],
                    "samples": len(lags),
                    "indexes_equal_after_ms": agreed_after_ms,
                    "indexes_equal": equal,
                    "lost_pages": lost,
                }

    return asyncio.run(run())


def bench_bootstrap(workers: int = 16, pages: int = 4096) -> dict[str, float]:
    async def run() -> dict[str, float]:
        with RedisServer() as server:
            async with _replicas(server.url, "a", "b") as (a, _b):
                fleet = await _workers(f"127.0.0.1:{a.port}", workers, "boot")
                rng = random.Random(3)
                for worker in fleet:
                    for _ in range(pages // 1024):
                        await worker.store(_keys(1024, rng))
                started = time.perf_counter()
                async with _replicas(server.url, "c") as (c,):
                    elapsed = time.perf_counter() - started
                    same = (c.service.index.stats().holdings
                            == a.service.index.stats().holdings == workers * pages)
                for worker in fleet:
                    await worker.close()
                return {"workers": workers, "pages": workers * pages,
                        "serving_after_ms": elapsed * 1000, "index_complete": float(same)}

    return asyncio.run(run())
