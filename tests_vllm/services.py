"""The processes an engine test starts: each in its own session with all its output in a log
file, polled with bounded waits that name what they waited for, stopped SIGTERM-then-SIGKILL.

A process started here is a session leader, so its process group id is its pid and a stop
reaches the children it forked (vLLM's engine core and model worker). It is started by
``kvcoord.child_process``, with a death signal, so a test runner killed with SIGKILL still takes
its processes with it (tests_vllm/test_vllm_outlived.py).
"""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvcoord import child_process
from kvcoord.child_process import stop_processes

LOG_SECTIONS = pytest.StashKey[Callable[[], list[tuple[str, str]]]]()
"""``item.stash[LOG_SECTIONS]()``: ``(title, log text)`` of each process a test started;
``conftest.py`` adds them to the report of a failed setup or call."""

LOG_TAIL_CHARS = 30_000
POLL_S = 0.2


@dataclass(frozen=True)
class Service:
    """One started process: ``name`` for messages, its output (stdout and stderr) in ``log``."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return text if len(text) <= chars else f"[... {len(text) - chars} chars cut]\n" + \
            text[-chars:]


def start_service(name: str, argv: Sequence[str], *, env: Mapping[str, str], cwd: Path,
                  log_dir: Path) -> Service:
    """Start ``argv`` in a new session, in ``cwd``, with exactly ``env``; its output goes to
    ``log_dir/<name>.log``."""
    log = log_dir / f"{name}.log"
    with log.open("wb") as out:
        process = child_process.start(
            argv, env=dict(env), cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    return Service(name, process, log)


def stop_services(services: Sequence[Service], grace_s: float) -> None:
    """SIGTERM each one's process group, SIGKILL the groups still alive after ``grace_s`` in
    all, and reap them. Idempotent; services that already exited are only reaped."""
    stop_processes([s.process for s in services], grace=grace_s)


def wait_for(condition: Callable[[], bool], *, timeout_s: float, what: str,
             services: Sequence[Service]) -> None:
    """Poll ``condition`` until it holds. Fails the test with a message naming ``what`` when
    ``timeout_s`` runs out, or naming the service when one of ``services`` exits first (the
    message is the whole report: the logs follow it, a traceback would only bury them)."""
    deadline = time.monotonic() + timeout_s
    while True:
        for service in services:
            code = service.process.poll()
            if code is not None:
                pytest.fail(f"{service.name} exited with status {code} while waiting for "
                            f"{what}", pytrace=False)
        if condition():
            return
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}", pytrace=False)
        time.sleep(POLL_S)


def http_ok(url: str) -> bool:
    """Whether a GET of ``url`` answers 200 now (False when refused, or any other status)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return int(answer.status) == 200
    except (urllib.error.URLError, OSError):
        return False
