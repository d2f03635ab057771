"""The `kvcoord` command line as a user runs it: real subprocesses, real ports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from kvcoord import child_process
from kvcoord.demo import free_port, start_coordinator_process, stop_process, wait_healthy

KVCOORD = [sys.executable, "-m", "kvcoord.cli"]


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return child_process.run(
        [*KVCOORD, *args], capture_output=True, text=True, timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture
def coordinator_process() -> Iterator[str]:
    port = free_port()
    process = start_coordinator_process(port)
    target = f"127.0.0.1:{port}"
    try:
        wait_healthy(target, process)
        yield target
    finally:
        stop_process(process)


def test_status_route_and_lookup_against_a_running_coordinator(coordinator_process: str) -> None:
    status = run_cli("status", "--coordinator", coordinator_process, "--json")
    assert status.returncode == 0, status.stderr
    data = json.loads(status.stdout)
    assert data["workers"] == []
    assert (data["stats"]["policy_version"], data["stats"]["store"]) == (0, "MemoryStore")

    table = run_cli("status", "--coordinator", coordinator_process)
    assert table.returncode == 0
    assert "store=MemoryStore" in table.stdout and "worker" in table.stdout

    lookup = run_cli("route", "--coordinator", coordinator_process, "--random", "64", "--lookup",
                     "--json")
    assert lookup.returncode == 0, lookup.stderr
    assert json.loads(lookup.stdout) == {"matches": {}, "policy_version": 0, "prompt_pages": 4}

    # No worker registered: routing is refused with the status and a reason, exit code 1.
    route = run_cli("route", "--coordinator", coordinator_process, "--tokens", "1,2,3",
                    "--timeout", "1")
    assert route.returncode == 1
    assert "UNAVAILABLE" in route.stderr and "no routable worker" in route.stderr


def test_bad_flags_and_bad_tokens_exit_with_a_clear_message() -> None:
    bad_tokens = run_cli("route", "--tokens", "1,x,3")
    assert bad_tokens.returncode != 0
    assert "comma-separated integers" in bad_tokens.stderr
    bad_env = child_process.run(
        [*KVCOORD, "coordinator", "--listen", "127.0.0.1:0"], capture_output=True, text=True,
        env={**os.environ, "KVCOORD_LEASE_MS": "soon"}, timeout=30, stdin=subprocess.DEVNULL,
    )
    assert bad_env.returncode == 2
    assert "KVCOORD_LEASE_MS='soon' is not a valid int" in bad_env.stderr
    unreachable = run_cli("status", "--coordinator", f"127.0.0.1:{free_port()}")
    assert unreachable.returncode == 1
    assert "UNAVAILABLE" in unreachable.stderr


def test_coordinator_serves_metrics_and_exits_cleanly_on_sigterm() -> None:
    port, metrics_port = free_port(), free_port()
    process = child_process.start(
        [*KVCOORD, "coordinator", "--listen", f"127.0.0.1:{port}", "--metrics-port",
         str(metrics_port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
    )
    try:
        wait_healthy(f"127.0.0.1:{port}", process)
        run_cli("route", "--coordinator", f"127.0.0.1:{port}", "--random", "32", "--lookup")
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
        assert 'kvcoord_coordinator_requests_total{code="OK",method="Lookup"} 1.0' in body
        assert "kvcoord_index_keys 0.0" in body
        assert "kvcoord_lookups_total 1.0" in body
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
        logs = process.stderr.read().decode() if process.stderr else ""
        assert '"event": "coordinator.stopped"' in logs
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.redis
def test_coordinator_runs_on_redis(redis_url: str) -> None:
    port = free_port()
    process = start_coordinator_process(port, "--redis", redis_url)
    try:
        wait_healthy(f"127.0.0.1:{port}", process)
        status = run_cli("status", "--coordinator", f"127.0.0.1:{port}", "--json")
        assert json.loads(status.stdout)["stats"]["store"] == "RedisStore"
    finally:
        stop_process(process)


async def test_deregister_takes_a_worker_and_its_pages_out_at_once() -> None:
    import asyncio

    from bench.scripted_worker import ScriptedWorker
    from coordinator.client import AsyncCoordinatorClient
    from tests.coordinator_fixtures import DEV_HASH, running_coordinator, target

    async with running_coordinator() as coordinator:
        worker = ScriptedWorker(target(coordinator), "w-0", hash_config=DEV_HASH)
        await worker.start()
        await worker.store(worker.keys(list(range(32))))
        gone = await asyncio.to_thread(run_cli, "deregister", "--coordinator",
                                       target(coordinator), "--worker-id", "w-0")
        assert (gone.returncode, gone.stdout.strip()) == (0, "worker w-0: deregistered")
        async with AsyncCoordinatorClient(target(coordinator)) as client:
            assert await client.workers() == []
            assert (await client.lookup(list(range(32)))).matches == {}
        again = await asyncio.to_thread(run_cli, "deregister", "--coordinator",
                                        target(coordinator), "--worker-id", "w-0")
        assert (again.returncode, again.stdout.strip()) == (0, "worker w-0: not registered")
        await worker.close()


def test_a_coordinator_without_its_redis_exits_with_one_line() -> None:
    down = run_cli("coordinator", "--listen", "127.0.0.1:0", "--redis",
                   f"redis://127.0.0.1:{free_port()}/0")
    assert down.returncode == 1
    assert down.stderr.startswith("kvcoord coordinator: metadata store unavailable")
    assert "Traceback" not in down.stderr


def _answers_metrics(host: str, port: int) -> bool:
    """Whether ``host:port`` serves ``/metrics`` (False: connection refused). 127.0.0.2 is this
    machine's loopback too (Linux routes 127/8 to lo), but a socket bound to 127.0.0.1 does not
    answer on it, and one bound to 0.0.0.0 does."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as response:
            return b"kvcoord_" in response.read()
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ConnectionRefusedError):
            return False
        raise


@pytest.mark.parametrize(("extra", "served", "refused"), [
    ((), "127.0.0.1", "127.0.0.2"),
    (("--metrics-host", "127.0.0.2"), "127.0.0.2", "127.0.0.1"),
], ids=["listen-host", "metrics-host"])
def test_coordinator_and_worker_metrics_bind_the_listen_host_unless_told_otherwise(
    extra: tuple[str, ...], served: str, refused: str,
) -> None:
    port, metrics_port, worker_port, worker_metrics = (free_port() for _ in range(4))
    coordinator = child_process.start(
        [*KVCOORD, "coordinator", "--listen", f"127.0.0.1:{port}", "--metrics-port",
         str(metrics_port), *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    worker = None
    try:
        wait_healthy(f"127.0.0.1:{port}", coordinator)
        assert _answers_metrics(served, metrics_port)
        assert not _answers_metrics(refused, metrics_port)
        worker = child_process.start(
            [*KVCOORD, "worker", "--coordinator", f"127.0.0.1:{port}", "--listen",
             f"127.0.0.1:{worker_port}", "--device", "cpu", "--pages", "64",
             "--metrics-port", str(worker_metrics), *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        wait_healthy(f"127.0.0.1:{worker_port}", worker, timeout=60)
        assert _answers_metrics(served, worker_metrics)
        assert not _answers_metrics(refused, worker_metrics)
    finally:
        for process in (worker, coordinator):
            if process is not None:
                stop_process(process)


def test_a_metrics_host_that_cannot_be_bound_exits_2_with_one_line() -> None:
    refused = run_cli("coordinator", "--listen", f"127.0.0.1:{free_port()}", "--metrics-port",
                      str(free_port()), "--metrics-host", "203.0.113.5")
    assert refused.returncode == 2, refused.stderr
    lines = [line for line in refused.stderr.splitlines() if line.startswith("kvcoord")]
    assert len(lines) == 1 and lines[0].startswith(
        "kvcoord coordinator: cannot serve /metrics on 203.0.113.5:"), refused.stderr
    assert "(--metrics-host, --metrics-port)" in lines[0]
