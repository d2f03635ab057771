"""Real processes: a ``kvcoord coordinator`` and two ``kvcoord worker`` processes, one of them
with a host tier (``--pages 8 --host-pages 32``).

The coordinator's index follows each page down to the host tier and back (one tier per worker
and key), Lookup answers the matched tokens per tier, a route for a prompt held in host memory
goes to the worker that holds it, the OpenAI endpoint reports the host part of its cached
tokens (the official ``openai`` client reads it), ``kvcoord status`` shows pages per tier, and a
coordinator restarted from scratch gets the tiers back from the worker's inventory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from openai import OpenAI

from coordinator.client import CoordinatorClient
from kvcoord import child_process
from kvcoord.demo import free_port, start_coordinator_process, stop_process, wait_healthy
from tests.test_worker_fleet import ENV, PAGE, Fleet, eventually
from worker.client import WorkerClient

pytestmark = pytest.mark.slow

A = [(11 * i + 5) % 500 for i in range(4 * PAGE + 8)]  # 4 full pages and a partial one
B = [(13 * i + 1) % 500 for i in range(6 * PAGE)]  # needs 7 of w0's 8 device pages


@pytest.fixture
def fleet() -> Iterator[tuple[Fleet, int]]:
    port = free_port()
    fleet = Fleet(port, start_coordinator_process(port, env=ENV))
    http_port = free_port()
    try:
        wait_healthy(fleet.target, fleet.coordinator)
        for worker_id, extra in (
            ("w0", ["--pages", "8", "--host-pages", "32",
                    "--http-listen", f"127.0.0.1:{http_port}"]),
            ("w1", ["--pages", "64"]),
        ):
            worker_port = free_port()
            process = child_process.start(
                [sys.executable, "-m", "kvcoord.cli", "worker", "--coordinator", fleet.target,
                 "--listen", f"127.0.0.1:{worker_port}", "--worker-id", worker_id,
                 "--device", "cpu", "--log-level", "warning", *extra],
                env={**os.environ, **ENV}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            )
            fleet.workers[worker_id] = (worker_port, process)
        for worker_id, (worker_port, process) in fleet.workers.items():
            wait_healthy(f"127.0.0.1:{worker_port}", process, timeout=60.0)
            with fleet.worker_client(worker_id) as client:
                eventually(lambda c=client: c.stats().synced, f"{worker_id} synced")
        yield fleet, http_port
    finally:
        for _port, process in fleet.workers.values():
            stop_process(process)
        stop_process(fleet.coordinator)


def tiers(coordinator: CoordinatorClient, prompt: list[int]) -> dict[str, int]:
    return coordinator.lookup(prompt).tiers.get("w0", {})


def test_pages_move_down_and_back_up_in_the_index_and_routes_follow_them(
    fleet: tuple[Fleet, int],
) -> None:
    fleet_, http_port = fleet
    w0: WorkerClient
    with fleet_.worker_client("w0") as w0, CoordinatorClient(fleet_.target) as coordinator:
        assert w0.stats().host_total_pages == 32
        w0.generate(A, 4)
        eventually(lambda: tiers(coordinator, A) == {"gpu": 64, "cpu": 0, "disk": 0},
                   "A's 4 pages indexed on w0's device")
        w0.generate(B, 4)  # 3 of A's pages (tails first) move to w0's host tier
        eventually(lambda: tiers(coordinator, A) == {"gpu": 16, "cpu": 48, "disk": 0},
                   "A's pages 1-3 indexed in w0's host tier")
        assert coordinator.lookup(A).matches == {"w0": 64}
        # Once w0's heartbeat says it is idle again (B's run counted as load until then), the
        # copy back beats recomputing 48 tokens on idle w1, which holds nothing.
        eventually(lambda: [(w.running_requests, w.free_pages) for w in coordinator.workers()
                            if w.worker_id == "w0"] == [(0, 1)], "w0's idle heartbeat")
        assert coordinator.route(A).worker_id == "w0"

        status = child_process.run(
            [sys.executable, "-m", "kvcoord.cli", "status", "--coordinator", fleet_.target,
             "--json"], capture_output=True, text=True, timeout=60, check=True)
        rows = {w["worker_id"]: w for w in json.loads(status.stdout)["workers"]}
        assert (rows["w0"]["host_pages"], rows["w0"]["cached_cpu_pages"]) == (32, 3)
        assert rows["w1"]["host_pages"] == 0

        # The OpenAI endpoint: A again, as token ids, through the official client.
        api = OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused",
                     max_retries=0)
        answer = api.completions.create(model="default", prompt=A, max_tokens=2)
        assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
        details = answer.usage.prompt_tokens_details
        assert details.cached_tokens == 64
        assert (details.model_extra or {}).get("host_cached_tokens") == 48
        eventually(lambda: tiers(coordinator, A) == {"gpu": 64, "cpu": 0, "disk": 0},
                   "A's pages back on w0's device in the index")
        assert w0.stats().host_cached_prompt_tokens == 48

        # B went down in its turn; a coordinator restarted from scratch learns both tiers
        # from w0's inventory.
        before = tiers(coordinator, B)
        assert before["cpu"] > 0
    fleet_.restart_coordinator()
    with CoordinatorClient(fleet_.target) as coordinator:
        eventually(lambda: tiers(coordinator, B) == before and
                   tiers(coordinator, A)["gpu"] == 64,
                   "the restarted coordinator to hold w0's pages in their tiers", timeout=30.0)
