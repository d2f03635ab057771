"""The engines bench's processes: each in its own session with its output in a log file,
started on loopback only, polled with bounded waits that name what they wait for, stopped
SIGTERM-then-SIGKILL by process group (``kvcoord.child_process.stop_processes``).

A process started here is started by ``kvcoord.child_process``, with a death signal, so a
bench killed with SIGKILL still takes its engines with it. An engine is pinned to one core twice:
the whole process tree by ``taskset`` (``os.sched_setaffinity`` where it is missing), and
vLLM's OpenMP threads by ``VLLM_CPU_OMP_THREADS_BIND`` (vLLM's CPU docs: the cores a rank's
OpenMP threads are bound to).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import psutil

from kvcoord import child_process
from kvcoord.child_process import stop_processes

Result = TypeVar("Result")

POLL_S = 0.2
STOP_GRACE_S = 20.0  # vLLM stops its engine core and model worker before it exits
LOG_TAIL_CHARS = 4000


class EnginesError(RuntimeError):
    """A process exited or did not become ready in time (the message names it and what was
    awaited, with its log tail)."""


@dataclass(frozen=True, slots=True)
class Proc:
    """One started process: ``name`` for messages, its output (stdout and stderr) in ``log``."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return text[-chars:]


def start(name: str, argv: Sequence[str], *, env: Mapping[str, str], log_dir: Path,
          core: int | None = None) -> Proc:
    """Start ``argv`` in a new session with exactly ``env``, its output to
    ``log_dir/<name>.log``; pinned to ``core`` (with every process it starts) when given."""
    pin: list[str] = []
    taskset = shutil.which("taskset")
    if core is not None and taskset:
        pin = [taskset, "-c", str(core)]
    log = log_dir / f"{name}.log"
    with log.open("wb") as out:
        process = child_process.start(
            [*pin, *argv], env=dict(env), stdout=out, stderr=subprocess.STDOUT)
    if core is not None and not pin:
        # Before the interpreter is up: the children it forks later inherit the mask.
        os.sched_setaffinity(process.pid, {core})
    return Proc(name, process, log)


def stop(procs: Iterable[Proc], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM each one's process group, SIGKILL what outlives ``grace_s``; idempotent."""
    stop_processes([p.process for p in procs], grace=grace_s)


def wait_until(condition: Callable[[], bool], *, timeout_s: float, what: str,
               procs: Sequence[Proc]) -> None:
    """Poll ``condition`` until it holds; EnginesError naming ``what`` when ``timeout_s``
    runs out, or naming the process (with its log tail) when one of ``procs`` exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        for proc in procs:
            code = proc.process.poll()
            if code is not None:
                raise EnginesError(f"{proc.name} exited with status {code} while waiting for "
                                   f"{what}; its log ({proc.log}) ends:\n{proc.log_tail()}")
        if condition():
            return
        if time.monotonic() > deadline:
            raise EnginesError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(POLL_S)


def http_get(url: str, timeout_s: float = 5.0) -> bytes | None:
    """The body of a 200 answer to GET ``url``; None when refused or another status."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as answer:
            return bytes(answer.read()) if int(answer.status) == 200 else None
    except (urllib.error.URLError, OSError):
        return None


def http_post(url: str, body: bytes = b"", timeout_s: float = 30.0) -> bytes:
    """POST ``body`` (JSON when not empty) to ``url``; the answer's body. EnginesError on any
    failure."""
    headers = {"Content-Type": "application/json"} if body else {}
    request = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            return bytes(answer.read())
    except (urllib.error.URLError, OSError) as exc:
        raise EnginesError(f"POST {url}: {exc}") from exc


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", re.MULTILINE)


def metric_samples(text: str, name: str) -> dict[str, float]:
    """Every sample of metric ``name`` in Prometheus text: labels (as written) -> value."""
    return {labels or "": float(value) for metric, labels, value in _SAMPLE.findall(text)
            if metric == name}


def metric_sum(url: str, name: str) -> float:
    """The sum of ``name``'s samples at ``url`` (0.0 when absent); EnginesError if the scrape
    fails."""
    body = http_get(url)
    if body is None:
        raise EnginesError(f"GET {url} failed")
    return sum(metric_samples(body.decode(), name).values())


def cpu_seconds(procs: Iterable[Proc]) -> float:
    """User + system CPU of the processes and every live descendant (psutil)."""
    return sum(cpu_by_process(procs).values())


def cpu_by_process(procs: Iterable[Proc]) -> dict[str, float]:
    """Each process's user + system CPU with its live descendants' (psutil), by name."""
    out: dict[str, float] = {}
    for proc in procs:
        total = 0.0
        try:
            root = psutil.Process(proc.process.pid)
            for p in [root, *root.children(recursive=True)]:
                times = p.cpu_times()
                total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
        out[proc.name] = total
    return out


def kvcoord_env(hash_key: str) -> dict[str, str]:
    """This environment without its KVCOORD_* settings (a developer's coordinator or token must
    not leak in), and one hash key for the coordinator and the bridges."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCOORD_")}
    env["KVCOORD_HASH_KEY"] = hash_key
    return env


def kvcoord_argv(*args: str) -> list[str]:
    """``kvcoord ARGS`` from this interpreter."""
    return [sys.executable, "-m", "kvcoord.cli", *args]


def run_in_scratch(prefix: str, run: Callable[[Path], Result],
                   keep: Callable[[Result], bool] | None = None) -> Result:
    """``run(work)`` in a new temporary directory, removed when it returns. When it raises,
    or ``keep(result)`` says so (a broken invariant, whose logs say why), the directory is
    kept and its logs' path printed. Meanwhile SIGTERM (a CI timeout, `kill`) unwinds like
    Ctrl-C, so the engines ``run`` started stop in order."""
    work = Path(tempfile.mkdtemp(prefix=f"kvcoord-bench-{prefix}-"))
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        result = run(work)
    except BaseException:
        print(f"{prefix}: the processes' logs are kept in {work / 'logs'}", file=sys.stderr)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    if keep is not None and keep(result):
        print(f"{prefix}: the processes' logs are kept in {work / 'logs'}", file=sys.stderr)
        return result
    shutil.rmtree(work, ignore_errors=True)
    return result


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
