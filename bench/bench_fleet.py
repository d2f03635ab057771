"""``kvcoord bench fleet``: how many workers one coordinator replica indexes at an engine's
cadence, measured from outside.

Each case starts the coordinator replicas as ``kvcoord coordinator`` processes (one on the
embedded store, or two on a redis-server with AOF ``everysec`` or ``always``) and the load
generator (bench/fleet_load.py: emulated workers replaying the committed trace slice, a
scheduler routing at a set rate) as another process. With ``taskset`` and two or more cores the
coordinators are pinned to core 0 (every thread, ``taskset -a``) and the generator to core 1,
so the generator's work neither slows the coordinator nor enters its CPU figures (read per
process from /proc); the generator reports the batch rate it achieved and its own CPU share, so
a run where the machine, not the coordinator, saturated first says so.

Per case: the same-run floors (a bare unary call, a bare stream message), CPU per ``Route``
alone, then under ingest CPU per event batch and per key operation, event-to-visible lag p50/p99
on the owning and on the other replica, ``Route`` latency p50/p99, RSS per index key. The sweep
reports the largest worker count whose lag p99 stayed under 300 ms and "workers per
replica-core": workers / (the coordinator's CPU cores busy), at that cadence.

``shards_2_N`` runs two shards (issue 29) on one redis-server, one replica each, each naming
the other with ``--peer-shards``: worker i streams to shard ``"ab"[i % 2]``'s replica only,
routes enter through shard a's (it asks shard b for its shortlist), and each replica's CPU per
batch is over its own shard's batches. ``shared_routes`` (bench/fleet_shared_routes.py) asks
whether two replicas route as one, ``shard_decisions`` (bench/fleet_shard_decisions.py)
whether two shards decide as one coordinator.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from bench.fleet_coordinators import (
    COORDINATOR_CORE,
    GENERATOR_CORE,
    coordinator_processes,
    pinning,
    shard_name,
)
from bench.fleet_shard_decisions import shard_decisions_case
from bench.fleet_shared_routes import shared_routes_case
from coordinator.core.index.holdings import compiled_available
from kvcoord import child_process

LAG_BOUND_MS = 300.0
OTHER_LAG = {"replicas": "replicated to the other replica (it applies every batch)",
             "shards": "visible through the other shard's replica (its Lookup asks the owner)"}


def run_case(workers: int, *, replicas: int = 1, appendfsync: str | None = None,
             seconds: float = 10.0, ingest_max_share: float | None = None,
             accelerated: bool = True, sync_frontends: int = 0,
             frontend_core: str = COORDINATOR_CORE, shards: bool = False,
             **load: Any) -> dict[str, Any]:
    """One case: the replicas up, the generator run against them, its measures.
    ``accelerated``: the coordinators' index core (compiled where built, else pure Python
    either way; ``index_core`` in the result says which ran); ``sync_frontends``: processes
    reading the workers' streams for each replica, on ``frontend_core``; ``shards``: each
    replica its own shard's (worker i on replica i % ``replicas``, as the generator assigns)."""
    with coordinator_processes(replicas, appendfsync, ingest_max_share, accelerated,
                               sync_frontends, frontend_core, shards=shards,
                               ) as (targets, pids, frontend_pids):
        config = {"targets": targets, "pids": pids, "workers": workers, "seconds": seconds,
                  "frontend_pids": frontend_pids, "sharded": shards, **load}
        argv = [sys.executable, "-m", "bench.fleet_load", json.dumps(config)]
        if pinning():
            argv = ["taskset", "-c", GENERATOR_CORE, *argv]
        done = child_process.run(argv, capture_output=True, text=True, timeout=600,
                              stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise RuntimeError(f"the fleet load generator failed: {done.stderr[-6000:]}")
        result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    result["store"] = "embedded" if replicas == 1 else f"redis aof {appendfsync or 'off'}"
    result["ingest_max_share"] = "default" if ingest_max_share is None else ingest_max_share
    result["pinned"] = pinning()
    result["index_core"] = "compiled" if accelerated and compiled_available() else "pure"
    result["sync_frontends"] = sync_frontends
    result["frontend_core"] = frontend_core if sync_frontends and pinning() else None
    result["shards"] = [shard_name(i) for i in range(replicas)] if shards else None
    result["routes_through"] = f"r0{' (shard a)' if shards else ''}, every route"
    if replicas > 1:
        result["lag_other_means"] = OTHER_LAG["shards" if shards else "replicas"]
    for window in ("ingest", "ingest_and_routes"):
        measured = result[window]
        busy = measured["coordinator_cpu_share"][0]
        measured["workers_per_replica_core"] = workers / busy if busy > 0 else None
        measured["achieved_fraction"] = measured["batches"] / measured["batches_target"]
    for section in ("ingest", "ingest_and_routes", "memory"):
        for key, value in list(result[section].items()):  # per replica, as r0, r1
            if isinstance(value, list) and not key.startswith("frontend"):
                result[section][key] = {f"r{i}": v for i, v in enumerate(value)}
    return result


def fleet_steps(quick: bool) -> list[tuple[str, Any]]:
    """``kvcoord bench fleet``'s steps: 1 replica at each N, then 2 replicas on Redis."""
    sizes = [16] if quick else [64, 256, 1024]
    seconds = 2.0 if quick else 10.0
    load: dict[str, Any] = {"requests": 40, "floor_calls": 300} if quick else {}
    steps: list[tuple[str, Any]] = [
        (f"1r_{n}", lambda n=n: run_case(n, seconds=seconds, **load)) for n in sizes]
    if not quick:  # the largest fleet again with ingest unbounded (no budget): what it buys
        steps.append((f"unbounded_1r_{sizes[-1]}", lambda: run_case(
            sizes[-1], seconds=seconds, ingest_max_share=1.0, **load)))
    # Ingest split off: one sync frontend process reads the streams, on the replica's own core
    # (routes first by CPU priority, same core budget) and on the generator's core (a second
    # core for ingest, shared with the generator here).
    big = sizes[-1]
    steps.append((f"frontend_same_core_1r_{big}", lambda: run_case(
        big, seconds=seconds, sync_frontends=1, frontend_core=COORDINATOR_CORE, **load)))
    if not quick:
        steps.append((f"frontend_other_core_1r_{big}", lambda: run_case(
            big, seconds=seconds, sync_frontends=1, frontend_core=GENERATOR_CORE, **load)))
    # The pure-Python index core beside the compiled one (where no compiler exists).
    steps += [(f"pure_1r_{n}", lambda n=n: run_case(n, seconds=seconds, accelerated=False,
                                                    **load))
              for n in (sizes if quick else sizes[1:])]
    for fsync in ["everysec"] if quick else ["everysec", "always"]:
        steps += [(f"2r_{fsync}_{n}", lambda n=n, fsync=fsync: run_case(
            n, replicas=2, appendfsync=fsync, seconds=seconds, **load))
            for n in (sizes[:1] if quick else sizes[:2])]
    # Two shards, one replica each, on one redis-server: each ingests half the fleet (and,
    # full size, at 256 workers too, where one core holds both beside the routes).
    steps += [(f"shards_2_{n}", lambda n=n: run_case(
        n, replicas=2, appendfsync="everysec", shards=True, seconds=seconds, **load))
        for n in ([big] if quick else [sizes[1], big])]
    shared = {"groups": 2, "pairs": 10, "burst": 64} if quick else {}
    steps.append(("shared_routes", lambda: shared_routes_case(**shared)))
    steps.append(("shard_decisions", lambda: shard_decisions_case(
        16 if quick else 1024, routes=40 if quick else 500)))
    return steps


def largest_n_under_bound(results: dict[str, Any]) -> int | None:
    """The most workers one replica carried with owner lag p99 under ``LAG_BOUND_MS``."""
    under = [c["workers"] for k, c in results.items() if k.startswith("1r_")
             and (c["ingest_and_routes"]["lag_owner_p99_ms"] or 1e9) < LAG_BOUND_MS]
    return max(under, default=None)
