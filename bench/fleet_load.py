"""The load generator of ``kvcoord bench fleet`` (bench/bench_fleet.py), a process of its own
(pinned to its own core there): many emulated workers, each its own identity and ``Sync``
stream, replaying the committed trace slice at an engine's cadence, and a scheduler issuing
``Route`` at a set rate. It measures, on the coordinator processes named by pid (CPU from
/proc, so this process's own work is never counted there):

1. the floors, first: a bare unary call (grpc health ``Check``) and a bare stream message (a
   heartbeat carrying no page events), CPU per message on the first replica;
2. ``Route`` alone at the set rate (after the ingest windows, from the scheduler process):
   CPU per route, latency p50/p99;
3. ingest: every worker sends ``steps_per_s`` event batches a second (``keys_per_step`` keys
   stored from its share of the trace; past ``capacity`` pages its oldest are removed in the
   same batch), heartbeats every ``heartbeat_s``, while routes go on at the set rate; CPU per
   batch and per key operation, event-to-visible lag on the owning and on the other replica
   (a batch's last stored key, polled with ``Lookup`` every 5 ms from its send), route
   latency, and the batch rate this process achieved (the generator saturating first shows
   there). With ``sharded`` each replica is a shard's and applies only its own workers'
   batches: its CPU per batch is over those, and "other" is the lag until a ``Lookup`` through
   the other shard's replica (which asks the owning shard) sees the key;
4. RSS of each coordinator per index key.

Prints one JSON object. Run: ``python -m bench.fleet_load CONFIG_JSON``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import resource
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.scripted_worker import ScriptedWorker
from coordinator.core.hashing import DEV_HASH_KEY, HashConfig, Namespace, PageHasher
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from kvcoord import child_process
from kvcoord.simulate.trace import load_trace, trace_page_keys
from worker.sync.coordinator_channels import on_port

TRACE = Path(__file__).resolve().parent.parent / "tests" / "data" / "mooncake_300.jsonl"
HASH = HashConfig(key=DEV_HASH_KEY)
ROUTE_TOKENS = 4096
POLL_S = 0.005
PROBE_DEADLINE_S = 5.0
"""A key not visible by then is recorded at this lag (censored) and counted."""
STORED, REMOVED = pb.PageEvent.KIND_STORED, pb.PageEvent.KIND_REMOVED


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def quantile(samples: Sequence[float], q: float) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Config:
    targets: list[str]  # one per replica
    pids: list[int]
    workers: int
    seconds: float
    steps_per_s: float = 5.0
    keys_per_step: int = 64
    capacity: int = 2048
    routes_per_s: float = 200.0
    heartbeat_s: float = 2.0
    requests: int = 300
    floor_calls: int = 2000
    frontend_pids: list[int] = field(default_factory=list)
    """The sync frontend processes of replica 0 (``--sync-frontends``), CPU read apart."""
    sharded: bool = False
    """Each target is one shard's replica, applying only the batches of the workers streaming
    to it (unsharded: every replica applies every batch)."""


class EmulatedWorker:
    """A worker's page traffic: its share of the trace's keys, stored ``keys_per_step`` a
    step; past ``capacity`` its oldest pages are removed in the same batch."""

    def __init__(self, sync: ScriptedWorker, replica: int, prompts: list[list[bytes]],
                 offset: int, config: Config) -> None:
        self.sync = sync
        self.replica = replica  # the replica that owns its stream
        self._prompts = prompts
        self._next_prompt = offset
        self._pending: deque[bytes] = deque()
        self._held: dict[bytes, None] = {}  # insertion order = age
        self._config = config

    def next_batch(self) -> tuple[list[pb.PageEvent], bytes | None, int]:
        """(events, the last key stored, key operations) of the next step."""
        want = self._config.keys_per_step
        stored: list[bytes] = []
        refills = 0
        while len(stored) < want:
            while not self._pending:  # the next prompt of its share (some have no full page)
                if refills > len(self._prompts):
                    break  # every key of the trace is held already: send what there is
                self._pending.extend(self._prompts[self._next_prompt % len(self._prompts)])
                self._next_prompt += 1
                refills += 1
            if not self._pending:
                break
            key = self._pending.popleft()
            if key not in self._held:
                self._held[key] = None
                stored.append(key)
        removed = []
        while len(self._held) > self._config.capacity:
            oldest = next(iter(self._held))
            del self._held[oldest]
            removed.append(oldest)
        events = [pb.PageEvent(kind=STORED, page_keys=b"".join(stored))] if stored else []
        if removed:
            events.append(pb.PageEvent(kind=REMOVED, page_keys=b"".join(removed)))
        return events, stored[-1] if stored else None, len(stored) + len(removed)


class Fleet:
    def __init__(self, config: Config) -> None:
        self.config = config
        # The workers' streams share one connection per replica; the scheduler and the lag
        # probes have connections of their own, as they would in a deployment (a stalled
        # stream's flow-control window must not hold their calls back).
        self.channels = [grpc.aio.insecure_channel(t) for t in config.targets]
        self.sync_channels: dict[int, grpc.aio.Channel] = {}
        own = [("grpc.use_local_subchannel_pool", 1)]
        self.clients = [grpc.aio.insecure_channel(t, options=own) for t in config.targets]
        self.stubs = [pb_grpc.CoordinatorStub(c) for c in self.clients]
        trace = load_trace(TRACE, limit=config.requests)
        ns = Namespace(model="default", tenant="", policy_version=0, page_size=HASH.page_size)
        self.prompt_keys = trace_page_keys(trace, PageHasher(HASH), ns)
        self.workers: list[EmulatedWorker] = []
        self.batches = [0 for _ in config.targets]  # sent, by the replica owning the stream
        self.key_ops = [0 for _ in config.targets]
        self.lags: dict[str, list[float]] = {"owner": [], "other": []}
        self.route_ms: list[float] = []
        self.route_errors = 0
        self.probe_lookups = 0
        self.censored = {"owner": 0, "other": 0}
        self.idle_share = [0.0 for _ in config.targets]
        self._probes: set[asyncio.Task[None]] = set()

    async def start_workers(self) -> None:
        rng = random.Random(7)
        for i in range(self.config.workers):
            replica = i % len(self.config.targets)
            sync = ScriptedWorker(self.config.targets[replica], f"fleet-{i:04d}",
                                  hash_config=HASH, total_pages=self.config.capacity)
            sync._channel = self.channels[replica]  # streams share one connection per replica
            await sync.register()
            if sync.sync_port:  # and one per sync frontend
                if sync.sync_port not in self.sync_channels:
                    self.sync_channels[sync.sync_port] = grpc.aio.insecure_channel(
                        on_port(self.config.targets[replica], sync.sync_port))
                sync._sync_channel = self.sync_channels[sync.sync_port]
            await sync.connect()
            offset = rng.randrange(len(self.prompt_keys))
            self.workers.append(EmulatedWorker(sync, replica, self.prompt_keys, offset,
                                               self.config))

    # ------------------------------------------------------------------ the floors

    async def floors(self) -> dict[str, float]:
        pid, n = self.config.pids[0], self.config.floor_calls
        health = health_pb2_grpc.HealthStub(self.channels[0])
        before = cpu_seconds(pid)
        for _ in range(n):
            await health.Check(health_pb2.HealthCheckRequest())
        unary = (cpu_seconds(pid) - before) / n
        probe = self.workers[0].sync
        before = cpu_seconds(pid)
        for _ in range(n):
            await probe.heartbeat()
        # One acked batch after them: the coordinator has read every heartbeat (one stream).
        await probe.store([os.urandom(16)])
        stream = (cpu_seconds(pid) - before) / n
        # What the replicas spend with the fleet connected and silent (reaper, policy reads,
        # replication polls): subtracted from the windows' CPU for the marginal figures.
        before_idle = [cpu_seconds(p) for p in self.config.pids]
        await asyncio.sleep(1.0)
        self.idle_share = [cpu_seconds(p) - b
                           for p, b in zip(self.config.pids, before_idle, strict=True)]
        return {"unary_cpu_us": unary * 1e6, "stream_message_cpu_us": stream * 1e6,
                "idle_cpu_share": self.idle_share[0]}

    # ------------------------------------------------------------------ routes

    async def routes_elsewhere(self, seconds: float) -> None:
        """Routes at ``routes_per_s`` from a scheduler process of its own (bench/fleet_routes.py:
        this process's loop is busy with the fleet, and would add its own delay)."""
        scheduler = await child_process.start_async(
            [sys.executable, "-m", "bench.fleet_routes", self.config.targets[0],
             str(self.config.routes_per_s), str(seconds), str(self.config.requests)],
            stdout=asyncio.subprocess.PIPE)
        out, _ = await scheduler.communicate()
        answer = json.loads(out.decode().splitlines()[-1])
        self.route_ms.extend(answer["ms"])
        self.route_errors += answer["errors"]

    # ------------------------------------------------------------------ ingest

    async def ingest(self, seconds: float) -> None:
        await asyncio.gather(*(self._run_worker(w, i, seconds)
                               for i, w in enumerate(self.workers)))
        if self._probes:
            await asyncio.wait(self._probes, timeout=5)

    async def _run_worker(self, worker: EmulatedWorker, i: int, seconds: float) -> None:
        period = 1.0 / self.config.steps_per_s
        start = time.monotonic() + period * (i / max(1, len(self.workers)))  # staggered
        next_beat = start + self.config.heartbeat_s * random.random()
        probe_every = max(1, int(len(self.workers) * self.config.steps_per_s / 20))  # ~20/s
        step = 0
        while True:
            now = time.monotonic()
            due = start + step * period
            if due - start >= seconds:
                return
            if due > now:
                await asyncio.sleep(due - now)
            events, last, ops = worker.next_batch()
            await worker.sync.send_events(events)
            self.batches[worker.replica] += 1
            self.key_ops[worker.replica] += ops
            if (sum(self.batches) % probe_every) == 0 and last is not None:
                task = asyncio.create_task(self._probe(last, worker.replica,
                                                       time.perf_counter()))
                self._probes.add(task)
                task.add_done_callback(self._probes.discard)
            while not worker.sync.received.empty():  # acks: nothing to wait for
                worker.sync.received.get_nowait()
            if time.monotonic() >= next_beat:
                await worker.sync.heartbeat()
                next_beat += self.config.heartbeat_s
            step += 1

    async def _probe(self, key: bytes, owner: int, sent: float) -> None:
        """Event-to-visible lag of ``key``: from its batch's send until a ``Lookup`` (every
        5 ms) sees it, on the replica that owns the worker's stream and on the others."""
        request = pb.LookupRequest(prompt=pb.Prompt(page_keys=key))

        async def seen(replica: int) -> None:
            side = "owner" if replica == owner else "other"
            lags = self.lags[side]
            deadline = sent + PROBE_DEADLINE_S
            while time.perf_counter() < deadline:
                self.probe_lookups += 1
                try:
                    found = await self.stubs[replica].Lookup(request, timeout=2)
                except grpc.aio.AioRpcError:
                    found = None
                if found is not None and found.matches:
                    lags.append((time.perf_counter() - sent) * 1000)
                    return
                await asyncio.sleep(POLL_S)
            lags.append(PROBE_DEADLINE_S * 1000)
            self.censored[side] += 1

        await asyncio.gather(*(seen(r) for r in range(len(self.stubs))))

    async def index_keys(self) -> list[int]:
        return [(await s.GetStats(pb.GetStatsRequest())).index_keys for s in self.stubs]

    async def close(self) -> None:
        """Every worker's stream closed, then the shared channels."""
        for worker in self.workers:
            await worker.sync.disconnect()  # the channels are shared: closed below
        for channel in [*self.channels, *self.clients, *self.sync_channels.values()]:
            await channel.close()


async def quiesce(pid: int, timeout_s: float = 60.0) -> None:
    """Wait until ``pid`` uses under a fifth of a core over half a second (or the timeout)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = cpu_seconds(pid)
        await asyncio.sleep(0.5)
        if cpu_seconds(pid) - before < 0.1:
            return


async def _window(fleet: Fleet, config: Config, *, with_routes: bool) -> dict[str, Any]:
    """``config.seconds`` of the fleet's page traffic (and routes, ``with_routes``)."""
    fleet.batches, fleet.key_ops = [0] * len(config.targets), [0] * len(config.targets)
    fleet.route_errors = fleet.probe_lookups = 0
    fleet.route_ms.clear()
    for lags in fleet.lags.values():
        lags.clear()
    fleet.censored = {"owner": 0, "other": 0}
    cpu_before = [cpu_seconds(p) for p in config.pids]
    frontends_before = [cpu_seconds(p) for p in config.frontend_pids]
    own_before = resource.getrusage(resource.RUSAGE_SELF)
    began = time.monotonic()
    jobs = [fleet.ingest(config.seconds)]
    if with_routes:
        jobs.append(fleet.routes_elsewhere(config.seconds))
    await asyncio.gather(*jobs)
    elapsed = time.monotonic() - began
    own_after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = [cpu_seconds(p) - b for p, b in zip(config.pids, cpu_before, strict=True)]
    frontends = [cpu_seconds(p) - b
                 for p, b in zip(config.frontend_pids, frontends_before, strict=True)]
    marginal = [max(0.0, c - idle * elapsed) for c, idle in zip(cpu, fleet.idle_share,
                                                                 strict=True)]
    own = (own_after.ru_utime + own_after.ru_stime) - (own_before.ru_utime + own_before.ru_stime)
    batches, key_ops = sum(fleet.batches), sum(fleet.key_ops)
    # What each replica applied: its own workers' batches with shards, else every batch.
    applied = fleet.batches if config.sharded else [batches for _ in cpu]
    applied_ops = fleet.key_ops if config.sharded else [key_ops for _ in cpu]
    return {
        "seconds": elapsed, "batches": batches, "key_ops": key_ops,
        "batches_target": config.workers * config.steps_per_s * config.seconds,
        "generator_cpu_share": own / elapsed,
        "coordinator_cpu_share": [c / elapsed for c in cpu],
        "batches_applied": applied,
        # Per replica, over the batches it applied.
        "cpu_us_per_batch": [c / max(1, a) * 1e6 for c, a in zip(cpu, applied, strict=True)],
        "cpu_us_per_key_op": [c / max(1, a) * 1e6
                              for c, a in zip(cpu, applied_ops, strict=True)],
        # Less the idle baseline; still holding heartbeats, acks and the lag probes' Lookups.
        "marginal_cpu_us_per_batch": [c / max(1, a) * 1e6
                                      for c, a in zip(marginal, applied, strict=True)],
        # Replica 0's sync frontends, each (empty without them): the ingest moved out of it.
        "frontend_cpu_share": [c / elapsed for c in frontends],
        "frontend_cpu_us_per_batch": sum(frontends) / max(1, batches) * 1e6,
        "probe_lookups": fleet.probe_lookups,
        "routes": len(fleet.route_ms), "route_errors": fleet.route_errors,
        "route_p50_ms": quantile(fleet.route_ms, 0.5),
        "route_p99_ms": quantile(fleet.route_ms, 0.99),
        **{f"lag_{side}_{name}_ms": quantile(lags, q) for side, lags in fleet.lags.items()
           for name, q in (("p50", 0.5), ("p99", 0.99))},
        "lag_samples": {side: len(lags) for side, lags in fleet.lags.items()},
        "lag_censored_at_5s": dict(fleet.censored),
    }


async def run(config: Config) -> dict[str, Any]:
    fleet = Fleet(config)
    rss_before = [rss_bytes(p) for p in config.pids]
    await fleet.start_workers()
    out: dict[str, Any] = {"workers": config.workers, "replicas": len(config.targets)}
    out["floors"] = await fleet.floors()

    # Ingest alone (CPU per batch and key, lag), then ingest with routes (their latency).
    out["ingest"] = await _window(fleet, config, with_routes=False)
    out["ingest_and_routes"] = await _window(fleet, config, with_routes=True)

    # Routes alone, over the index the traffic built (trace prompts: partly cached), once the
    # replica (with shards, each: a route asks them all) has worked off its backlog.
    for pid in config.pids if config.sharded else config.pids[:1]:
        await quiesce(pid)
    fleet.route_ms.clear()
    before = [cpu_seconds(p) for p in config.pids]
    await fleet.routes_elsewhere(min(2.0, config.seconds))
    per_route = [(cpu_seconds(p) - b) / max(1, len(fleet.route_ms)) * 1e6
                 for p, b in zip(config.pids, before, strict=True)]
    out["route_alone"] = {  # cpu_us: the routing replica's; the others' (shortlists) beside
        "routes": len(fleet.route_ms), "cpu_us": per_route[0],
        "cpu_us_other_replicas": sum(per_route[1:]),
        "p50_ms": quantile(fleet.route_ms, 0.5), "p99_ms": quantile(fleet.route_ms, 0.99)}
    keys = await fleet.index_keys()
    rss = [rss_bytes(p) - b for p, b in zip(config.pids, rss_before, strict=True)]
    out["memory"] = {"index_keys": keys,
                     "rss_bytes_per_key": [r / k if k else None
                                           for r, k in zip(rss, keys, strict=True)]}
    await fleet.close()
    return out


def main() -> None:
    config = Config(**json.loads(sys.argv[1]))
    print(json.dumps(asyncio.run(run(config))))


if __name__ == "__main__":
    main()
