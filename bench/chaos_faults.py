"""The faults ``bench/chaos.py`` injects into the multi-host cluster, one ``Round`` at a time, and
what each round observes (``Chaos``). ``DEFINITIONS`` says exactly what each figure is.

Fault kinds (``FAULTS``); worker victims rotate over w1, w2, w3:

- ``kill_worker``: SIGKILL a worker; restart it once its lease is over by ``PAST_LEASE_S``;
- ``cut_worker``: cut a worker's link for its lease plus ``PAST_LEASE_S``, then heal it;
- ``kill_replica``: SIGKILL the replica owning most workers (the survivor must take them over);
- ``restart_replica``: start the killed replica again under the same id (it bootstraps);
- ``redis_restart``: SIGKILL Redis, restart it on the same data after a lease and a half second;
- ``partition_update``: cut a worker, run a sync policy update (commit deadline 2 s), heal.

A round first has every worker serve its probe prompt (two rollout records each) and notes the
holdings the serving replicas agree on; then it injects the fault, ends it, and waits for the
fleet to be whole again.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from bench.chaos_watch import Watch
from coordinator.client import CoordinatorClient, KvcoordError, RolloutRecord
from tests.multihost_cluster import (
    LEASE_S,
    REPLICAS,
    WORKERS,
    Cluster,
    Holdings,
    all_ready,
    eventually,
    holdings,
    owners,
    rollouts,
    serve,
    unroutable,
)

PAST_LEASE_S = 1.0  # how long a dead or cut worker stays so after its lease: routes are watched
REDIS_DOWN_S = LEASE_S + 0.5  # longer than a lease, as in the tests
COMMIT_DEADLINE_S = 2.0
RECOVERY_TIMEOUT_S = 30.0


@dataclass(slots=True)
class Round:
    """One fault injected and recovered from. Times are ``time.monotonic()``: ``began`` (before
    the round's serving), ``fault_at`` (injected), ``repaired_at`` (the fault ended; None when
    nothing is repaired), ``recovered_at`` (the fleet whole again; None if it never was within
    ``RECOVERY_TIMEOUT_S``), ``ended``. ``error`` says why a round could not finish."""

    kind: str
    index: int
    victim: str
    began: float  # time.monotonic()
    fault_at: float = 0.0
    repaired_at: float | None = None
    recovered_at: float | None = None
    ended: float = 0.0
    rollouts_checked: int = 0
    rollouts_lost: list[str] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def recovery_s(self) -> float | None:
        if self.recovered_at is None:
            return None
        return self.recovered_at - (self.fault_at if self.repaired_at is None
                                    else self.repaired_at)


class Chaos:
    """The cluster, the watch and the observations every round makes."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.watch = Watch(cluster, frozenset(REPLICAS))

    @property
    def serving(self) -> list[str]:
        return sorted(self.watch.serving)

    def client(self) -> CoordinatorClient:
        """A client of the serving replicas. Its first target is serving: the SDK's streaming
        calls (``rollouts``) use the first target only."""
        return self.cluster.client(*self.serving)

    def prepare(self) -> tuple[int, Holdings, dict[str, RolloutRecord]]:
        """Every worker serves its probe prompt; returns the policy version, the holdings the
        serving replicas agree on, and the rollout records once the round's are in."""
        with self.client() as client:
            version = client.policy().version
            agreed, records = serve(self.cluster, client, *WORKERS)
            return version, agreed, records

    def until_unroutable(self, worker_id: str, since: float) -> float:
        """Seconds from ``since`` until no serving replica routes to or lists ``worker_id``."""
        for replica in self.serving:
            with self.cluster.client(replica, timeout=2.0) as client:
                eventually(functools.partial(unroutable, client, worker_id),
                           f"no route to {worker_id} on {replica}", LEASE_S + 2.0)
        return time.monotonic() - since

    def wait_whole(self, version: int, expected: Holdings) -> float:
        """The time the fleet is whole (``bench.chaos.DEFINITIONS["recovery_s"]``) on every
        serving replica; AssertionError with what each replica last answered if it never is."""
        serving = self.serving
        clients = {r: self.cluster.client(r, timeout=2.0) for r in serving}
        seen: dict[str, object] = {}
        whole_at: list[float] = []

        def whole() -> bool:
            for replica, client in clients.items():
                try:
                    state = (all_ready(client, version), owners(client), holdings(client))
                except KvcoordError as exc:
                    seen[replica] = exc.code.name
                    return False
                seen[replica] = state
                if not (state[0] and set(state[1].values()) <= set(serving)
                        and state[2] == expected):
                    return False
            whole_at.append(time.monotonic())
            return True

        try:
            eventually(whole, "the fleet whole", RECOVERY_TIMEOUT_S)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; expected {expected} at version {version}, "
                                 f"last seen {seen}") from None
        finally:
            for client in clients.values():
                client.close()
        return whole_at[0]

    def lost(self, before: dict[str, RolloutRecord]) -> list[str]:
        with self.client() as client:
            after = rollouts(client)
        return sorted(k for k, record in before.items() if after.get(k) != record)


# ---------------------------------------------------------------------- faults

Injector = Callable[[Chaos, Round, int, Holdings], tuple[int, Holdings]]
"""Inject the fault and end it; returns the policy version and holdings to recover to."""


def _hold_until(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))


def kill_worker(chaos: Chaos, rnd: Round, version: int, expected: Holdings) -> tuple[int, Holdings]:
    rnd.fault_at = time.monotonic()
    chaos.cluster.kill_worker(rnd.victim)
    chaos.watch.unreachable(rnd.victim, rnd.fault_at)
    rnd.notes["unroutable_s"] = chaos.until_unroutable(rnd.victim, rnd.fault_at)
    _hold_until(rnd.fault_at + LEASE_S + PAST_LEASE_S)
    rnd.repaired_at = time.monotonic()
    chaos.cluster.start_worker(rnd.victim)
    chaos.watch.repaired(rnd.victim, rnd.repaired_at)
    return version, {p: {w: n for w, n in m.items() if w != rnd.victim}
                     for p, m in expected.items()}


def cut_worker(chaos: Chaos, rnd: Round, version: int, expected: Holdings) -> tuple[int, Holdings]:
    host = chaos.cluster.workers[rnd.victim][0]
    rnd.fault_at = time.monotonic()
    host.link_down()
    chaos.watch.unreachable(rnd.victim, rnd.fault_at)
    try:
        rnd.notes["unroutable_s"] = chaos.until_unroutable(rnd.victim, rnd.fault_at)
        _hold_until(rnd.fault_at + LEASE_S + PAST_LEASE_S)
    finally:
        rnd.repaired_at = time.monotonic()
        host.link_up()
        chaos.watch.repaired(rnd.victim, rnd.repaired_at)
    return version, expected


def kill_replica(chaos: Chaos, rnd: Round, version: int,
                 expected: Holdings) -> tuple[int, Holdings]:
    with chaos.client() as client:
        owned = owners(client)
    rnd.victim = max(chaos.serving, key=lambda r: (list(owned.values()).count(r), r == "c1"))
    rnd.notes["moving"] = sorted(w for w, owner in owned.items() if owner == rnd.victim)
    chaos.watch.serving = chaos.watch.serving - {rnd.victim}
    rnd.fault_at = time.monotonic()
    chaos.cluster.kill_coordinator(rnd.victim)
    return version, expected


def restart_replica(chaos: Chaos, rnd: Round, version: int,
                    expected: Holdings) -> tuple[int, Holdings]:
    rnd.victim = next(r for r in REPLICAS if r not in chaos.watch.serving)
    rnd.fault_at = rnd.repaired_at = time.monotonic()
    chaos.cluster.start_coordinator(rnd.victim)  # returns once its health answers SERVING
    rnd.notes["serving_s"] = time.monotonic() - rnd.repaired_at
    chaos.watch.serving = chaos.watch.serving | {rnd.victim}
    return version, expected


def redis_restart(chaos: Chaos, rnd: Round, version: int,
                  expected: Holdings) -> tuple[int, Holdings]:
    rnd.victim = "db"
    rnd.fault_at = time.monotonic()
    chaos.cluster.redis.stop(hard=True)
    try:
        _hold_until(rnd.fault_at + REDIS_DOWN_S)
    finally:
        rnd.repaired_at = time.monotonic()
        chaos.cluster.redis.start()  # returns once it answers
        chaos.watch.replication_down(rnd.fault_at, time.monotonic())
    return version, expected


def partition_update(chaos: Chaos, rnd: Round, version: int,
                     expected: Holdings) -> tuple[int, Holdings]:
    host = chaos.cluster.workers[rnd.victim][0]
    rnd.fault_at = time.monotonic()
    host.link_down()
    chaos.watch.unreachable(rnd.victim, rnd.fault_at)
    try:
        with chaos.client() as trainer:
            trainer.begin_policy_update(version)
            result = trainer.commit_policy_update(version + 1, timeout=COMMIT_DEADLINE_S)
        rnd.notes.update(acked=list(result.acked_workers), fenced=list(result.fenced_workers))
        others = tuple(w for w in WORKERS if w != rnd.victim)
        if (result.version, result.acked_workers, result.fenced_workers) != (
                version + 1, others, (rnd.victim,)):
            raise AssertionError(f"update to {version + 1} committed as {result}")
        # Fenced and still cut off: the watch routes on, and none may name it.
        _hold_until(max(rnd.fault_at + LEASE_S, time.monotonic()) + PAST_LEASE_S)
    finally:
        rnd.repaired_at = time.monotonic()
        host.link_up()
        chaos.watch.repaired(rnd.victim, rnd.repaired_at)
    return version + 1, {p: {} for p in expected}


class Fault(NamedTuple):
    label: str
    inject: Injector
    recovery_target_s: float
    why: str  # where the target comes from


FAULTS = {
    "kill_worker": Fault("kill -9 worker", kill_worker, 5.0,
                         "a fresh worker process on 2 cores: interpreter, torch, model, register"),
    "cut_worker": Fault("cut worker link past lease", cut_worker, 2 * LEASE_S,
                        "re-register and announce within a lease after the heal"),
    "kill_replica": Fault("kill -9 coordinator replica", kill_replica, LEASE_S,
                          "re-attach before the moved workers' leases lapse on the survivor"),
    "restart_replica": Fault("restart killed replica", restart_replica, 5.0,
                             "process start plus a bootstrap from the survivor's snapshots"),
    "redis_restart": Fault("hard Redis restart", redis_restart, 2 * LEASE_S,
                           "re-register and re-publish within a lease after Redis is back"),
    "partition_update": Fault("worker partitioned in sync update", partition_update,
                              2 * LEASE_S, "re-register at the new version after the heal"),
}


def schedule(rounds: int) -> list[tuple[str, int]]:
    kinds = ["kill_worker"] * rounds + ["cut_worker"] * rounds
    kinds += ["kill_replica", "restart_replica"] * rounds
    kinds += ["redis_restart"] * rounds + ["partition_update"] * rounds
    seen: dict[str, int] = {}
    out = []
    for kind in kinds:
        out.append((kind, seen.get(kind, 0)))
        seen[kind] = seen.get(kind, 0) + 1
    return out


def run_round(chaos: Chaos, kind: str, index: int) -> Round:
    rnd = Round(kind, index, WORKERS[index % len(WORKERS)], time.monotonic())
    try:
        version, expected, before = chaos.prepare()
        rnd.rollouts_checked = len(before)
        version, expected = FAULTS[kind].inject(chaos, rnd, version, expected)
        rnd.recovered_at = chaos.wait_whole(version, expected)
        rnd.rollouts_lost = chaos.lost(before)
    except (AssertionError, KvcoordError, TimeoutError, RuntimeError) as exc:
        rnd.error = f"{type(exc).__name__}: {exc}"
    rnd.ended = time.monotonic()
    return rnd
