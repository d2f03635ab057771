"""``kvcoord up`` as a user runs it: a real fleet of subprocesses, the report, and teardown.

Every process ``up`` starts is listed in its ``--pidfile``; after ``up`` exits, none of them (and
nothing in their sessions: each runs in its own) may be alive.
"""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import pytest

from coordinator.client import CoordinatorClient
from kvcoord import child_process

pytestmark = pytest.mark.slow

KVCOORD = [sys.executable, "-m", "kvcoord.cli"]
WORKERS = 2
# The smallest sizes: the demo's own model (small) makes a prefill cost; here only the
# plumbing and the report are under test, so the tiny one keeps these tests fast.
SMALLEST = ["--workers", str(WORKERS), "--scale", "small", "--model-size", "tiny"]
PROCESSES_PER_FLEET = 1 + WORKERS  # a coordinator and its workers; one fleet per policy


def sessions_alive(pids: list[int]) -> list[str]:
    """Processes still alive (zombies aside) that are one of ``pids`` or in their sessions."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # Fields after the parenthesised command: state ppid pgrp session ...
        fields = stat[stat.rindex(")") + 2:].split()
        state, session = fields[0], int(fields[3])
        if state != "Z" and (int(entry.name) in pids or session in pids):
            alive.append(f"{entry.name} (session {session}): {stat[:80]}")
    return alive


def read_pids(pidfile: Path) -> list[int]:
    return [int(line) for line in pidfile.read_text().split()]


def row(report: str, label: str) -> list[str]:
    """The cells of the summary row ``label`` (two columns: kv_aware, round_robin)."""
    for line in report.splitlines():
        if line.startswith(label + "  "):
            return re.split(r"\s{2,}", line[len(label):].strip())
    raise AssertionError(f"no {label!r} row in:\n{report}")


def test_up_runs_the_demo_prints_the_report_and_leaves_no_process(tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    done = child_process.run(
        [*KVCOORD, "up", *SMALLEST, "--pidfile", str(pidfile)],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=90,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = done.stdout
    requests = [int(n) for n in row(report, "requests")]
    assert requests[0] == requests[1] > 0
    chats, grpo = (list(map(int, row(report, label))) for label in ("  chat turns",
                                                                     "  GRPO samples"))
    assert [c + g for c, g in zip(chats, grpo, strict=True)] == requests and min(grpo) > 0
    prompt = [int(n) for n in row(report, "prompt tokens")]
    computed = [int(n) for n in row(report, "prefill computed")]
    cached = [int(n) for n in row(report, "prefill from cache")]
    assert prompt[0] == prompt[1], "both policies must see the very same prompts"
    for i in range(2):
        assert 0 < cached[i] < prompt[i] <= computed[i] + cached[i]
    kv_hit, rr_hit = (float(cell.rstrip("%")) for cell in row(report, "hit ratio"))
    assert kv_hit > rr_hit
    # TTFT at the client, per policy, overall and per kind of request ("p50 / p99").
    p50s, p99s = (list(map(float, row(report, f"TTFT p{q} (ms)"))) for q in (50, 99))
    assert len(p50s) == len(p99s) == 2
    assert all(0 < p50 <= p99 for p50, p99 in zip(p50s, p99s, strict=True))
    for label in ("  chat turns p50 / p99", "  GRPO samples p50 / p99"):
        for cell in row(report, label):
            low, high = map(int, cell.split(" / "))
            assert 0 <= low <= high <= max(p99s) + 1, (label, cell)
    assert all(float(cell) > 0 for cell in row(report, "GRPO rounds (s)"))
    verdict = report.splitlines()[-1]
    assert re.fullmatch(r"kv_aware computed \d+ (fewer|more) prefill tokens than round_robin "
                        r"\(\d+% (less|more)\) on the same requests; its TTFT was p50 \d+ "
                        r"against \d+ ms, p99 \d+ against \d+ ms\.", verdict), verdict
    assert row(report, "policy versions seen") == ["v0, v1", "v0, v1"]
    per_worker = {line.split()[0]: line.split()[1:] for line in report.splitlines()
                  if re.match(r"w\d+ ", line)}
    assert set(per_worker) == {"w0", "w1"}
    for policy in range(2):  # columns: req, prompt, computed per policy
        assert sum(int(cells[3 * policy]) for cells in per_worker.values()) == requests[policy]
    assert "\r" not in done.stderr, "stderr is not a TTY: progress must be plain lines"
    pids = read_pids(pidfile)
    assert len(pids) == 2 * PROCESSES_PER_FLEET
    assert sessions_alive(pids) == []


def test_ctrl_c_on_a_kept_running_fleet_stops_every_process(tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    up = child_process.start(
        [*KVCOORD, "up", *SMALLEST, "--keep-running",
         "--pidfile", str(pidfile)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        serving = wait_for_line(up, "serving:", timeout=60)
        addresses = dict(pair.split("=", 1) for pair in serving.split()[1:])
        assert set(addresses) == {"coordinator", "w0", "w1"}
        with CoordinatorClient(addresses["coordinator"]) as client:
            workers = {w.worker_id: (w.address, w.state) for w in client.workers()}
        assert workers == {w: (addresses[w], "ready") for w in ("w0", "w1")}
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=20) in (0, 130)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    pids = read_pids(pidfile)
    assert len(pids) == 2 * PROCESSES_PER_FLEET
    assert sessions_alive(pids) == []


def wait_for_line(process: subprocess.Popen[str], prefix: str, timeout: float) -> str:
    """The first stdout line starting with ``prefix``; AssertionError on exit or timeout.
    A reader thread keeps reading so the report never fills the pipe."""
    assert process.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()

    def pump(stream: IO[str]) -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, args=(process.stdout,), daemon=True).start()
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no {prefix!r} line within {timeout}s") from None
        if line is None:
            raise AssertionError(f"kvcoord up exited ({process.wait()}) before {prefix!r}")
        if line.startswith(prefix):
            return line.strip()


def test_up_serve_keeps_the_fleet_behind_a_gateway_an_openai_client_uses(
    tmp_path: Path,
) -> None:
    from openai import OpenAI

    pidfile = tmp_path / "pids"
    up = child_process.start(
        [*KVCOORD, "up", *SMALLEST, "--serve",
         "--pidfile", str(pidfile)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        serving = wait_for_line(up, "serving:", timeout=90)
        addresses = dict(pair.split("=", 1) for pair in serving.split()[1:])
        assert set(addresses) == {"coordinator", "w0", "w1", "gateway"}
        client = OpenAI(base_url=f"{addresses['gateway']}/v1", api_key="x", max_retries=0)
        chat = [{"role": "user", "content": "Which worker holds this conversation? " * 6}]
        first = client.chat.completions.create(model="default", messages=chat, max_tokens=4)
        with CoordinatorClient(addresses["coordinator"]) as coordinator:
            deadline = time.monotonic() + 10  # the first route reported finished (heartbeat)
            while any(w.inflight_routes for w in coordinator.workers()):
                assert time.monotonic() < deadline
                time.sleep(0.02)
        again = client.chat.completions.create(model="default", messages=chat, max_tokens=4)
        assert first.usage is not None and again.usage is not None
        assert again.usage.prompt_tokens_details.cached_tokens > 0  # reuse, visible in usage
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=30) in (0, 130)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    pids = read_pids(pidfile)
    assert len(pids) == 2 * PROCESSES_PER_FLEET + 1  # both fleets, and the gateway
    assert sessions_alive(pids) == []
