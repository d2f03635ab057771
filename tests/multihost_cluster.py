"""The multi-host cluster that ``tests/test_multihost.py`` and ``bench/chaos.py`` both run: Redis,
two coordinator replicas and three workers, each in its own network namespace
(``tests/netns.py``) on one bridge. The caller (scheduler, trainer, fault injector) stays in the
root namespace and reaches every host through the bridge.

Hosts: ``db`` (a redis-server on its namespace address, AOF ``appendfsync always``), ``c1`` and
``c2`` (``kvcoord coordinator --redis --replica-id cN``, replicating through Redis), ``w1``..``w3``
(``kvcoord worker --coordinator <both replicas> --listen 0.0.0.0:PORT --advertise <ip>:PORT``).
A worker attaches to its first target and moves to the next one when that one is unreachable;
``WORKER_TARGETS`` orders them so that each replica owns a worker at the start.

``running_cluster`` builds it and tears it down; the functions after it are the observations
both the tests and the chaos bench make (fleet state, holdings per replica, rollout records).
A ``Layout`` changes who runs where: ``SHARDED`` (``tests/test_shards.py``) runs shard ``a``
(replicas ``a1``, ``a2``; workers ``w1``, ``w2``) and shard ``b`` (replica ``b1``; worker
``w3``) on the one Redis, each worker pointed at its own shard's replicas only, and each
replica naming the other shard's as its peers (routes and lookups span the shards).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.exceptions import ConnectionError as RedisConnectionError

from coordinator.client import CoordinatorClient, RolloutRecord, WorkerInfo
from kvcoord import child_process
from kvcoord.demo import wait_healthy
from tests.netns import Host, Network
from worker.client import WorkerClient

PAGE = 4
LEASE_S = 1.5
ENV = {
    "KVCOORD_LEASE_MS": str(int(LEASE_S * 1000)), "KVCOORD_HEARTBEAT_MS": "300",
    "KVCOORD_REAPER_INTERVAL_MS": "100", "KVCOORD_DROP_GRACE_MS": "3000",
    "KVCOORD_BACKOFF_MAX_MS": "300", "KVCOORD_PAGE_SIZE": str(PAGE),
    "KVCOORD_BARRIER_TIMEOUT_MS": "4000", "KVCOORD_ROUTE_WAIT_MS": "1000",
    "KVCOORD_ROUTE_RETRY_MS": "50",
    # Why: torch sizes its thread pool to every core; three workers would spin against each other.
    "OMP_NUM_THREADS": "1",
}
COORDINATOR_PORT, WORKER_PORT, REDIS_PORT = 50051, 50061, 6379  # each host has its own ports
# Room for a chaos round's generations (a few hundred pages) beside the probe prompts, so the
# probe prompts' pages are not evicted before the round checks them.
WORKER_PAGES = 1024
REPLICAS = ("c1", "c2")
WORKERS = ("w1", "w2", "w3")
# A worker attaches to its first target: c1 owns w1 and w3 at the start, c2 owns w2.
WORKER_TARGETS = {"w1": ("c1", "c2"), "w2": ("c2", "c1"), "w3": ("c1", "c2")}
# One prompt per worker, no full page in common: each is cached (and listed) by its own worker.
PROMPTS = {w: [(31 * n + 7 * i + 3) % 500 for i in range(3 * PAGE + 1)]
           for n, w in enumerate(WORKERS)}
WAIT_S = 15.0


@dataclass(frozen=True)
class Layout:
    """Who runs where: the coordinator replicas (in start order), each worker's TARGETS (replica
    names, the first is where it attaches) and each replica's shard (none: unsharded)."""

    replicas: tuple[str, ...] = REPLICAS
    targets: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: WORKER_TARGETS)
    shards: Mapping[str, str] = field(default_factory=dict)

    @property
    def workers(self) -> tuple[str, ...]:
        return tuple(self.targets)

    def peers_of(self, replica: str) -> dict[str, tuple[str, ...]]:
        """The other shards' replicas, by shard (``--peer-shards``; none unsharded)."""
        own = self.shards.get(replica)
        peers: dict[str, tuple[str, ...]] = {}
        for other in self.replicas:
            shard = self.shards.get(other)
            if own and shard and shard != own:
                peers[shard] = (*peers.get(shard, ()), other)
        return peers

    def workers_of(self, replica: str) -> tuple[str, ...]:
        """The workers ``replica`` holds: its shard's (every worker, unsharded)."""
        shard = self.shards.get(replica, "")
        return tuple(w for w, targets in self.targets.items()
                     if self.shards.get(targets[0], "") == shard)


SHARDED = Layout(replicas=("a1", "a2", "b1"),
                 targets={"w1": ("a1", "a2"), "w2": ("a2", "a1"), "w3": ("b1",)},
                 shards={"a1": "a", "a2": "a", "b1": "b"})
# A lapsed lease is seen by the next reaper pass; the rest is scheduling slack on 2 cores.
UNROUTABLE_S = LEASE_S + 1.5
# Replicas answer Lookup identically once this long has passed without a new event (publish,
# XREAD, apply: milliseconds here; the bound is scheduling slack on 2 busy cores).
LAG_BOUND_S = 2.0

Holdings = dict[str, dict[str, int]]
"""Per probe prompt (named by the worker that caches it), Lookup's ``matches``."""


def eventually(condition: Callable[[], bool], what: str, timeout: float = WAIT_S) -> float:
    """Poll ``condition`` (the awaited event happens in another process) within ``timeout``;
    returns the seconds it took."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - start


# ---------------------------------------------------------------------- the hosts


class NamespacedRedis:
    """redis-server on ``host`` (its namespace address), AOF with ``appendfsync always``, so a
    SIGKILL loses nothing acknowledged. ``stop(hard=True)`` then ``start`` is a crash on the
    same data."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.dir = Path(tempfile.mkdtemp(prefix="kvcoord-netns-redis-"))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host.ip}:{REDIS_PORT}/0"

    def start(self) -> None:
        # Why protected-mode off: it accepts only loopback clients without a password, and the
        # coordinators are on other hosts. The bridge is private to this run.
        self.process = self.host.run([
            "redis-server", "--port", str(REDIS_PORT), "--bind", self.host.ip,
            "--protected-mode", "no",
            "--dir", str(self.dir), "--save", "", "--appendonly", "yes",
            "--appendfsync", "always", "--logfile", "redis.log", "--daemonize", "no",
        ])  # fmt: skip
        client = redis.Redis(host=self.host.ip, port=REDIS_PORT, socket_timeout=1.0)
        try:
            def ours() -> bool:  # a stranger on the port cannot pass: the pid must be ours
                if self.process is None or self.process.poll() is not None:
                    raise AssertionError("redis-server exited")
                try:
                    return bool(client.info("server")["process_id"] == self.process.pid)
                except RedisConnectionError:  # not listening yet, or still loading its AOF
                    return False
            eventually(ours, "redis-server to answer")
        finally:
            client.close()

    def stop(self, *, hard: bool) -> None:
        if self.process is not None:
            self.host.kill(self.process, signal.SIGKILL if hard else signal.SIGTERM)
            self.process = None


@dataclass
class Cluster:
    """The running hosts. ``coordinators`` and ``workers`` hold the live processes by name
    (a killed one is removed until it is started again)."""

    net: Network
    redis: NamespacedRedis
    logs: Path
    coordinators: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    workers: dict[str, tuple[Host, subprocess.Popen[bytes]]] = field(default_factory=dict)
    layout: Layout = field(default_factory=Layout)

    def target(self, replica: str) -> str:
        return f"{self.net.hosts[replica].ip}:{COORDINATOR_PORT}"

    def targets(self, replicas: Sequence[str] = ()) -> str:
        """TARGETS for ``replicas`` (default: every replica), in that order (a client starts at
        the first)."""
        return ",".join(self.target(r) for r in replicas or self.layout.replicas)

    @property
    def live_replicas(self) -> tuple[str, ...]:
        return tuple(r for r in self.layout.replicas if r in self.coordinators)

    def client(self, *replicas: str, timeout: float = 10.0) -> CoordinatorClient:
        """A client of ``replicas`` (default: every replica, c1 first), as schedulers and
        trainers use."""
        return CoordinatorClient(self.targets(replicas), timeout=timeout)

    def spawn(self, host: Host, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        """``kvcoord ARGS`` on ``host``, structlog JSON appended to ``logs/<name>.log``."""
        with (self.logs / f"{name}.log").open("ab") as log:
            return host.run([sys.executable, "-m", "kvcoord.cli", *args],
                            env={**os.environ, **ENV}, stderr=log)

    def start_coordinator(self, replica: str) -> None:
        """Replica ``replica`` (its id is its host name) on its host; returns once its health
        answers SERVING, which a replica reports only after its bootstrap."""
        host = self.net.hosts[replica]
        shard = self.layout.shards.get(replica)
        peers = ";".join(f"{name}={self.targets(replicas)}"
                         for name, replicas in self.layout.peers_of(replica).items())
        process = self.spawn(host, replica, [
            "coordinator", "--listen", f"{host.ip}:{COORDINATOR_PORT}",
            "--redis", self.redis.url, "--replica-id", replica, "--log-level", "info",
            *(["--shard", shard] if shard else []),
            *(["--peer-shards", peers] if peers else [])])
        self.coordinators[replica] = process
        wait_healthy(self.target(replica), process)

    def kill_coordinator(self, replica: str) -> None:
        """SIGKILL: no draining, no goodbye in the events stream."""
        self.net.hosts[replica].kill(self.coordinators.pop(replica))

    def start_worker(self, worker_id: str) -> None:
        host = self.net.hosts[worker_id]
        process = self.spawn(host, worker_id, [
            "worker", "--coordinator", self.targets(self.layout.targets[worker_id]),
            "--listen", f"0.0.0.0:{WORKER_PORT}", "--advertise", f"{host.ip}:{WORKER_PORT}",
            "--worker-id", worker_id, "--pages", str(WORKER_PAGES), "--device", "cpu",
            "--log-level", "info"])
        self.workers[worker_id] = (host, process)

    def kill_worker(self, worker_id: str) -> None:
        """SIGKILL: no Deregister, no goodbye."""
        host, process = self.workers.pop(worker_id)
        host.kill(process)

    def address(self, worker_id: str) -> str:
        return f"{self.net.hosts[worker_id].ip}:{WORKER_PORT}"

    def worker(self, worker_id: str) -> WorkerClient:
        return WorkerClient(self.address(worker_id), timeout=10.0)

    def log_tail(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")[-3000:]


@contextlib.contextmanager
def running_cluster(logs: Path, layout: Layout = Layout()) -> Iterator[Cluster]:
    """Redis, the replicas and the workers (by default both replicas and the three workers),
    every worker ready at version 0 on each replica that holds it; everything torn down on exit
    (also on failure half-way)."""
    with Network() as net:
        db = net.add_host("db")
        for name in (*layout.replicas, *layout.workers):
            net.add_host(name)
        cluster = Cluster(net, NamespacedRedis(db), logs, layout=layout)
        try:
            cluster.redis.start()
            for replica in layout.replicas:
                cluster.start_coordinator(replica)
            for worker_id in layout.workers:
                cluster.start_worker(worker_id)
            for replica in layout.replicas:
                workers = layout.workers_of(replica)
                with cluster.client(replica) as client:
                    eventually(lambda: all_ready(client, 0, workers),  # noqa: B023 (called here)
                               f"{workers} ready at version 0 on {replica}", timeout=60.0)
            yield cluster
        finally:
            net.close()  # before the Redis data dir goes: redis-server is one of its processes
            child_process.run(["rm", "-rf", str(cluster.redis.dir)], check=False)


# ---------------------------------------------------------------------- observations


def infos(client: CoordinatorClient) -> dict[str, WorkerInfo]:
    return {w.worker_id: w for w in client.workers()}


def all_ready(client: CoordinatorClient, version: int,
              workers: Sequence[str] = WORKERS) -> bool:
    """``client``'s replica lists exactly ``workers``, each ready at ``version``."""
    states = {w: (i.policy_version, i.state) for w, i in infos(client).items()}
    return states == {w: (version, "ready") for w in workers}


def owners(client: CoordinatorClient) -> dict[str, str]:
    """Worker id -> the replica holding its Sync stream, as ``client``'s replica sees it."""
    return {w: i.owner_replica for w, i in infos(client).items()}


def holdings(client: CoordinatorClient) -> Holdings:
    """Lookup's answer for every probe prompt."""
    return {w: client.lookup(prompt).matches for w, prompt in PROMPTS.items()}


def replica_holdings(cluster: Cluster, replicas: Sequence[str]) -> dict[str, Holdings]:
    answers = {}
    for replica in replicas:
        with cluster.client(replica, timeout=2.0) as client:
            answers[replica] = holdings(client)
    return answers


def replicas_agree(cluster: Cluster, replicas: Sequence[str] | None = None,
                   within: float = LAG_BOUND_S) -> Holdings:
    """Poll every live replica (or ``replicas``) with the same Lookups until their answers are
    equal, at most ``within`` seconds; returns the common answer. AssertionError showing every
    replica's answer when they still differ."""
    replicas = replicas or cluster.live_replicas
    deadline = time.monotonic() + within
    while True:
        answers = replica_holdings(cluster, replicas)
        distinct = list({repr(a): a for a in answers.values()}.values())
        if len(distinct) == 1:
            return distinct[0]
        if time.monotonic() >= deadline:
            raise AssertionError(f"replicas still disagree after {within}s: {answers}")
        time.sleep(0.05)


def serve_and_index(cluster: Cluster, client: CoordinatorClient, worker_id: str) -> None:
    """``worker_id`` generates its prompt twice (the second from cache, two rollout records)
    and ``client``'s Lookup lists it with the prompt's three full pages."""
    with cluster.worker(worker_id) as worker:
        worker.generate(PROMPTS[worker_id], 2)
        again = worker.generate(PROMPTS[worker_id], 2)
    if again.cached_tokens != 3 * PAGE:
        raise AssertionError(f"{worker_id} served {again.cached_tokens} tokens from cache, "
                             f"expected {3 * PAGE}")
    eventually(lambda: client.lookup(PROMPTS[worker_id]).matches.get(worker_id) == 3 * PAGE,
               f"Lookup to list {worker_id} with its prompt's pages")


def serve(cluster: Cluster, client: CoordinatorClient,
          *worker_ids: str) -> tuple[Holdings, dict[str, RolloutRecord]]:
    """Each of ``worker_ids`` serves its prompt (``serve_and_index``); returns the holdings every
    live replica agrees on, and the rollout records once the two per worker are in too."""
    served = len(rollouts(client)) + 2 * len(worker_ids)
    for worker_id in worker_ids:
        serve_and_index(cluster, client, worker_id)
    agreed = replicas_agree(cluster)
    eventually(lambda: len(rollouts(client)) >= served, f"{served} rollout records")
    return agreed, rollouts(client)


def rollouts(client: CoordinatorClient) -> dict[str, RolloutRecord]:
    """Every kept rollout record by id, its cursor blanked (a cursor says where, not what).
    Delivery is at least once: a report whose answer was lost (Redis killed between the write
    and the reply, a replica killed before it answered) is sent again, so an id may repeat,
    but only with the same content (AssertionError otherwise)."""
    records: dict[str, RolloutRecord] = {}
    for record in client.rollouts():
        record = dataclasses.replace(record, cursor="")
        kept = records.setdefault(record.rollout_id, record)
        if kept != record:
            raise AssertionError(f"rollout {record.rollout_id} changed: {kept} then {record}")
    return records


def reported(client: CoordinatorClient, served: int) -> dict[str, RolloutRecord]:
    """The rollout records, once at least ``served`` are in (workers report every ~100 ms)."""
    eventually(lambda: len(rollouts(client)) >= served, f"{served} rollout records")
    return rollouts(client)


def routes_to(client: CoordinatorClient, prompt: list[int], n: int = 9) -> set[str]:
    return {client.route(prompt, routing_policy="round_robin").worker_id for _ in range(n)}


def unroutable(client: CoordinatorClient, worker_id: str) -> bool:
    """No route to ``worker_id`` (round robin over the fleet) and no Lookup listing it."""
    return (worker_id not in client.lookup(PROMPTS[worker_id]).matches
            and worker_id not in routes_to(client, PROMPTS[worker_id]))
