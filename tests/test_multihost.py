"""Faults across hosts: Redis, two coordinator replicas and three workers, each in its own network
namespace (``tests/multihost_cluster.py`` builds them), talking over a bridge; the test acts as
scheduler and trainer from the root namespace through the SDK, with both replicas as targets.

At the start c1 owns w1 and w3 and c2 owns w2 (each worker's first target). Each fault is
followed by its checks:

- (a) ``kill -9`` a worker: no route to it and no Lookup listing on either replica once its lease
  has run out;
- (b) cut a worker's link past its lease: no route to it on either replica; healed, it rejoins
  with a new incarnation and serves again;
- (c) a hard Redis restart: Lookup answers all along, the policy version is intact after, and
  policy changes work again;
- (d) a worker partitioned for the whole of a sync policy update: fenced while the others
  commit; healed, it rejoins at the new version;
- (c') Redis's host cut off (no answer at all, not a refusal): Lookup keeps listing the fleet
  (store calls time out within a third of the lease, so no lease of its own workers lapses);
- in both Redis outages each replica lists only its own workers once a lease has passed: it
  hears of its peer's workers only through the store (``through_outage``);
- (e) ``kill -9`` a coordinator replica: its workers re-attach to the survivor, which keeps
  their holdings, the policy state and the rollout records, and runs the next update; the
  killed replica, restarted under the same id, bootstraps from the survivor.

A policy update begun through one replica reaches the workers the other one owns.

After every fault, every rollout record reported before it is still there, unchanged, and both
(live) replicas answer the same Lookups once the replication lag bound has passed.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import grpc
import pytest
import redis

from coordinator.client import CoordinatorClient, KvcoordError, RolloutRecord
from tests.conftest import skip_without_redis
from tests.multihost_cluster import (
    LAG_BOUND_S,
    LEASE_S,
    PAGE,
    PROMPTS,
    REPLICAS,
    UNROUTABLE_S,
    WAIT_S,
    WORKERS,
    Cluster,
    Holdings,
    all_ready,
    eventually,
    holdings,
    infos,
    owners,
    replicas_agree,
    rollouts,
    routes_to,
    running_cluster,
    serve,
    unroutable,
)

pytestmark = [pytest.mark.slow, pytest.mark.redis]

T = TypeVar("T")
WAIT_UPDATE_S = 5.0  # a sync update's DRAIN/APPLY/RESUME relayed to every worker, on 2 cores


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    skip_without_redis()
    with running_cluster(tmp_path_factory.mktemp("multihost-logs")) as cluster:
        yield cluster


# ---------------------------------------------------------------------- checks


def on_every_replica(cluster: Cluster, check: Callable[[CoordinatorClient], bool], what: str,
                     timeout: float) -> dict[str, float]:
    """Poll ``check`` on every live replica until each has passed once; seconds each took."""
    start, took = time.monotonic(), {}
    clients = {r: cluster.client(r, timeout=2.0) for r in cluster.live_replicas}
    try:
        def all_passed() -> bool:
            for replica, client in clients.items():
                if replica not in took and check(client):
                    took[replica] = time.monotonic() - start
            return len(took) == len(clients)
        eventually(all_passed, f"{what} on {sorted(set(clients) - set(took))}", timeout)
    finally:
        for client in clients.values():
            client.close()
    return took


def assert_on_every_replica(cluster: Cluster, check: Callable[[CoordinatorClient], bool],
                            what: str) -> None:
    for replica in cluster.live_replicas:
        with cluster.client(replica, timeout=2.0) as client:
            assert check(client), f"{what} does not hold on {replica}"


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


def through_outage(cluster: Cluster, listed: Holdings, owned: dict[str, str],
                   seconds: float) -> None:
    """For ``seconds`` of a store outage, every replica's Lookups keep listing the workers it
    owns (``owned``: worker -> replica) exactly as in ``listed``; at the end, past a lease, none
    of its peer's. Why not those: a replica learns that a peer's worker is alive only from the
    peer's events in the store, so it cannot vouch for one past a lease (that worker may have
    died meanwhile); its own workers it hears directly."""
    clients = {r: cluster.client(r, timeout=2.0) for r in cluster.live_replicas}
    start = time.monotonic()
    try:
        while True:
            last = time.monotonic() - start >= seconds
            for replica, client in clients.items():
                answers = holdings(client)
                own = [w for w in WORKERS if owned[w] == replica]
                assert {w: answers[w] for w in own} == {w: listed[w] for w in own}, (
                    replica, answers)
                if last:
                    peers = [w for w in WORKERS if owned[w] != replica]
                    assert {w: answers[w] for w in peers} == {w: {} for w in peers}, (
                        replica, answers)
            if last:
                return
            time.sleep(0.1)
    finally:
        for client in clients.values():
            client.close()


def first_answer(call: Callable[[], T], timeout: float = 5.0) -> T:
    """``call``'s first answer from a replica that was just restarted, retrying while the SDK
    cannot reach it yet: grpc shares one subchannel among channels with the same address and
    options, so a new client inherits the reconnect backoff of those that saw the old process
    die, and fails UNAVAILABLE for up to that backoff although the server already answers."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except KvcoordError as exc:
            if exc.code != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def assert_kept(client: CoordinatorClient, before: dict[str, RolloutRecord]) -> None:
    after = rollouts(client)
    assert {k: after.get(k) for k in before} == before


# ---------------------------------------------------------------------- tests


def test_policy_update_begun_through_one_replica_reaches_the_workers_the_other_one_owns(
    cluster: Cluster,
) -> None:
    for replica in REPLICAS:
        with cluster.client(replica) as client:
            assert owners(client) == {"w1": "c1", "w2": "c2", "w3": "c1"}
    # c1 and c2 in turn: each holds no stream to the other's workers, so only the other replica
    # can have relayed their DRAIN and APPLY, and their acks reach the barrier through Redis.
    for replica in REPLICAS:
        with cluster.client(replica) as trainer:
            version = trainer.policy().version
            trainer.begin_policy_update(version)
            result = trainer.commit_policy_update(version + 1, timeout=5.0)
            assert (result.version, result.phase) == (version + 1, "serving")
            assert (result.acked_workers, result.fenced_workers) == (WORKERS, ())
        on_every_replica(cluster, functools.partial(all_ready, version=version + 1),
                         f"every worker ready at {version + 1}", WAIT_UPDATE_S)
        for worker_id in WORKERS:
            with cluster.worker(worker_id) as worker:
                assert worker.generate(PROMPTS[worker_id], 2).policy_version == version + 1
    replicas_agree(cluster)


def test_killed_worker_gets_no_route_and_leaves_lookup_once_its_lease_has_run_out(
    cluster: Cluster,
) -> None:
    victim = "w1"
    with cluster.client() as client:
        _, before = serve(cluster, client, victim)
        incarnation = infos(client)[victim].incarnation
        cluster.kill_worker(victim)
        killed = time.monotonic()
        on_every_replica(cluster, lambda c: unroutable(c, victim), f"no route to killed {victim}",
                         timeout=UNROUTABLE_S)
        # Stays so once the lease is surely over (not only while the stream reset is fresh).
        time.sleep(max(0.0, killed + LEASE_S + 0.2 - time.monotonic()))
        assert_on_every_replica(cluster, lambda c: unroutable(c, victim), f"{victim} unroutable")
        assert_on_every_replica(
            cluster, lambda c: victim not in infos(c) or infos(c)[victim].state != "ready",
            f"{victim} not ready")
        assert_on_every_replica(cluster, lambda c: routes_to(c, PROMPTS["w2"]) == {"w2", "w3"},
                                "routes to the two live workers only")
        assert replicas_agree(cluster)[victim] == {}
        assert_kept(client, before)

        # A new process on the same host registers as a new incarnation and serves.
        cluster.start_worker(victim)
        version = client.policy().version
        on_every_replica(cluster, lambda c: all_ready(c, version), f"{victim} back", timeout=60.0)
        assert infos(client)[victim].incarnation > incarnation
        serve(cluster, client, victim)


def test_cut_worker_gets_no_route_past_its_lease_and_rejoins_with_a_new_incarnation(
    cluster: Cluster,
) -> None:
    victim = "w2"
    host = cluster.workers[victim][0]
    with cluster.client() as client:
        _, before = serve(cluster, client, victim)
        incarnation = infos(client)[victim].incarnation
        host.link_down()
        try:
            took = on_every_replica(cluster, lambda c: unroutable(c, victim),
                                    f"no route to cut {victim}", timeout=UNROUTABLE_S)
            # Nothing closed the stream: only the missed heartbeats can have done it, on its
            # owner directly and on the other replica through its owner's events.
            assert min(took.values()) >= LEASE_S - 0.5, took
            on_every_replica(cluster, lambda c: infos(c).get(victim) is None
                             or infos(c)[victim].state != "ready", f"{victim} not ready",
                             timeout=UNROUTABLE_S)
            assert_on_every_replica(
                cluster, lambda c: routes_to(c, PROMPTS["w1"]) == {"w1", "w3"},
                "routes to the two reachable workers only")
            replicas_agree(cluster)
        finally:
            host.link_up()
        version = client.policy().version
        on_every_replica(cluster, lambda c: victim in infos(c)
                         and infos(c)[victim].incarnation > incarnation
                         and all_ready(c, version),
                         f"{victim} to rejoin with a new incarnation", timeout=WAIT_S)
        assert_on_every_replica(cluster, lambda c: victim in routes_to(c, PROMPTS["w1"]),
                                f"routes to {victim} again")
        serve(cluster, client, victim)  # its inventory is announced again, too
        assert_kept(client, before)



def test_redis_restart_keeps_lookups_answered_and_the_policy_version_and_rollouts_intact(
    cluster: Cluster,
) -> None:
    with cluster.client() as client:
        listed, before = serve(cluster, client, *WORKERS)
        version = client.policy().version
        assert listed == {w: {w: 3 * PAGE} for w in WORKERS}
        owned = owners(client)

        cluster.redis.stop(hard=True)  # SIGKILL: only what AOF fsynced survives
        try:
            # Lookups are answered from memory on both replicas the whole outage, longer than a
            # lease, each replica listing the workers it owns.
            through_outage(cluster, listed, owned, LEASE_S + 0.5)
            # Policy changes are refused while the store is unreachable.
            with (cluster.client(timeout=0.5) as impatient,
                  pytest.raises(KvcoordError) as refused):
                impatient.begin_policy_update(version)
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        finally:
            cluster.redis.start()

        eventually(lambda: client.policy().version == version, "the policy readable again")
        state = client.policy()
        assert (state.version, state.phase, state.target_version) == (version, "serving", None)
        assert_kept(client, before)
        on_every_replica(cluster, lambda c: leases_agree(cluster, c, version),
                         "every worker ready again, its lease in the store", timeout=WAIT_S)
        assert replicas_agree(cluster) == listed
        with client.policy_update(version, timeout=5.0) as pending:
            assert pending.version == version + 1
        assert pending.result is not None
        assert (pending.result.version, pending.result.phase) == (version + 1, "serving")
        assert (pending.result.acked_workers, pending.result.fenced_workers) == (WORKERS, ())
        on_every_replica(cluster, lambda c: all_ready(c, version + 1),
                         "every worker at the new version", timeout=WAIT_UPDATE_S)
        assert_kept(client, before)
        replicas_agree(cluster)



def test_worker_partitioned_during_a_policy_update_is_fenced_and_rejoins_at_the_new_version(
    cluster: Cluster,
) -> None:
    victim = "w3"
    host = cluster.workers[victim][0]
    with cluster.client() as client:
        version = client.policy().version
        eventually(lambda: all_ready(client, version), "every worker ready")
        _, before = serve(cluster, client, victim)
        incarnation = infos(client)[victim].incarnation
        # Cut, then Begin at once: its lease is still live, so it is a member of the update,
        # but neither DRAIN nor anything after it can reach it before Commit's deadline.
        host.link_down()
        try:
            client.begin_policy_update(version)
            result = client.commit_policy_update(version + 1, timeout=2.0)
            assert (result.version, result.phase) == (version + 1, "serving")
            assert (result.acked_workers, result.fenced_workers) == (("w1", "w2"), (victim,))
            on_every_replica(cluster, lambda c: routes_to(c, PROMPTS["w1"]) == {"w1", "w2"},
                             f"routes to w1 and w2 only, never to fenced {victim}",
                             timeout=LAG_BOUND_S)
            assert_on_every_replica(
                cluster, lambda c: all(c.route(PROMPTS[victim]).policy_version == version + 1
                                       for _ in range(3)), f"routes at {version + 1}")
            assert_on_every_replica(cluster, lambda c: victim not in c.lookup(
                PROMPTS[victim]).matches, f"{victim} not listed")
            replicas_agree(cluster)
        finally:
            host.link_up()
        on_every_replica(cluster, lambda c: victim in infos(c)
                         and infos(c)[victim].incarnation > incarnation
                         and all_ready(c, version + 1),
                         f"{victim} to rejoin at version {version + 1}", timeout=WAIT_S)
        with cluster.worker(victim) as worker:
            assert worker.generate(PROMPTS[victim], 2).policy_version == version + 1
        assert_on_every_replica(cluster, lambda c: victim in routes_to(c, PROMPTS["w1"]),
                                f"routes to {victim} again")
        assert_kept(client, before)
        replicas_agree(cluster)


def test_unreachable_redis_host_keeps_every_worker_listed(cluster: Cluster) -> None:
    """(c'), a Redis that does not answer at all (its host cut off) rather than one that
    refuses connections: Lookup must keep listing the live fleet from memory, on both
    replicas."""
    with cluster.client() as client:
        version = client.policy().version
        on_every_replica(cluster, lambda c: leases_agree(cluster, c, version), "a settled fleet",
                         timeout=WAIT_S)
        listed, _ = serve(cluster, client, *WORKERS)
        assert listed == {w: {w: 3 * PAGE} for w in WORKERS}
        owned = owners(client)
        cluster.redis.host.link_down()
        try:
            through_outage(cluster, listed, owned, LEASE_S + 1.0)
        finally:
            cluster.redis.host.link_up()
        on_every_replica(cluster, lambda c: leases_agree(cluster, c, version), "the fleet back",
                         timeout=WAIT_S)
        assert replicas_agree(cluster) == listed


def test_killed_replica_hands_its_workers_to_the_survivor_and_bootstraps_when_restarted(
    cluster: Cluster,
) -> None:
    with cluster.client() as client:
        version = client.policy().version
        on_every_replica(cluster, lambda c: all_ready(c, version), "a settled fleet",
                         timeout=WAIT_S)
        held, before = serve(cluster, client, *WORKERS)
        assert held == {w: {w: 3 * PAGE} for w in WORKERS}
        owned = owners(client)
        # The replica holding more streams dies: its workers are the ones that must move.
        victim = max(REPLICAS, key=lambda r: (list(owned.values()).count(r), r == "c1"))
        survivor = next(r for r in REPLICAS if r != victim)
        moving = sorted(w for w, owner in owned.items() if owner == victim)
        assert moving, owned

        cluster.kill_coordinator(victim)  # SIGKILL: no draining, nothing published
        killed = time.monotonic()
        with cluster.client(survivor) as alive:
            # The scheduler's client fails over, and routes flow all along: the moving workers
            # stay routable on the survivor until they re-attach there, well within a lease.
            routed: set[str] = set()
            def moved() -> bool:
                routed.update(routes_to(client, PROMPTS["w1"], n=3))
                return owners(alive) == {w: survivor for w in WORKERS}
            took = eventually(moved, f"{moving} to re-attach to {survivor}", timeout=UNROUTABLE_S)
            assert took < LEASE_S, took
            assert routed <= set(WORKERS)
            assert all_ready(alive, version)
            assert {w: i.incarnation for w, i in infos(alive).items()} == {
                w: i.incarnation for w, i in infos(client).items()}
            # The workers' pages survived; the survivor still holds them, past a lease.
            time.sleep(max(0.0, killed + LEASE_S + 0.2 - time.monotonic()))
            assert holdings(alive) == held
            assert routes_to(client, PROMPTS["w1"]) == set(WORKERS)
            state = client.policy()
            assert (state.version, state.phase, state.target_version) == (
                version, "serving", None)
            # Read through the survivor: the SDK's streaming calls (ReadRollouts, WatchPolicy)
            # use the first target only, with no failover.
            assert_kept(alive, before)

            with client.policy_update(version, timeout=5.0) as pending:
                assert pending.version == version + 1
            assert pending.result is not None
            assert (pending.result.version, pending.result.phase) == (version + 1, "serving")
            assert (pending.result.acked_workers, pending.result.fenced_workers) == (
                WORKERS, ())
            eventually(lambda: all_ready(alive, version + 1), "every worker at the new version",
                       timeout=WAIT_UPDATE_S)
            held, _ = serve(cluster, alive, *WORKERS)  # at the new version, for the restart
            assert held == {w: {w: 3 * PAGE} for w in WORKERS}

        # Same id, fresh process: SERVING only once bootstrapped from the survivor's snapshot.
        cluster.start_coordinator(victim)
        with cluster.client(victim) as restarted:
            listed = first_answer(lambda: infos(restarted))
            assert {w: (i.policy_version, i.state, i.owner_replica) for w, i in listed.items()} == {
                w: (version + 1, "ready", survivor) for w in WORKERS}
            assert restarted.policy().version == version + 1
            eventually(lambda: set(restarted.stats().replicas) == set(REPLICAS),
                       "the restarted replica to list both replicas as live", timeout=LAG_BOUND_S)
        assert replicas_agree(cluster) == held
        assert_kept(client, before)
