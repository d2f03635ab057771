"""Policy updates end to end with real processes: a ``kvcoord coordinator --redis`` on a
test-owned redis-server (AOF, ``appendfsync always``) and three ``kvcoord worker`` processes.

A scheduler (threads routing through the SDK and generating through ``WorkerClient``) runs the
whole time while the test, acting as the trainer, performs policy updates, sync and async. The
issue's invariants are then checked against what the scheduler recorded:

1. every ``Generation.policy_version`` names the weights that produced it (a fresh runtime at
   that version, no prefix cache, yields the very same tokens);
2. in sync mode no generation runs on a worker between its DRAINED and APPLIED acks;
3. per worker, the versions of completed generations never decrease;
4. no cached page crosses a version: outputs equal the uncached recompute (1), and
   ``cached_tokens > 0`` only where that worker served the prompt before at that version;
5. a worker that never acks (SIGSTOPped during the barrier) is fenced, routes avoid it, and after
   SIGCONT it re-registers, catches up and serves the new version;
6. a Redis crash between Begin and Commit loses no version and no rollout record.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import grpc
import pytest

from coordinator.client import CoordinatorClient, KvcoordError, PolicyState
from coordinator.core.hashing import DEV_HASH_KEY, HashConfig
from kvcoord import child_process
from kvcoord.demo import free_port, stop_process, wait_healthy
from tests.conftest import skip_without_redis
from tests.redis_server import RedisServer
from worker.client import Generation, WorkerClient
from worker.runtime.engine import ModelConfig
from worker.runtime.runtime import WorkerRuntime

pytestmark = [pytest.mark.slow, pytest.mark.redis]

PAGE = 4
PAGES = 64
MAX_NEW = 6
WORKERS = ("w0", "w1", "w2")
ENV = {
    "KVCOORD_LEASE_MS": "1500", "KVCOORD_HEARTBEAT_MS": "300",
    "KVCOORD_REAPER_INTERVAL_MS": "100", "KVCOORD_DROP_GRACE_MS": "3000",
    "KVCOORD_BACKOFF_MAX_MS": "300", "KVCOORD_PAGE_SIZE": str(PAGE),
    "KVCOORD_BARRIER_TIMEOUT_MS": "4000", "KVCOORD_ROUTE_WAIT_MS": "2000",
    "KVCOORD_ROUTE_RETRY_MS": "50", "KVCOORD_MAX_STALENESS": "1",
}
# Four prompts with no full page in common: a cache hit can only come from the same prompt.
PROMPTS = [[(37 * p + 11 * i + 5) % 500 for i in range(3 * PAGE + 1)] for p in range(4)]
ROUTING_POLICIES = ("kv_aware", "round_robin")  # one per scheduler thread
WAIT_S = 15.0


def eventually(condition: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    """Poll ``condition`` (the awaited event happens in another process) within ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


# ---------------------------------------------------------------------- the fleet


def spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """``python -m kvcoord.cli ARGS`` in its own process group, structlog JSON to ``log``."""
    with log.open("wb") as sink:
        return child_process.start(
            [sys.executable, "-m", "kvcoord.cli", *args], env={**os.environ, **ENV},
            stdout=subprocess.DEVNULL, stderr=sink,
        )


@dataclass(frozen=True, slots=True)
class Served:
    """One answered generation, with wall-clock (``time.time``) start and end as the scheduler
    saw them: the worker ran it somewhere inside ``[start, end]``."""

    worker_id: str
    prompt: int  # index into PROMPTS
    generation: Generation
    start: float
    end: float


@dataclass
class Fleet:
    redis: RedisServer
    target: str
    coordinator: subprocess.Popen[bytes]
    logs: Path
    workers: dict[str, tuple[str, subprocess.Popen[bytes]]] = field(default_factory=dict)
    served: list[Served] = field(default_factory=list)
    """Every generation any test's scheduler recorded: the workers' caches outlive a test."""

    def states(self, client: CoordinatorClient) -> dict[str, tuple[int, str]]:
        return {w.worker_id: (w.policy_version, w.state) for w in client.workers()}

    def log_events(self, worker_id: str) -> list[dict[str, object]]:
        """The worker's structlog lines, parsed (non-JSON lines, e.g. tracebacks, skipped)."""
        events = []
        for line in (self.logs / f"{worker_id}.log").read_text().splitlines():
            if line.startswith("{"):
                events.append(json.loads(line))
        return events


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    skip_without_redis()
    logs = tmp_path_factory.mktemp("policy-e2e-logs")
    with RedisServer(appendonly=True, appendfsync="always") as redis_server:
        port = free_port()
        target = f"127.0.0.1:{port}"
        coordinator = spawn(["coordinator", "--listen", target, "--redis", redis_server.url,
                             "--log-level", "info"], logs / "coordinator.log")
        fleet = Fleet(redis_server, target, coordinator, logs)
        try:
            wait_healthy(target, coordinator)
            for worker_id in WORKERS:
                address = f"127.0.0.1:{free_port()}"
                process = spawn(["worker", "--coordinator", target, "--listen", address,
                                 "--worker-id", worker_id, "--pages", str(PAGES),
                                 "--device", "cpu", "--log-level", "info"],
                                logs / f"{worker_id}.log")
                fleet.workers[worker_id] = (address, process)
            for address, process in fleet.workers.values():
                wait_healthy(address, process, timeout=60.0)
            with CoordinatorClient(target) as client:
                eventually(lambda: fleet.states(client) == {w: (0, "ready") for w in WORKERS},
                           "three workers ready at version 0", timeout=30.0)
            yield fleet
        finally:
            for _address, process in fleet.workers.values():
                os.killpg(process.pid, signal.SIGCONT)  # a stopped worker cannot exit on TERM
                stop_process(process)
            stop_process(coordinator)


# ---------------------------------------------------------------------- the scheduler


class Router:
    """Threads that route (SDK, retried while a sync update drains) and generate (WorkerClient)
    back to back, recording every answered generation in ``served`` (the fleet's history) and
    every route in ``routes``. A worker that refuses because it is draining (UNAVAILABLE) is
    skipped: the next route goes elsewhere or waits. ``errors`` holds any other failure."""

    def __init__(self, fleet: Fleet, threads: int = 2) -> None:
        self.target = fleet.target
        self.served = fleet.served
        self.routes: list[tuple[float, str]] = []  # (time.time() answered, worker id)
        self.refused = 0
        self.errors: list[KvcoordError] = []
        self._cond = threading.Condition()
        self._paused = False
        self._busy = 0
        self._stopping = False
        self._clients: dict[str, WorkerClient] = {}
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True)
                         for i in range(threads)]

    def __enter__(self) -> Router:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._stopping = True
            self._paused = False
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=30)
        for client in self._clients.values():
            client.close()

    def _worker(self, address: str) -> WorkerClient:
        with self._cond:
            if address not in self._clients:
                self._clients[address] = WorkerClient(address, timeout=5.0)
            return self._clients[address]

    def _loop(self, index: int) -> None:
        policy = ROUTING_POLICIES[index % len(ROUTING_POLICIES)]
        with CoordinatorClient(self.target, timeout=20.0) as client:
            turn = index
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._stopping or not self._paused)
                    if self._stopping:
                        return
                    self._busy += 1
                try:
                    self._one(client, turn % len(PROMPTS), policy)
                finally:
                    with self._cond:
                        self._busy -= 1
                        self._cond.notify_all()
                turn += 1

    def _one(self, client: CoordinatorClient, prompt: int, policy: str) -> None:
        try:
            route = client.route(PROMPTS[prompt], routing_policy=policy)
            with self._cond:
                self.routes.append((time.time(), route.worker_id))
            start = time.time()
            generation = self._worker(route.address).generate(PROMPTS[prompt], MAX_NEW)
            end = time.time()
        except KvcoordError as error:
            with self._cond:
                if error.code == grpc.StatusCode.UNAVAILABLE and error.retry_after_ms:
                    self.refused += 1  # the worker is draining: route again
                else:
                    self.errors.append(error)
                self._cond.notify_all()
            return
        with self._cond:
            self.served.append(Served(route.worker_id, prompt, generation, start, end))
            self._cond.notify_all()

    def pause(self) -> None:
        """Start no new request and return once none is in flight."""
        with self._cond:
            self._paused = True
            if not self._cond.wait_for(lambda: self._busy == 0, timeout=WAIT_S):
                raise AssertionError(f"{self._busy} requests still in flight after {WAIT_S}s")

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def wait_served(self, what: str, condition: Callable[[Served], bool], count: int = 4) -> None:
        """Wait until ``count`` recorded generations satisfy ``condition``."""
        def enough() -> bool:
            return sum(1 for s in self.served if condition(s)) >= count

        with self._cond:
            if not self._cond.wait_for(enough, timeout=WAIT_S):
                raise AssertionError(f"timed out waiting for {count} generations {what}; "
                                     f"errors: {self.errors[:3]}")


def served_by(worker_id: str, version: int) -> Callable[[Served], bool]:
    return lambda s: s.worker_id == worker_id and s.generation.policy_version == version


# ---------------------------------------------------------------------- the trainer


def commit_retrying(client: CoordinatorClient, version: int, timeout: float) -> PolicyState:
    """Commit, retrying while the store is unreachable. An ABORTED retry whose policy is
    already at ``version`` means an earlier attempt committed but its answer was lost."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            return client.commit_policy_update(version, timeout=timeout)
        except KvcoordError as error:
            if error.code == grpc.StatusCode.ABORTED:
                state = client.policy()
                if state.version == version and state.target_version is None:
                    return state
                raise
            if time.monotonic() > deadline:
                raise
        time.sleep(0.1)


@dataclass(frozen=True, slots=True)
class Update:
    version: int
    mode: str
    began: float
    committed: float
    state: PolicyState


def update(client: CoordinatorClient, mode: str, timeout: float = 5.0) -> Update:
    """One ``client.policy_update`` from the current version (commit on exit)."""
    current = client.policy().version
    began = time.time()
    with client.policy_update(current, mode=mode, timeout=timeout) as pending:
        assert pending.version == current + 1
    assert pending.result is not None
    return Update(pending.version, mode, began, time.time(), pending.result)


# ---------------------------------------------------------------------- checks


def recompute(prompt: int, version: int) -> list[int]:
    """The completion at ``version`` from a fresh runtime that caches nothing."""
    runtime = WorkerRuntime(
        model=ModelConfig(), pages=PAGES, page_size=PAGE,
        hash_config=HashConfig(DEV_HASH_KEY, page_size=PAGE), policy_version=version,
        device="cpu", prefix_caching=False,
    )
    return runtime.generate(PROMPTS[prompt], MAX_NEW).tokens


def log_time(event: dict[str, object]) -> float:
    return datetime.fromisoformat(str(event["timestamp"])).timestamp()


def gate_closed(events: list[dict[str, object]], version: int) -> tuple[float, float]:
    """``(DRAIN received, APPLIED)`` of ``version`` in a worker's log: the worker closes its
    generation gate in the step that logs the DRAIN command and opens it in the step that logs
    ``policy.applied`` (then acks APPLIED). DRAINED is acked in between, once the generations
    admitted before DRAIN have finished."""
    drain = next(log_time(e) for e in events if e["event"] == "policy.command"
                 and e["kind"] == "drain" and e["version"] == version)
    applied = next(log_time(e) for e in events
                   if e["event"] in ("policy.applied", "policy.already_applied")
                   and e["version"] == version)
    return drain, applied


def check_served(served: list[Served]) -> None:
    """Invariants 1, 3 and 4 over everything the scheduler recorded."""
    # (1) + (4): every output equals the uncached recompute at the version it names.
    expected = {key: recompute(*key)
                for key in sorted({(s.prompt, s.generation.policy_version) for s in served})}
    wrong = [s for s in served
             if s.generation.tokens != expected[s.prompt, s.generation.policy_version]]
    assert wrong == []
    # Different weights give different outputs, so (1) could not pass with stale weights.
    for prompt in range(len(PROMPTS)):
        outputs = [tuple(t) for (p, _v), t in expected.items() if p == prompt]
        assert len(set(outputs)) == len(outputs)

    by_worker: dict[str, list[Served]] = {}
    for s in sorted(served, key=lambda s: s.end):
        by_worker.setdefault(s.worker_id, []).append(s)
    for worker_id, done in by_worker.items():
        # (3) versions never decrease in completion order.
        versions = [s.generation.policy_version for s in done]
        assert versions == sorted(versions), worker_id
        # (4) a hit needs the same prompt served on this worker at this version before.
        for s in done:
            if s.generation.cached_tokens == 0:
                continue
            earlier = [h for h in done if h is not s and h.prompt == s.prompt
                       and h.generation.policy_version == s.generation.policy_version
                       and h.start < s.end]
            assert earlier, f"{worker_id} reused pages for {s} without serving it before"
            assert s.generation.cached_tokens <= len(PROMPTS[s.prompt]) // PAGE * PAGE
    hits = [s for s in served if s.generation.cached_tokens > 0]
    # A miss right after a version change although the old version had cached that prompt.
    misses = [s for s in served if s.generation.cached_tokens == 0 and any(
        h.worker_id == s.worker_id and h.prompt == s.prompt and h.end < s.start
        and h.generation.policy_version < s.generation.policy_version for h in served)]
    assert hits and misses, (len(hits), len(misses))


def check_no_generation_between_drained_and_applied(
    fleet: Fleet, served: list[Served], updates: list[Update]
) -> None:
    """(2), per sync update and acking worker: nothing the worker served was admitted between
    DRAIN reaching it and its APPLIED. A generation is sent (``start``, here) before the worker
    admits it, so one sent in that window was admitted in it, or later: a call that waited in
    the worker's queue while it drained and applied is admitted once it reopens, and then runs
    at the new version. So one sent in the window at the *old* version was admitted in it, and
    ran between DRAINED and APPLIED or kept DRAINED from being true. (A generation admitted
    before DRAIN ends before DRAINED; from outside the worker that end is seen only through its
    answer's latency, so it is not timed.)
    """
    checked = 0
    for done in updates:
        if done.mode != "sync":
            continue
        for worker_id in done.state.acked_workers:
            drain, applied = gate_closed(fleet.log_events(worker_id), done.version)
            assert done.began <= drain <= applied <= done.committed
            sent_in_window = [s for s in served
                              if s.worker_id == worker_id and drain <= s.start <= applied]
            # Those at the new version were admitted after APPLIED: they end after it.
            assert all(s.end > applied for s in sent_in_window
                       if s.generation.policy_version == done.version)
            admitted = [s for s in sent_in_window
                        if s.generation.policy_version != done.version]
            assert admitted == [], (worker_id, done.version, drain, applied)
            checked += 1
    assert checked == 5  # w0-w2 in the first sync update, w0 and w1 in the fenced one


# ---------------------------------------------------------------------- tests


def test_updates_under_load_keep_every_generation_attributable_and_fence_a_silent_worker(
    fleet: Fleet,
) -> None:
    stuck_id = "w2"
    stuck = fleet.workers[stuck_id][1]
    updates: list[Update] = []
    with CoordinatorClient(fleet.target) as client, Router(fleet) as scheduler:
        start = client.policy().version

        def serving(version: int, after: float, worker: str | None = None,
                    count: int = 8) -> None:
            scheduler.wait_served(
                f"at version {version}" + (f" by {worker}" if worker else ""),
                lambda s: s.generation.policy_version == version and s.start > after
                and (worker is None or s.worker_id == worker), count,
            )

        serving(start, 0.0)
        updates.append(update(client, "sync"))
        serving(start + 1, updates[-1].committed)
        updates.append(update(client, "async"))
        serving(start + 2, updates[-1].committed)

        # (5) A worker that cannot ack: stopped (no request of ours in flight to it, so none
        # hangs) while still live at Begin; Commit's deadline fences it.
        scheduler.pause()
        os.killpg(stuck.pid, signal.SIGSTOP)
        stopped = True
        began = time.time()
        try:
            with client.policy_update(start + 2, mode="sync", timeout=1.5) as pending:
                scheduler.resume()
            assert pending.result is not None
            fenced_at = time.time()
            assert (pending.result.version, pending.result.phase) == (start + 3, "serving")
            assert pending.result.acked_workers == ("w0", "w1")
            assert pending.result.fenced_workers == (stuck_id,)
            updates.append(Update(start + 3, "sync", began, fenced_at, pending.result))
            serving(start + 3, fenced_at, count=8)  # routes keep flowing, to the others
            os.killpg(stuck.pid, signal.SIGCONT)
            stopped = False
        finally:
            if stopped:
                os.killpg(stuck.pid, signal.SIGCONT)
        resumed = time.time()
        assert stuck_id not in {w for t, w in scheduler.routes if fenced_at <= t < resumed}
        eventually(lambda: fleet.states(client).get(stuck_id) == (start + 3, "ready"),
                   f"{stuck_id} to re-register at version {start + 3}")
        serving(start + 3, resumed, worker=stuck_id, count=2)
        # Its stream was closed (fenced, lease gone): it registered again and caught up.
        rejoin = [(e["event"], e.get("version")) for e in fleet.log_events(stuck_id)
                  if log_time(e) >= resumed]
        assert ("sync.registered", None) in rejoin
        assert ("agent.catching_up", start + 3) in rejoin

        updates.append(update(client, "async"))
        assert updates[-1].state.acked_workers == WORKERS  # the rejoined worker acks again
        serving(start + 4, updates[-1].committed)
        scheduler.pause()

    assert scheduler.errors == []
    assert [u.state.fenced_workers for u in updates] == [(), (), (stuck_id,), ()]
    assert [u.state.version for u in updates] == [start + 1, start + 2, start + 3, start + 4]
    check_served(fleet.served)
    check_no_generation_between_drained_and_applied(fleet, scheduler.served, updates)


def test_redis_crash_between_begin_and_commit_loses_no_version_and_no_rollout(
    fleet: Fleet,
) -> None:
    with CoordinatorClient(fleet.target) as client, Router(fleet) as scheduler:
        version, began = client.policy().version, time.time()
        scheduler.wait_served(f"at version {version}", lambda s: s.start > began
                              and s.generation.policy_version == version, count=8)
        served = len(scheduler.served)
        eventually(lambda: len(list(client.rollouts())) >= served,
                   f"at least {served} rollout records")
        client.begin_policy_update(version, mode="sync")
        # Every APPLIED ack is in Redis before it crashes: losing them would fence everyone.
        eventually(lambda: {v for v, _s in fleet.states(client).values()} == {version + 1},
                   f"every worker to apply version {version + 1}")
        before = {r.rollout_id: r for r in client.rollouts()}
        fleet.redis.restart(hard=True)  # SIGKILL: only what AOF fsynced survives
        committed = commit_retrying(client, version + 1, timeout=3.0)
        assert (committed.version, committed.phase) == (version + 1, "serving")
        assert committed.fenced_workers == ()
        state = client.policy()
        assert (state.version, state.phase, state.target_version) == (version + 1, "serving",
                                                                      None)
        after = {r.rollout_id: r for r in client.rollouts()}
        assert {k: after.get(k) for k in before} == before
        for worker_id in WORKERS:  # nobody was left drained or fenced by the crash
            scheduler.wait_served(f"at version {version + 1} by {worker_id}",
                                  served_by(worker_id, version + 1), count=2)
        scheduler.pause()
    check_served(fleet.served)
