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
replica-core": workers / (the coordinator's CPU cores busy), at that cadence. The last case,
``shared_routes`` (bench/fleet_shared_routes.py), asks whether two replicas route as one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from bench.fleet_shared_routes import shared_routes_case
from coordinator.core.accel import NO_ACCEL_VARIABLE
from coordinator.core.index.holdings import compiled_available
from kvcoord.fleet_procs import free_port, start_coordinator_process, stop_processes, wait_healthy
from tests.redis_server import RedisServer

LAG_BOUND_MS = 300.0
COORDINATOR_CORE, GENERATOR_CORE = "0", "1"


def _pinning() -> bool:
    return shutil.which("taskset") is not None and (os.cpu_count() or 1) >= 2


def child_pids(pid: int) -> list[int]:
    """The processes ``pid`` started (its sync frontends), from /proc."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as children:
            return [int(p) for p in children.read().split()]
    except OSError:
        return []


def _pin(pid: int, core: str) -> None:
    subprocess.run(["taskset", "-a", "-p", "-c", core, str(pid)], check=True,
                   stdout=subprocess.DEVNULL)


@contextmanager
def _replicas(count: int, appendfsync: str | None, ingest_max_share: float | None = None,
              accelerated: bool = True, sync_frontends: int = 0,
              frontend_core: str = COORDINATOR_CORE,
              ) -> Iterator[tuple[list[str], list[int], list[int]]]:
    """(targets, pids, the first replica's frontend pids) of ``count`` coordinator processes;
    two or more share a redis-server with AOF ``appendfsync``. ``ingest_max_share``: their
    ingest budget (None: the default); ``accelerated=False``: their index on the pure-Python
    holdings (``KVCOORD_NO_ACCEL=1``); ``sync_frontends``: each replica's sync frontend
    processes, pinned to ``frontend_core``."""
    redis = None
    if count > 1:
        redis = RedisServer(appendonly=appendfsync is not None,
                            appendfsync=appendfsync or "everysec")
        redis.start()
    processes = []
    try:
        targets = []
        for i in range(count):
            port = free_port()
            extra = ["--redis", redis.url, "--replica-id", f"r{i}"] if redis else []
            env = {"KVCOORD_LEASE_MS": "20000"}
            if ingest_max_share is not None:
                env["KVCOORD_INGEST_MAX_SHARE"] = str(ingest_max_share)
            if not accelerated:
                env[NO_ACCEL_VARIABLE] = "1"
            if sync_frontends:
                env["KVCOORD_SYNC_FRONTENDS"] = str(sync_frontends)
            process = start_coordinator_process(port, *extra, env=env)
            processes.append(process)
            wait_healthy(f"127.0.0.1:{port}", process, timeout=60)
            targets.append(f"127.0.0.1:{port}")
        frontends = child_pids(processes[0].pid)
        if len(frontends) != sync_frontends:
            raise RuntimeError(f"expected {sync_frontends} sync frontends, found {frontends}")
        if _pinning():
            for process in processes:
                _pin(process.pid, COORDINATOR_CORE)
            for pid in frontends:
                _pin(pid, frontend_core)
                if frontend_core != COORDINATOR_CORE:
                    # A frontend runs at the lowest priority so that it yields to its replica
                    # on a shared core; here it stands for a core of its own, shared only
                    # because this machine has two, so it competes with the generator as an
                    # equal.
                    subprocess.run(["renice", "-n", "0", "-p", str(pid)], check=True,
                                   stdout=subprocess.DEVNULL)
        yield targets, [p.pid for p in processes], frontends
    finally:
        stop_processes(processes, 10)
        if redis is not None:
            redis.stop()


def run_case(workers: int, *, replicas: int = 1, appendfsync: str | None = None,
             seconds: float = 10.0, ingest_max_share: float | None = None,
             accelerated: bool = True, sync_frontends: int = 0,
             frontend_core: str = COORDINATOR_CORE, **load: Any) -> dict[str, Any]:
    """One case: the replicas up, the generator run against them, its measures.
    ``accelerated``: the coordinators' index core (compiled where built, else pure Python
    either way; ``index_core`` in the result says which ran); ``sync_frontends``: processes
    reading the workers' streams for each replica, on ``frontend_core``."""
    with _replicas(replicas, appendfsync, ingest_max_share, accelerated, sync_frontends,
                   frontend_core) as (targets, pids, frontend_pids):
        config = {"targets": targets, "pids": pids, "workers": workers, "seconds": seconds,
                  "frontend_pids": frontend_pids, **load}
        argv = [sys.executable, "-m", "bench.fleet_load", json.dumps(config)]
        if _pinning():
            argv = ["taskset", "-c", GENERATOR_CORE, *argv]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                              stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise RuntimeError(f"the fleet load generator failed: {done.stderr[-6000:]}")
        result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    result["store"] = "embedded" if replicas == 1 else f"redis aof {appendfsync or 'off'}"
    result["ingest_max_share"] = "default" if ingest_max_share is None else ingest_max_share
    result["pinned"] = _pinning()
    result["index_core"] = "compiled" if accelerated and compiled_available() else "pure"
    result["sync_frontends"] = sync_frontends
    result["frontend_core"] = frontend_core if sync_frontends and _pinning() else None
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
    shared = {"groups": 2, "pairs": 10, "burst": 64} if quick else {}
    steps.append(("shared_routes", lambda: shared_routes_case(**shared)))
    return steps


def largest_n_under_bound(results: dict[str, Any]) -> int | None:
    """The most workers one replica carried with owner lag p99 under ``LAG_BOUND_MS``."""
    under = [c["workers"] for k, c in results.items() if k.startswith("1r_")
             and (c["ingest_and_routes"]["lag_owner_p99_ms"] or 1e9) < LAG_BOUND_MS]
    return max(under, default=None)
