"""``kvcoord up``: a whole local fleet, a demo workload through the SDK, and a report.

What it does, in order:

1. Starts a fresh fleet (``kvcoord coordinator``, embedded store unless ``--redis``, and
   ``--workers`` ``kvcoord worker`` processes on free ports, each in its own process group and
   with its OpenAI endpoint, running the ``--model-size`` reference model) and waits until the
   coordinator is healthy and every worker is ``ready`` at it, then warms each worker up with
   one request that caches nothing.
2. Runs the workload of ``kvcoord.demo_workload`` with ``routing_policy="round_robin"``, then
   stops that fleet.
3. Starts a second fresh fleet and runs the very same workload with ``kv_aware``. Fresh fleets
   (empty caches, policy v0 on the embedded store, the same warm-up) are what make the two
   passes comparable: the same prompts, in the same shapes, against cold workers.
4. Prints the report (stdout; progress goes to stderr). With ``--keep-running`` the kv_aware
   fleet keeps serving: its addresses are printed on a line starting ``serving:`` and it runs
   until Ctrl-C/SIGTERM (or until one of its processes dies: exit 1).

Teardown contract: whatever ends the run (the end, Ctrl-C, SIGTERM, SIGHUP, an exception), every
process started is SIGTERMed by process group, SIGKILLed after a grace period, and reaped before
``run_up`` returns; a second Ctrl-C during teardown is ignored. Exit status: 0, 1 on a fleet or
workload failure (the logs are kept and their folder printed), 128 + signal number when
interrupted.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TextIO

from coordinator.client.errors import KvcoordError
from kvcoord.demo_workload import SCALES, PassResult, WorkloadError, WorkloadSpec, run_pass
from kvcoord.fleet_procs import FleetError, LocalFleet
from kvcoord.progress import Progress
from kvcoord.up_report import render_report
from worker.config import MODEL_SIZE_NAMES

HEADLINE_POLICY = "kv_aware"
CONTRAST_POLICY = "round_robin"
# Why so few pages (4,096 tokens at 16 per page): a production worker's KV pool is smaller than
# its fleet's working set, which is exactly when routing decides what gets reused. With the
# worker's default (1,024 pages) every worker would cache the whole demo workload.
DEMO_PAGES = 256
# Why not the worker's default (tiny): its prefill costs next to nothing, so a prefix hit saves
# no time and the demo could show tokens saved but not the time to first token they buy.
DEMO_MODEL_SIZE = "small"
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """A handled signal arrived; ``signum`` says which (exit status 128 + signum)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass(frozen=True, slots=True)
class UpOptions:
    """``kvcoord up``'s flags. ``pidfile`` receives the pid of every process started, one per
    line, as it starts (tests and scripts use it to check nothing is left behind)."""

    workers: int = 3
    redis: str | None = None
    keep_running: bool = False
    serve: bool = False
    """Keep the last fleet running behind a ``kvcoord gateway`` (workers with HTTP endpoints)."""
    spec: WorkloadSpec = field(default_factory=lambda: WorkloadSpec.for_requests(
        SCALES["default"]))
    device: str = "cpu"
    pages: int = DEMO_PAGES
    model_size: str = DEMO_MODEL_SIZE
    pidfile: Path | None = None

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.pages < 1:
            raise ValueError(f"--pages must be >= 1, got {self.pages}")
        if self.model_size not in MODEL_SIZE_NAMES:
            raise ValueError(f"--model-size must be one of {MODEL_SIZE_NAMES}, "
                             f"got {self.model_size!r}")


@contextmanager
def _signals_raise() -> Iterator[None]:
    """Within the block, SIGINT/SIGTERM/SIGHUP raise ``Interrupted`` in the main thread."""
    def handler(signum: int, _frame: FrameType | None) -> None:
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, handler) for sig in HANDLED_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextmanager
def _signals_ignored() -> Iterator[None]:
    """Teardown must finish: a second Ctrl-C must not leave half the fleet running."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in HANDLED_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def run_up(options: UpOptions, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Run ``kvcoord up`` (module docstring); returns the exit status. Main thread only."""
    log_dir = Path(tempfile.mkdtemp(prefix="kvcoord-up-"))
    if options.pidfile is not None:
        options.pidfile.write_text("")
    fleets: list[LocalFleet] = []
    status = 1
    try:
        with _signals_raise():
            status = _run(options, fleets, log_dir, out, err)
    except Interrupted as exc:
        print(f"\nkvcoord up: {exc} received, stopping the fleet", file=err, flush=True)
        status = 128 + exc.signum
    except (FleetError, WorkloadError, KvcoordError) as exc:
        print(f"\nkvcoord up: {type(exc).__name__}: {exc}", file=err, flush=True)
    finally:
        with _signals_ignored():
            for fleet in reversed(fleets):
                fleet.stop()
        if status == 1:
            print(f"kvcoord up: process logs kept in {log_dir}", file=err, flush=True)
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
    return status


def _run(options: UpOptions, fleets: list[LocalFleet], log_dir: Path, out: TextIO,
         err: TextIO) -> int:
    spec = options.spec
    store = f"redis {options.redis}" if options.redis else "embedded store"
    print(f"kvcoord up: coordinator ({store}) + {options.workers} reference workers "
          f"(model {options.model_size}), {spec.requests} requests per routing policy",
          file=err, flush=True)
    progress = Progress(2 * spec.requests, stream=err)
    stop = threading.Event()
    passes: dict[str, PassResult] = {}
    try:
        for policy in (CONTRAST_POLICY, HEADLINE_POLICY):
            progress.set_phase(f"{policy}: starting a fresh fleet")
            fleet = LocalFleet(options.workers, log_dir / policy, redis=options.redis,
                               device=options.device, pages=options.pages,
                               model_size=options.model_size, pidfile=options.pidfile,
                               http=True)
            fleet.log_dir.mkdir()
            fleets.append(fleet)
            fleet.start()
            passes[policy] = run_pass(fleet.coordinator_target, policy, spec, progress, stop)
            if policy != HEADLINE_POLICY:
                progress.set_phase(f"{policy}: stopping its fleet")
                fleet.stop()
        progress.set_phase("done")
    finally:
        stop.set()
        progress.close()
    fleet = fleets[-1]
    how = (f"each policy ran on a fresh fleet (new coordinator and workers running the "
           f"{options.model_size!r} reference model, empty caches of {options.pages} pages each, "
           f"the same warm-up) with identical prompts.")
    if options.redis:
        how += " The policy version lives in Redis: the second fleet starts where the first ended."
    report = render_report(spec, list(fleet.worker_addresses),
                           [passes[HEADLINE_POLICY], passes[CONTRAST_POLICY]], how)
    print(report, file=out, flush=True)
    if options.serve:
        fleet.start_gateway()
    if options.keep_running or options.serve:
        _serve_until_signal(fleet, out)
    return 0


def _serve_until_signal(fleet: LocalFleet, out: TextIO) -> None:
    """Print the fleet's addresses, then wait; FleetError if one of its processes exits."""
    workers = " ".join(f"{w}={a}" for w, a in fleet.worker_addresses.items())
    target = fleet.coordinator_target
    gateway = f" gateway={fleet.gateway_url}" if fleet.gateway_url else ""
    print(f"\nserving: coordinator={target} {workers}{gateway}", file=out)
    if fleet.gateway_url:
        url = fleet.gateway_url
        print(f"gateway: {url}/v1 (OpenAI-compatible; any api key)\n"
              f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' "
              "-d '{\"model\": \"default\", \"messages\": [{\"role\": \"user\", "
              "\"content\": \"hi\"}], \"max_tokens\": 8}'\n"
              f"  python -c 'from openai import OpenAI; c = OpenAI(base_url=\"{url}/v1\", "
              "api_key=\"x\"); r = c.chat.completions.create(model=\"default\", "
              "messages=[{\"role\": \"user\", \"content\": \"hi\"}], max_tokens=8); "
              "print(r.choices[0].message.content, r.usage)'", file=out)
    print(f"  kvcoord status --coordinator {target}\n"
          f"  kvcoord route --random 300 --coordinator {target}\n"
          f"stop: Ctrl-C (or kill -INT {os.getpid()}); every process above is stopped with it",
          file=out, flush=True)
    while True:
        fleet.check_alive()
        time.sleep(0.5)
