"""Faults across hosts: Redis, a coordinator and three workers, each in its own network namespace
(``tests/netns.py``), talking over a bridge; the test acts as scheduler and trainer from the root
namespace through the SDK.

Hosts: ``db`` (a test-owned redis-server on its namespace address, AOF ``appendfsync always``),
``c1`` (``kvcoord coordinator --redis``), ``w1``..``w3`` (``kvcoord worker --listen 0.0.0.0:PORT
--advertise <host ip>:PORT``). One coordinator only: replicas (a second one on ``c2``) come with
the replication work.

Each fault is followed by its checks:

- (a) ``kill -9`` a worker: no route to it and no Lookup listing once its lease has run out;
- (b) cut a worker's link past its lease: no route to it; healed, it rejoins with a new
  incarnation and serves again;
- (c) a hard Redis restart: Lookup answers all along, the policy version is intact after, and
  policy changes work again;
- (d) a worker partitioned for the whole of a sync policy update: fenced while the others
  commit; healed, it rejoins at the new version;
- (c') Redis's host cut off (no answer at all, not a refusal): Lookup keeps listing the fleet
  (store calls time out within a third of the lease, so no lease lapses).

After every fault, every rollout record reported before it is still there, unchanged.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError

from coordinator.client import CoordinatorClient, KvcoordError, RolloutRecord, WorkerInfo
from kvcoord.demo import wait_healthy
from tests.conftest import skip_without_redis
from tests.netns import Host, Network
from worker.client import WorkerClient

pytestmark = [pytest.mark.slow, pytest.mark.redis]

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
WORKERS = ("w1", "w2", "w3")
# One prompt per worker, no full page in common: each is cached (and listed) by its own worker.
PROMPTS = {w: [(31 * n + 7 * i + 3) % 500 for i in range(3 * PAGE + 1)]
           for n, w in enumerate(WORKERS)}
WAIT_S = 15.0
# A lapsed lease is seen by the next reaper pass; the rest is scheduling slack on 2 cores.
UNROUTABLE_S = LEASE_S + 1.5


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
    SIGKILL loses nothing acknowledged. ``restart(hard=True)`` is a crash on the same data."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.dir = Path(tempfile.mkdtemp(prefix="kvcoord-netns-redis-"))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host.ip}:{REDIS_PORT}/0"

    def start(self) -> None:
        # Why protected-mode off: it accepts only loopback clients without a password, and the
        # coordinator is on another host. The bridge is private to this test run.
        self.process = self.host.run([
            "redis-server", "--port", str(REDIS_PORT), "--bind", self.host.ip,
            "--protected-mode", "no",
            "--dir", str(self.dir), "--save", "", "--appendonly", "yes",
            "--appendfsync", "always", "--logfile", "redis.log", "--daemonize", "no",
        ])  # fmt: skip
        client = redis.Redis(host=self.host.ip, port=REDIS_PORT, socket_timeout=1.0)
        try:
            def ours() -> bool:  # a stranger on the port cannot pass: the pid must be ours
                assert self.process is not None and self.process.poll() is None, "redis exited"
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
    net: Network
    redis: NamespacedRedis
    coordinator: Host
    logs: Path
    workers: dict[str, tuple[Host, subprocess.Popen[bytes]]] = field(default_factory=dict)

    @property
    def target(self) -> str:
        return f"{self.coordinator.ip}:{COORDINATOR_PORT}"

    def spawn(self, host: Host, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        """``kvcoord ARGS`` on ``host``, structlog JSON appended to ``logs/<name>.log``."""
        with (self.logs / f"{name}.log").open("ab") as log:
            return host.run([sys.executable, "-m", "kvcoord.cli", *args],
                            env={**os.environ, **ENV}, stderr=log)

    def start_worker(self, worker_id: str) -> None:
        host = self.net.hosts[worker_id]
        process = self.spawn(host, worker_id, [
            "worker", "--coordinator", self.target, "--listen", f"0.0.0.0:{WORKER_PORT}",
            "--advertise", f"{host.ip}:{WORKER_PORT}", "--worker-id", worker_id,
            "--pages", "64", "--device", "cpu", "--log-level", "info"])
        self.workers[worker_id] = (host, process)

    def address(self, worker_id: str) -> str:
        return f"{self.workers[worker_id][0].ip}:{WORKER_PORT}"

    def worker(self, worker_id: str) -> WorkerClient:
        return WorkerClient(self.address(worker_id), timeout=10.0)

    def log_tail(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")[-3000:]


def infos(client: CoordinatorClient) -> dict[str, WorkerInfo]:
    return {w.worker_id: w for w in client.workers()}


def all_ready(client: CoordinatorClient, version: int) -> bool:
    states = {w: (i.policy_version, i.state) for w, i in infos(client).items()}
    return states == {w: (version, "ready") for w in WORKERS}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    skip_without_redis()
    logs = tmp_path_factory.mktemp("multihost-logs")
    with Network() as net:
        db, c1 = net.add_host("db"), net.add_host("c1")
        for worker_id in WORKERS:
            net.add_host(worker_id)
        cluster = Cluster(net, NamespacedRedis(db), c1, logs)
        try:
            cluster.redis.start()
            coordinator = cluster.spawn(c1, "c1", [
                "coordinator", "--listen", f"{c1.ip}:{COORDINATOR_PORT}",
                "--redis", cluster.redis.url, "--log-level", "info"])
            wait_healthy(cluster.target, coordinator)
            for worker_id in WORKERS:
                cluster.start_worker(worker_id)
            with CoordinatorClient(cluster.target) as client:
                eventually(lambda: all_ready(client, 0), "three workers ready at version 0",
                           timeout=60.0)
            yield cluster
        finally:
            net.close()  # before the Redis data dir goes: redis-server is one of its processes
            subprocess.run(["rm", "-rf", str(cluster.redis.dir)], check=False)


# ---------------------------------------------------------------------- checks


def serve_and_index(cluster: Cluster, client: CoordinatorClient, worker_id: str) -> None:
    """``worker_id`` generates its prompt twice (the second from cache) and Lookup lists it."""
    with cluster.worker(worker_id) as worker:
        worker.generate(PROMPTS[worker_id], 2)
        again = worker.generate(PROMPTS[worker_id], 2)
    assert again.cached_tokens == 3 * PAGE
    eventually(lambda: client.lookup(PROMPTS[worker_id]).matches.get(worker_id) == 3 * PAGE,
               f"Lookup to list {worker_id} with its prompt's pages")


def leases_agree(cluster: Cluster, client: CoordinatorClient, version: int) -> bool:
    """Every worker ready at ``version``, and its lease live in Redis under the incarnation the
    coordinator routes to (key layout: docs/ARCHITECTURE.md section 4). After a Redis outage
    longer than a lease, the stored leases are gone: this holds once each worker re-registered
    (the first heartbeat after the outage is refused "re-register")."""
    if not all_ready(client, version):
        return False
    listed = infos(client)
    with redis.Redis.from_url(cluster.redis.url, socket_timeout=1.0) as store:
        stored = {w: store.hget(f"kvcoord:{{default}}:worker:{w}", "incarnation")
                  for w in WORKERS}
    return all(stored[w] == str(listed[w].incarnation).encode() for w in WORKERS)


def rollouts(client: CoordinatorClient) -> dict[str, RolloutRecord]:
    """Every kept rollout record by id, its cursor blanked (a cursor says where, not what).
    Delivery is at least once: a report whose answer was lost (Redis killed between the write
    and the reply) is sent again, so an id may repeat, but only with the same content."""
    records: dict[str, RolloutRecord] = {}
    for record in client.rollouts():
        record = dataclasses.replace(record, cursor="")
        assert records.setdefault(record.rollout_id, record) == record
    return records


def reported(client: CoordinatorClient, served: int) -> dict[str, RolloutRecord]:
    """The rollout records, once at least ``served`` are in (workers report every ~100 ms)."""
    eventually(lambda: len(rollouts(client)) >= served, f"{served} rollout records")
    return rollouts(client)


def assert_kept(client: CoordinatorClient, before: dict[str, RolloutRecord]) -> None:
    after = rollouts(client)
    assert {k: after.get(k) for k in before} == before


def routes_to(client: CoordinatorClient, prompt: list[int], n: int = 9) -> set[str]:
    return {client.route(prompt, routing_policy="round_robin").worker_id for _ in range(n)}


def unroutable(client: CoordinatorClient, worker_id: str) -> bool:
    """No route to ``worker_id`` (round robin over the fleet) and no Lookup listing it."""
    return (worker_id not in client.lookup(PROMPTS[worker_id]).matches
            and worker_id not in routes_to(client, PROMPTS[worker_id]))


# ---------------------------------------------------------------------- tests


def test_killed_worker_gets_no_route_and_leaves_lookup_once_its_lease_has_run_out(
    cluster: Cluster,
) -> None:
    victim = "w1"
    with CoordinatorClient(cluster.target) as client:
        serve_and_index(cluster, client, victim)
        before = reported(client, 2)
        incarnation = infos(client)[victim].incarnation
        host, process = cluster.workers[victim]
        host.kill(process)  # SIGKILL: no Deregister, no goodbye
        killed = time.monotonic()
        eventually(lambda: unroutable(client, victim), f"no route to killed {victim}",
                   timeout=UNROUTABLE_S)
        # Stays so once the lease is surely over (not only while the stream reset is fresh).
        time.sleep(max(0.0, killed + LEASE_S + 0.2 - time.monotonic()))
        assert unroutable(client, victim)
        assert victim not in infos(client) or infos(client)[victim].state != "ready"
        assert routes_to(client, PROMPTS["w2"]) == {"w2", "w3"}
        assert_kept(client, before)

        # A new process on the same host registers as a new incarnation and serves.
        cluster.start_worker(victim)
        eventually(lambda: all_ready(client, client.policy().version), f"{victim} back",
                   timeout=60.0)
        assert infos(client)[victim].incarnation > incarnation
        serve_and_index(cluster, client, victim)


def test_cut_worker_gets_no_route_past_its_lease_and_rejoins_with_a_new_incarnation(
    cluster: Cluster,
) -> None:
    victim = "w2"
    host = cluster.workers[victim][0]
    with CoordinatorClient(cluster.target) as client:
        serve_and_index(cluster, client, victim)
        before = reported(client, 2)
        incarnation = infos(client)[victim].incarnation
        host.link_down()
        try:
            took = eventually(lambda: unroutable(client, victim), f"no route to cut {victim}",
                              timeout=UNROUTABLE_S)
            # Nothing closed the stream: only the missed heartbeats can have done it.
            assert took >= LEASE_S - 0.5, took
            eventually(lambda: infos(client).get(victim) is None
                       or infos(client)[victim].state != "ready", f"{victim} not ready")
            assert routes_to(client, PROMPTS["w1"]) == {"w1", "w3"}
        finally:
            host.link_up()
        eventually(lambda: victim in infos(client)
                   and infos(client)[victim].incarnation > incarnation
                   and all_ready(client, client.policy().version),
                   f"{victim} to rejoin with a new incarnation")
        assert victim in routes_to(client, PROMPTS["w1"])
        serve_and_index(cluster, client, victim)  # its inventory is announced again, too
        assert_kept(client, before)


def test_redis_restart_keeps_lookups_answered_and_the_policy_version_and_rollouts_intact(
    cluster: Cluster,
) -> None:
    with CoordinatorClient(cluster.target) as client:
        for worker_id in WORKERS:
            serve_and_index(cluster, client, worker_id)
        version = client.policy().version
        before = reported(client, 6)
        listed = {w: client.lookup(PROMPTS[w]).matches for w in WORKERS}

        cluster.redis.stop(hard=True)  # SIGKILL: only what AOF fsynced survives
        down = time.monotonic()
        try:
            # Lookups are answered from memory the whole outage, longer than a lease.
            while time.monotonic() - down < LEASE_S + 0.5:
                assert {w: client.lookup(PROMPTS[w]).matches for w in WORKERS} == listed
                time.sleep(0.1)
            # Policy changes are refused while the store is unreachable.
            with (CoordinatorClient(cluster.target, timeout=0.5) as impatient,
                  pytest.raises(KvcoordError) as refused):
                impatient.begin_policy_update(version)
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        finally:
            cluster.redis.start()

        eventually(lambda: client.policy().version == version, "the policy readable again")
        state = client.policy()
        assert (state.version, state.phase, state.target_version) == (version, "serving", None)
        assert_kept(client, before)
        eventually(lambda: leases_agree(cluster, client, version),
                   "every worker ready again, its lease in the store")
        with client.policy_update(version, timeout=5.0) as pending:
            assert pending.version == version + 1
        assert pending.result is not None
        assert (pending.result.version, pending.result.phase) == (version + 1, "serving")
        assert (pending.result.acked_workers, pending.result.fenced_workers) == (WORKERS, ())
        eventually(lambda: all_ready(client, version + 1), "every worker at the new version")
        assert_kept(client, before)


def test_worker_partitioned_during_a_policy_update_is_fenced_and_rejoins_at_the_new_version(
    cluster: Cluster,
) -> None:
    victim = "w3"
    host = cluster.workers[victim][0]
    with CoordinatorClient(cluster.target) as client:
        version = client.policy().version
        eventually(lambda: all_ready(client, version), "every worker ready")
        serve_and_index(cluster, client, victim)
        before = reported(client, 2)
        incarnation = infos(client)[victim].incarnation
        # Cut, then Begin at once: its lease is still live, so it is a member of the update,
        # but neither DRAIN nor anything after it can reach it before Commit's deadline.
        host.link_down()
        try:
            client.begin_policy_update(version)
            result = client.commit_policy_update(version + 1, timeout=2.0)
            assert (result.version, result.phase) == (version + 1, "serving")
            assert (result.acked_workers, result.fenced_workers) == (("w1", "w2"), (victim,))
            assert routes_to(client, PROMPTS["w1"]) == {"w1", "w2"}
            assert all(r.policy_version == version + 1
                       for r in [client.route(PROMPTS[victim]) for _ in range(3)])
            assert victim not in client.lookup(PROMPTS[victim]).matches
        finally:
            host.link_up()
        eventually(lambda: victim in infos(client)
                   and infos(client)[victim].incarnation > incarnation
                   and all_ready(client, version + 1),
                   f"{victim} to rejoin at version {version + 1}")
        with cluster.worker(victim) as worker:
            assert worker.generate(PROMPTS[victim], 2).policy_version == version + 1
        assert victim in routes_to(client, PROMPTS["w1"])
        assert_kept(client, before)



def test_unreachable_redis_host_keeps_every_worker_listed(cluster: Cluster) -> None:
    """(c'), a Redis that does not answer at all (its host cut off) rather than one that
    refuses connections: Lookup must keep listing the live fleet from memory."""
    with CoordinatorClient(cluster.target) as client:
        version = client.policy().version
        eventually(lambda: leases_agree(cluster, client, version), "a settled fleet")
        for worker_id in WORKERS:
            serve_and_index(cluster, client, worker_id)
        listed = {w: client.lookup(PROMPTS[w]).matches for w in WORKERS}
        cluster.redis.host.link_down()
        cut = time.monotonic()
        try:
            while time.monotonic() - cut < LEASE_S + 1.0:
                assert {w: client.lookup(PROMPTS[w]).matches for w in WORKERS} == listed
                time.sleep(0.1)
        finally:
            cluster.redis.host.link_up()
            eventually(lambda: leases_agree(cluster, client, version), "the fleet back")
