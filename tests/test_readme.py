"""The README's examples run as written: its shell lines start the fleet (ports swapped for free
ones), then every Python block and every remaining shell line runs against it and exits 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.client import CoordinatorClient
from kvcoord import child_process
from kvcoord.demo import free_port, wait_healthy

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
COORDINATOR, WORKER, WORKER_HTTP = "127.0.0.1:50051", "127.0.0.1:7001", "127.0.0.1:8001"
ENV = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
       "KVCOORD_HEARTBEAT_MS": "300", "KVCOORD_LOG_LEVEL": "warning"}


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def shell_lines() -> list[str]:
    lines = [line.split("#", 1)[0].strip() for block in blocks("bash") for line in
             block.splitlines()]
    return [line for line in lines if line]


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, str]]:
    ports = {COORDINATOR: f"127.0.0.1:{free_port()}", WORKER: f"127.0.0.1:{free_port()}",
             WORKER_HTTP: f"127.0.0.1:{free_port()}"}
    started: list[subprocess.Popen[bytes]] = []
    try:
        for line in shell_lines():
            if line.endswith("&"):
                started.append(child_process.start(
                    substitute(line.rstrip("&").strip(), ports), shell=True, env=ENV, cwd=ROOT,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                ))
        assert len(started) == 2, "the README should start a coordinator and a worker"
        wait_healthy(ports[COORDINATOR], started[0])
        with CoordinatorClient(ports[COORDINATOR]) as client:
            deadline = time.monotonic() + 30
            while [w.state for w in client.workers()] != ["ready"]:
                assert time.monotonic() < deadline, "the README's worker never became ready"
                time.sleep(0.1)
        yield ports
    finally:
        for process in started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in started:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


def substitute(text: str, ports: dict[str, str]) -> str:
    for written, actual in ports.items():
        text = text.replace(written, actual)
    return text


def test_readme_shows_the_two_commands() -> None:
    assert "make demo" in README and "make test" in README


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_python_examples_run(fleet: dict[str, str], index: int) -> None:
    code = substitute(blocks("python")[index], fleet)
    result = child_process.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, timeout=60,
                            capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]


def test_shell_examples_run(fleet: dict[str, str]) -> None:
    commands = [line for line in shell_lines() if not line.endswith("&")]
    assert commands
    for command in commands:
        result = child_process.run(substitute(command, fleet), shell=True, cwd=ROOT, env=ENV,
                                timeout=60, capture_output=True, text=True,
                                stdin=subprocess.DEVNULL)
        assert result.returncode == 0, f"{command}: {result.stderr[-2000:]}"
