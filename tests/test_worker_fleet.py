"""Real processes: a ``kvcoord coordinator`` and two ``kvcoord worker`` processes.

The coordinator's index must follow what the workers really cache: a prompt served twice by a
worker is reused from its pages and shows up in Lookup; a worker killed with SIGKILL gets no
route once its lease has run out; a coordinator restarted from scratch gets every worker's
inventory back through re-registration.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from coordinator.client import CoordinatorClient
from kvcoord import child_process
from kvcoord.demo import free_port, start_coordinator_process, stop_process, wait_healthy
from worker.client import WorkerClient

pytestmark = pytest.mark.slow

PAGE = 16
ENV = {
    "KVCOORD_LEASE_MS": "1500", "KVCOORD_HEARTBEAT_MS": "300",
    "KVCOORD_REAPER_INTERVAL_MS": "100", "KVCOORD_DROP_GRACE_MS": "3000",
    "KVCOORD_BACKOFF_MAX_MS": "500", "KVCOORD_PAGE_SIZE": str(PAGE),
}
PROMPT = [(7 * i + 3) % 500 for i in range(3 * PAGE + 5)]  # 3 full pages and a partial one


def start_worker_process(coordinator: str, port: int, worker_id: str) -> subprocess.Popen[bytes]:
    return child_process.start(
        [sys.executable, "-m", "kvcoord.cli", "worker", "--coordinator", coordinator,
         "--listen", f"127.0.0.1:{port}", "--worker-id", worker_id, "--pages", "64",
         "--device", "cpu", "--log-level", "warning"],
        env={**os.environ, **ENV}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )


def eventually(condition: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    """Poll ``condition`` (the awaited event happens in another process) within ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


@dataclass
class Fleet:
    coordinator_port: int
    coordinator: subprocess.Popen[bytes]
    workers: dict[str, tuple[int, subprocess.Popen[bytes]]] = field(default_factory=dict)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.coordinator_port}"

    def worker_client(self, worker_id: str) -> WorkerClient:
        return WorkerClient(f"127.0.0.1:{self.workers[worker_id][0]}", timeout=20.0)

    def restart_coordinator(self) -> None:
        os.killpg(self.coordinator.pid, signal.SIGKILL)
        self.coordinator.wait()
        self.coordinator = start_coordinator_process(self.coordinator_port, env=ENV)
        wait_healthy(self.target, self.coordinator)


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    port = free_port()
    fleet = Fleet(port, start_coordinator_process(port, env=ENV))
    try:
        wait_healthy(fleet.target, fleet.coordinator)
        for worker_id in ("w0", "w1"):
            worker_port = free_port()
            process = start_worker_process(fleet.target, worker_port, worker_id)
            fleet.workers[worker_id] = (worker_port, process)
        for worker_id, (worker_port, process) in fleet.workers.items():
            wait_healthy(f"127.0.0.1:{worker_port}", process, timeout=60.0)
            with fleet.worker_client(worker_id) as client:
                eventually(lambda c=client: c.stats().synced, f"{worker_id} synced")
        yield fleet
    finally:
        for _port, process in fleet.workers.values():
            stop_process(process)
        stop_process(fleet.coordinator)


def test_prompt_served_twice_reuses_every_full_page_and_lookup_shows_the_worker(
    fleet: Fleet,
) -> None:
    with fleet.worker_client("w0") as w0, CoordinatorClient(fleet.target) as coordinator:
        first = w0.generate(PROMPT, 4)
        second = w0.generate(PROMPT, 4)
        assert (first.cached_tokens, first.computed_tokens) == (0, len(PROMPT))
        assert second.cached_tokens == 3 * PAGE
        assert second.tokens == first.tokens
        eventually(lambda: coordinator.lookup(PROMPT).matches == {"w0": 3 * PAGE},
                   "Lookup to show w0 holding the prompt's full pages")
        route = coordinator.route(PROMPT)
        assert (route.worker_id, route.matched_tokens) == ("w0", 3 * PAGE)


def test_killed_worker_gets_no_route_once_its_lease_has_run_out(fleet: Fleet) -> None:
    with fleet.worker_client("w1") as w1, CoordinatorClient(fleet.target) as coordinator:
        w1.generate(PROMPT, 2)
        eventually(lambda: "w1" in coordinator.lookup(PROMPT).matches, "w1 indexed")
        os.killpg(fleet.workers["w1"][1].pid, signal.SIGKILL)
        fleet.workers["w1"][1].wait()
        eventually(lambda: "w1" not in coordinator.lookup(PROMPT).matches,
                   "w1 to leave Lookup", timeout=5.0)
        routes = [coordinator.route(PROMPT, routing_policy="round_robin") for _ in range(8)]
        assert {r.worker_id for r in routes} == {"w0"}
        states = {w.worker_id: w.state for w in coordinator.workers()}
        assert states["w0"] == "ready" and states.get("w1", "gone") in ("disconnected", "gone")


def test_restarted_coordinator_gets_the_worker_inventory_back(fleet: Fleet) -> None:
    with fleet.worker_client("w0") as w0:
        w0.generate(PROMPT, 4)
        fleet.restart_coordinator()
        with CoordinatorClient(fleet.target) as coordinator:
            eventually(lambda: coordinator.lookup(PROMPT).matches.get("w0") == 3 * PAGE,
                       "w0's pages indexed again by the new coordinator")
            eventually(lambda: {w.worker_id for w in coordinator.workers()} == {"w0", "w1"},
                       "both workers registered again")
        again = w0.generate(PROMPT, 4)
        assert again.cached_tokens == 3 * PAGE
