"""``kvcoord bench fleet``'s ``shard_decisions`` case (issue 29): do two shards decide every
route as one coordinator holding every worker does, and what does the peer hop cost?

The contract measured, on real ``kvcoord coordinator`` processes:

1. (a) one coordinator on the embedded store with N workers; (b) shards a and b on one
   redis-server (AOF ``everysec``), one replica each, naming each other with
   ``--peer-shards``, worker i streaming to shard ``"ab"[i % 2]``'s replica only (N/2 each).
2. Both get the same page events: bench/fleet_load.py's emulated workers (the same ids, the
   same trace offsets), ``BATCHES`` batches each, sent before any route; routing starts only
   once each worker's last key is visible through the routing replica (a ``Lookup``; through
   shard a's replica it spans both shards).
3. The same fixed sequence of trace prompts, sequentially, through (a) and through shard a's
   replica of (b) only (its rng draws every tie, as (a)'s does): single ``Route`` calls and,
   every ``GROUP_EVERY``-th call, a ``RouteBatch`` of ``GROUP`` GRPO siblings. Both sides run
   with the same ``KVCOORD_ROUTING_SEED`` and knobs that keep costs off the clock (leases and
   pending entries outlive the run; a prefill backlog that never drains).

Reported: the decisions (chosen worker ids, in order) compared, identical count and fraction,
the first differing index; per-call latency p50/p99 of each side (sequential calls: (b)'s
includes the peer hop) and each coordinator process's CPU per route (from /proc). An identical
fraction under 1.0 is a broken invariant (bench/invariants.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from bench.fleet_coordinators import coordinator_processes
from bench.fleet_load import (
    ROUTE_TOKENS,
    TRACE,
    Config,
    EmulatedWorker,
    Fleet,
    cpu_seconds,
    quantile,
)
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from kvcoord.simulate.trace import load_trace, prompt_bytes

BATCHES = 4
"""Event batches each worker sends (64 keys each: bench/fleet_load.py's step)."""
GROUP, GROUP_EVERY = 4, 8
STILL = {"KVCOORD_LEASE_MS": "600000", "KVCOORD_PENDING_TTL_MS": "600000",
         "KVCOORD_PREFILL_TOKENS_PER_S": "1e-6", "KVCOORD_ROUTING_SEED": "29"}
"""Decisions must not move with the clock: nothing expires during the run, and a prefill
backlog drains too slowly to reorder two costs (ties stay ties)."""
VISIBLE_TIMEOUT_S = 60.0


def route_calls(routes: int, prompts: list[bytes]) -> list[list[bytes]]:
    """The fixed sequence: each call's prompts (one: ``Route``; ``GROUP`` copies of one:
    ``RouteBatch``), ``routes`` prompts in all, the trace's prompts in order and again."""
    calls: list[list[bytes]] = []
    total = 0
    while total < routes:
        prompt = prompts[len(calls) % len(prompts)]
        size = min(GROUP, routes - total) if len(calls) % GROUP_EVERY == GROUP_EVERY - 1 else 1
        calls.append([prompt] * size)
        total += size
    return calls


async def _visible(stub: pb_grpc.CoordinatorStub, worker: EmulatedWorker, key: bytes) -> None:
    """Until a ``Lookup`` of ``key`` through ``stub`` lists ``worker`` (its stream applies in
    order: every earlier batch is in too)."""
    request = pb.LookupRequest(prompt=pb.Prompt(page_keys=key))
    deadline = time.monotonic() + VISIBLE_TIMEOUT_S
    while time.monotonic() < deadline:
        found = await stub.Lookup(request, timeout=5)
        if any(m.worker_id == worker.sync.worker_id for m in found.matches):
            return
        await asyncio.sleep(0.01)
    raise RuntimeError(f"{worker.sync.worker_id}'s last key not visible after "
                       f"{VISIBLE_TIMEOUT_S:.0f} s")


async def _feed(fleet: Fleet) -> None:
    """``BATCHES`` batches from every worker, then each worker's last key seen through the
    routing replica (the first target)."""
    last: list[tuple[EmulatedWorker, bytes]] = []
    for worker in fleet.workers:
        key = None
        for _ in range(BATCHES):
            events, last_key, _ = worker.next_batch()
            await worker.sync.send_events(events)
            key = last_key or key
        if key is not None:
            last.append((worker, key))
    for worker, key in last:
        await _visible(fleet.stubs[0], worker, key)


async def _route(stub: pb_grpc.CoordinatorStub, pids: list[int], calls: list[list[bytes]]
                 ) -> tuple[list[str], dict[str, Any]]:
    """(the chosen worker ids in order, the measures) of ``calls`` sent one after another."""
    chosen: list[str] = []
    ms: dict[str, list[float]] = {"route": [], "route_batch": []}
    hits = 0
    before = [cpu_seconds(p) for p in pids]
    for prompts in calls:
        began = time.perf_counter()
        if len(prompts) == 1:
            answers = [await stub.Route(
                pb.RouteRequest(prompt=pb.Prompt(token_bytes=prompts[0])), timeout=10)]
        else:
            answers = list((await stub.RouteBatch(pb.RouteBatchRequest(
                prompts=[pb.Prompt(token_bytes=p) for p in prompts]), timeout=10)).routes)
        ms["route" if len(prompts) == 1 else "route_batch"].append(
            (time.perf_counter() - began) * 1000)
        chosen += [a.worker_id for a in answers]
        hits += sum(a.matched_pages > 0 for a in answers)
    cpu = [cpu_seconds(p) - b for p, b in zip(pids, before, strict=True)]
    measures: dict[str, Any] = {
        "routes_with_a_hit": hits,
        "workers_chosen": len(set(chosen)),
        **{f"{kind}_{name}_ms": quantile(samples, q) for kind, samples in ms.items()
           for name, q in (("p50", 0.5), ("p99", 0.99))},
        "cpu_us_per_route": {f"r{i}": c / max(1, len(chosen)) * 1e6 for i, c in enumerate(cpu)},
    }
    return chosen, measures


async def _decide(targets: list[str], pids: list[int], workers: int, requests: int,
                  calls: list[list[bytes]]) -> tuple[list[str], dict[str, Any]]:
    """The fleet (pages from the trace's first ``requests``) fed through ``targets`` (worker
    i to target i % len), then ``calls`` routed through the first."""
    fleet = Fleet(Config(targets=targets, pids=pids, workers=workers, seconds=0.0,
                         requests=requests))
    try:
        await fleet.start_workers()
        await _feed(fleet)
        return await _route(fleet.stubs[0], pids, calls)
    except grpc.aio.AioRpcError as exc:
        raise RuntimeError(f"a call through {targets[0]} failed: {exc.code().name} "
                           f"{exc.details()}") from exc
    finally:
        await fleet.close()


def shard_decisions_case(workers: int, routes: int) -> dict[str, Any]:
    """(a) and (b) of the module's contract on ``workers`` workers and ``routes`` routes."""
    # The workers' pages and the routed prompts from the same requests of the trace (as many
    # as routes, up to its 300): a small run still meets cached prefixes.
    requests = min(300, routes)
    prompts = [prompt_bytes(r)[: ROUTE_TOKENS * 4] for r in load_trace(TRACE, limit=requests)]
    calls = route_calls(routes, prompts)
    with coordinator_processes(1, None, env=STILL) as (targets, pids, _):
        one, one_measures = asyncio.run(_decide(targets, pids, workers, requests, calls))
    with coordinator_processes(2, "everysec", shards=True, env=STILL) as (targets, pids, _):
        sharded, shard_measures = asyncio.run(_decide(targets, pids, workers, requests, calls))
    differing = [i for i, (a, b) in enumerate(zip(one, sharded, strict=True)) if a != b]
    first = differing[0] if differing else None
    return {
        "workers": workers, "routes": len(one), "calls": len(calls),
        "route_batches": sum(len(c) > 1 for c in calls), "siblings_per_batch": GROUP,
        "routes_through": "shard a's replica (r0) of the two shards",
        "identical": len(one) - len(differing),
        "identical_fraction": (len(one) - len(differing)) / max(1, len(one)),
        "first_difference": first,
        "first_difference_workers": None if first is None else f"{one[first]} / {sharded[first]}",
        "one_coordinator": one_measures,
        "two_shards": shard_measures,
    }
