"""One chaos round's record (``Round``) and what every round does around its fault (``Chaos``):
serve the probe prompts, start generation, wait for the fleet to be whole, pause generation,
compare the replicas' index digests once the cluster is quiet, read the rollouts back.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from bench.chaos_load import LOAD_PREFIX, Load
from bench.chaos_watch import Commit, Watch
from coordinator.client import CoordinatorClient, KvcoordError, PolicyState, RolloutRecord
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from coordinator.wire import PROTOCOL_VERSION
from tests.multihost_cluster import (
    LAG_BOUND_S,
    LEASE_S,
    REPLICAS,
    WORKERS,
    Cluster,
    Holdings,
    eventually,
    holdings,
    infos,
    rollouts,
    serve,
    unroutable,
)

RECOVERY_TIMEOUT_S = 30.0
REPORT_WAIT_S = 5.0  # a reporter's backoff tops out at 5 s after failed calls
POLICY_STALE_S = LEASE_S  # the coordinator's policy_stale_ms default: one lease


@dataclass(slots=True)
class Round:
    """One fault injected and recovered from. Times are ``time.monotonic()``: ``began`` (before
    the round's serving), ``fault_at`` (injected), ``repaired_at`` (the fault ended; None when
    nothing is repaired), ``recovered_at`` (the fleet whole again; None if it never was within
    ``RECOVERY_TIMEOUT_S``), ``ended``. ``digests``: each serving replica's index digest (hex)
    once quiet, ``agreed`` whether they were equal within the lag bound (None: one replica).
    ``error`` says why a round could not finish."""

    kind: str
    index: int
    victim: str
    began: float
    fault_at: float = 0.0
    repaired_at: float | None = None
    recovered_at: float | None = None
    ended: float = 0.0
    rollouts_checked: int = 0
    rollouts_lost: list[str] = field(default_factory=list)
    died_with_worker: list[str] = field(default_factory=list)  # bench.chaos_load.reconcile
    digests: dict[str, str] = field(default_factory=dict)
    agreed: bool | None = None
    notes: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def recovery_s(self) -> float | None:
        if self.recovered_at is None:
            return None
        return self.recovered_at - (self.fault_at if self.repaired_at is None
                                    else self.repaired_at)


def own_records(earlier: dict[str, RolloutRecord],
                now: dict[str, RolloutRecord]) -> dict[str, RolloutRecord]:
    """The records in ``now`` that ``earlier`` lacks, less generations' (``LOAD_PREFIX`` ids,
    reconciled by the round that made them): the probe prompts' records this round's serving
    added. ReadRollouts returns every record ever kept; checking all of them each round would
    count earlier rounds' records again and again."""
    return {k: r for k, r in now.items()
            if k not in earlier and not k.startswith(LOAD_PREFIX)}


def index_digest(target: str, timeout: float = 5.0) -> str:
    """The replica's ``Stats.index_digest`` (hex), asked for explicitly."""
    with grpc.insecure_channel(target) as channel:
        stats = pb_grpc.CoordinatorStub(channel).GetStats(
            pb.GetStatsRequest(protocol_version=PROTOCOL_VERSION, index_digest=True),
            timeout=timeout)
    return bytes(stats.index_digest).hex()


class Chaos:
    """The cluster, the watch, the generation load and the observations every round makes."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.watch = Watch(cluster, frozenset(REPLICAS))
        self.load = Load(cluster, self.watch)
        self.waited_on: dict[str, str] = {}  # what each replica answered when last not whole

    @property
    def serving(self) -> list[str]:
        return sorted(self.watch.serving)

    def client(self) -> CoordinatorClient:
        """A client of the serving replicas. Its first target is serving: the SDK's streaming
        calls (``rollouts``) use the first target only."""
        client: CoordinatorClient = self.cluster.client(*self.serving)
        return client

    def prepare(self) -> tuple[int, Holdings, dict[str, RolloutRecord]]:
        """Every worker serves its probe prompt; returns the policy version, the holdings the
        serving replicas agree on, and the round's own probe records (``own_records``)."""
        with self.client() as client:
            version = client.policy().version
            earlier = rollouts(client)
            agreed, records = serve(self.cluster, client, *WORKERS)
            return version, agreed, own_records(earlier, records)

    def update(self, version: int, replica: str | None = None,
               deadline_s: float = 2.0) -> PolicyState:
        """A sync policy update from ``version`` to ``version + 1`` through ``replica`` (default:
        the serving ones), noted in the watch."""
        with (self.cluster.client(replica) if replica else self.client()) as trainer:
            begun = time.monotonic()
            trainer.begin_policy_update(version)
            result = trainer.commit_policy_update(version + 1, timeout=deadline_s)
        self.watch.committed(Commit(result.version, begun, time.monotonic(),
                                    tuple(result.fenced_workers)))
        return result

    def until_unroutable(self, worker_id: str, since: float) -> float:
        """Seconds from ``since`` until no serving replica routes to or lists ``worker_id``."""
        for replica in self.serving:
            with self.cluster.client(replica, timeout=2.0) as client:
                eventually(functools.partial(unroutable, client, worker_id),
                           f"no route to {worker_id} on {replica}", LEASE_S + 2.0)
        return time.monotonic() - since

    def wait_whole(self, version: int, expected: Holdings) -> float:
        """The time the fleet is whole (``bench.chaos_report.DEFINITIONS["recovery_s"]``) on
        every serving replica; AssertionError with what each replica last answered if never."""
        serving = self.serving
        clients = {r: self.cluster.client(r, timeout=2.0) for r in serving}
        seen: dict[str, object] = {}
        whole_at: list[float] = []

        def whole() -> bool:
            for replica, client in clients.items():
                try:
                    listed = infos(client)
                    found = holdings(client)
                except KvcoordError as exc:
                    seen[replica] = exc.code.name
                    return False
                states = {w: (i.policy_version, i.state) for w, i in listed.items()}
                seen[replica] = (states, {w: i.owner_replica for w, i in listed.items()}, found)
                if not (states == {w: (version, "ready") for w in WORKERS}
                        and {i.owner_replica for i in listed.values()} <= set(serving)
                        and found == expected):
                    self.waited_on = {r: repr(s) for r, s in seen.items()}
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

    def compare_digests(self, rnd: Round) -> None:
        """Generation paused, poll every serving replica's index digest until they are equal,
        at most ``LAG_BOUND_S``; notes the last digests and whether they agreed."""
        self.load.pause()
        targets = {r: self.cluster.target(r) for r in self.serving}
        deadline = time.monotonic() + LAG_BOUND_S
        while True:
            rnd.digests = {r: index_digest(t) for r, t in targets.items()}
            rnd.agreed = len(set(rnd.digests.values())) == 1 if len(targets) > 1 else None
            if rnd.agreed is not False or time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def read_rollouts(self, expected: set[str]) -> dict[str, RolloutRecord]:
        """Every rollout record by id, once all of ``expected`` are in or ``REPORT_WAIT_S``
        has passed (workers report every ~100 ms, after a backoff when a call failed)."""
        deadline = time.monotonic() + REPORT_WAIT_S
        with self.client() as client:
            while True:
                records: dict[str, RolloutRecord] = rollouts(client)
                if expected <= records.keys() or time.monotonic() >= deadline:
                    return records
                time.sleep(0.1)
