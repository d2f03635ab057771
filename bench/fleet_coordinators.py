"""The coordinator processes of ``kvcoord bench fleet``'s cases: one on the embedded store,
or several on one redis-server (replicas of one index, or each the only replica of its own
shard), each a ``kvcoord coordinator`` process pinned (every thread, ``taskset -a``) to
``COORDINATOR_CORE`` where ``taskset`` and two or more cores allow; the load generator takes
``GENERATOR_CORE``."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

from coordinator.core.accel import NO_ACCEL_VARIABLE
from kvcoord import child_process
from kvcoord.child_process import stop_processes
from kvcoord.fleet_procs import free_port, start_coordinator_process, wait_healthy
from tests.redis_server import RedisServer

COORDINATOR_CORE, GENERATOR_CORE = "0", "1"


def pinning() -> bool:
    """Whether the cases pin their processes (``taskset`` present, two cores or more)."""
    return shutil.which("taskset") is not None and (os.cpu_count() or 1) >= 2


def child_pids(pid: int) -> list[int]:
    """The processes ``pid`` started (its sync frontends), from /proc."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as children:
            return [int(p) for p in children.read().split()]
    except OSError:
        return []


def _pin(pid: int, core: str) -> None:
    child_process.run(["taskset", "-a", "-p", "-c", core, str(pid)], check=True,
                   stdout=subprocess.DEVNULL)


def shard_name(i: int) -> str:
    """Replica i's shard with ``shards``: a, b, ..."""
    return chr(ord("a") + i)


@contextmanager
def coordinator_processes(count: int, appendfsync: str | None,
                          ingest_max_share: float | None = None, accelerated: bool = True,
                          sync_frontends: int = 0, frontend_core: str = COORDINATOR_CORE, *,
                          shards: bool = False, env: dict[str, str] | None = None,
                          ) -> Iterator[tuple[list[str], list[int], list[int]]]:
    """(targets, pids, the first replica's frontend pids) of ``count`` coordinator processes;
    two or more share a redis-server with AOF ``appendfsync``. ``ingest_max_share``: their
    ingest budget (None: the default); ``accelerated=False``: their index on the pure-Python
    holdings (``KVCOORD_NO_ACCEL=1``); ``sync_frontends``: each replica's sync frontend
    processes, pinned to ``frontend_core``; ``shards``: replica i is shard ``shard_name(i)``'s
    only replica (replication off: no replica to share with), naming every other as its
    peer (ports chosen before any starts); ``env``: ``KVCOORD_*`` settings over the bench's."""
    redis = None
    if count > 1:
        redis = RedisServer(appendonly=appendfsync is not None,
                            appendfsync=appendfsync or "everysec")
        redis.start()
    processes = []
    settings = {"KVCOORD_LEASE_MS": "20000"}
    if ingest_max_share is not None:
        settings["KVCOORD_INGEST_MAX_SHARE"] = str(ingest_max_share)
    if not accelerated:
        settings[NO_ACCEL_VARIABLE] = "1"
    if sync_frontends:
        settings["KVCOORD_SYNC_FRONTENDS"] = str(sync_frontends)
    if shards:
        # Each shard's only replica: nothing to replicate to, as the one replica of the 1r
        # cases (a shard's own replicas would add the 2r cases' publishing cost).
        settings["KVCOORD_REPLICATION"] = "false"
    settings.update(env or {})
    targets = [f"127.0.0.1:{free_port()}" for _ in range(count)]
    try:
        for i, target in enumerate(targets):
            extra = ["--redis", redis.url, "--replica-id", f"r{i}"] if redis else []
            if shards:
                extra += ["--shard", shard_name(i), "--peer-shards", ";".join(
                    f"{shard_name(j)}={t}" for j, t in enumerate(targets) if j != i)]
            process = start_coordinator_process(int(target.rsplit(":", 1)[1]), *extra,
                                                env=settings)
            processes.append(process)
            wait_healthy(target, process, timeout=60)
        frontends = child_pids(processes[0].pid)
        if len(frontends) != sync_frontends:
            raise RuntimeError(f"expected {sync_frontends} sync frontends, found {frontends}")
        if pinning():
            for process in processes:
                _pin(process.pid, COORDINATOR_CORE)
            for pid in frontends:
                _pin(pid, frontend_core)
                if frontend_core != COORDINATOR_CORE:
                    # A frontend runs at the lowest priority so that it yields to its replica
                    # on a shared core; here it stands for a core of its own, shared only
                    # because this machine has two, so it competes with the generator as an
                    # equal.
                    child_process.run(["renice", "-n", "0", "-p", str(pid)], check=True,
                                   stdout=subprocess.DEVNULL)
        yield targets, [p.pid for p in processes], frontends
    finally:
        stop_processes(processes, 10)
        if redis is not None:
            redis.stop()
