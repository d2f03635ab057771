"""Local fleet processes: a ``kvcoord coordinator`` and N ``kvcoord worker`` subprocesses.

Every process is started in its own session (so its process group id is its pid and the
terminal's Ctrl-C reaches only the launcher, which then tears the groups down in order) and, on
Linux, with ``PR_SET_PDEATHSIG`` so that even a launcher killed with SIGKILL takes its children
with it. Teardown is SIGTERM to each process group (the graceful path: workers deregister and
drain), then SIGKILL to whatever outlives the grace period; it is idempotent.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.client import CoordinatorClient
from kvcoord import child_process
from worker.client import WorkerClient

# Why a shorter heartbeat than the coordinator's 2 s default: in-flight accounting and worker
# load reach the router with each heartbeat, and the demo's bursts last well under 2 s.
FLEET_ENV = {"KVCOORD_HEARTBEAT_MS": "250"}
STOP_GRACE_S = 5.0


class FleetError(RuntimeError):
    """A fleet process exited or did not become healthy/ready in time (message: its log tail)."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (another process may still take it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn(args: Sequence[str], *, env: Mapping[str, str] | None = None,
          stderr: IO[bytes] | int | None = subprocess.PIPE) -> subprocess.Popen[bytes]:
    """``python -m kvcoord.cli ARGS`` in a new session (own process group), stdout discarded."""
    return child_process.start(
        [sys.executable, "-m", "kvcoord.cli", *args],
        env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=stderr,
    )


def start_coordinator_process(
    port: int, *extra_args: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """``kvcoord coordinator`` on 127.0.0.1:``port`` (embedded store unless ``--redis`` is in
    ``extra_args``), logging warnings and up to a pipe, in its own process group."""
    return spawn(["coordinator", "--listen", f"127.0.0.1:{port}", "--log-level", "warning",
                  *extra_args], env=env)


def wait_healthy(target: str, process: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """Block until ``target``'s gRPC health answers SERVING; RuntimeError when ``process``
    exits first (with its stderr tail if it was piped), TimeoutError when time runs out."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                err = process.stderr.read().decode() if process.stderr else ""
                raise RuntimeError(f"process exited with {process.returncode}: {err[-2000:]}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                time.sleep(0.1)
    raise TimeoutError(f"{target} not healthy after {timeout}s")


@dataclass
class LocalFleet:
    """A coordinator plus ``workers`` reference workers on free 127.0.0.1 ports.

    ``start()`` returns once the coordinator is healthy and every worker is ``ready`` at it;
    on any failure it stops what it started and raises ``FleetError``. ``stop()`` stops workers
    first (they deregister while the coordinator is still up), then the coordinator. Each
    process's stderr goes to ``log_dir/<name>.log``; each pid is appended to ``pidfile``.
    """

    workers: int
    log_dir: Path
    redis: str | None = None
    device: str = "cpu"
    pages: int | None = None
    """KV pages per worker (None: the worker's default)."""
    pidfile: Path | None = None
    http: bool = False
    """Workers also serve their OpenAI endpoint (``--http-listen``, URLs in ``worker_urls``);
    ``start_gateway`` then puts a ``kvcoord gateway`` in front of them."""
    routing_policy: str | None = None
    """The coordinator's ``--routing-policy`` (None: its default, ``kv_aware``)."""
    model_size: str | None = None
    """The workers' ``--model-size`` (None: the worker's default, ``tiny``)."""
    coordinator_target: str = ""
    worker_addresses: dict[str, str] = field(default_factory=dict)
    worker_urls: dict[str, str] = field(default_factory=dict)
    """Worker id -> its OpenAI base URL (``http`` only)."""
    gateway_url: str = ""
    _coordinator: subprocess.Popen[bytes] | None = None
    _worker_procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _gateway: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        try:
            port = free_port()
            self.coordinator_target = f"127.0.0.1:{port}"
            extra = ["--redis", self.redis] if self.redis else []
            if self.routing_policy is not None:
                extra += ["--routing-policy", self.routing_policy]
            self._coordinator = self._spawn("coordinator", {}, [
                "coordinator", "--listen", self.coordinator_target, "--log-level", "warning",
                *extra])
            sizing = ["--pages", str(self.pages)] if self.pages is not None else []
            if self.model_size is not None:
                sizing += ["--model-size", self.model_size]
            # Why: torch sizes its thread pool to every core in each worker; N workers sharing
            # the cores then spin against each other (10x tail latency on 2 cores).
            threads = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // self.workers))}
            for i in range(self.workers):
                worker_id, address = f"w{i}", f"127.0.0.1:{free_port()}"
                self.worker_addresses[worker_id] = address
                http = []
                if self.http:
                    http_port = free_port()
                    http = ["--http-listen", f"127.0.0.1:{http_port}"]
                    self.worker_urls[worker_id] = f"http://127.0.0.1:{http_port}"
                self._worker_procs[worker_id] = self._spawn(worker_id, threads, [
                    "worker", "--coordinator", self.coordinator_target, "--listen", address,
                    "--worker-id", worker_id, "--device", self.device, "--log-level", "warning",
                    *sizing, *http])
            self._wait_ready(deadline)
            self._warm_up()
        except BaseException:
            self.stop()
            raise

    def _spawn(self, name: str, env: dict[str, str], args: list[str]) -> subprocess.Popen[bytes]:
        """Start one process; ``env`` and ``FLEET_ENV`` are defaults the caller's env overrides."""
        with (self.log_dir / f"{name}.log").open("ab") as log:
            process = spawn(args, env={**FLEET_ENV, **env, **os.environ}, stderr=log)
        if self.pidfile is not None:
            with self.pidfile.open("a") as out:
                out.write(f"{process.pid}\n")
        return process

    def _wait_ready(self, deadline: float) -> None:
        """Coordinator health first, then poll ListWorkers until all ``workers`` are ready."""
        assert self._coordinator is not None
        try:
            wait_healthy(self.coordinator_target, self._coordinator,
                         timeout=max(0.1, deadline - time.monotonic()))
        except (RuntimeError, TimeoutError) as exc:
            raise FleetError(f"coordinator: {exc}\n{self.log_tail('coordinator')}") from None
        with CoordinatorClient(self.coordinator_target, timeout=5.0) as client:
            while True:
                self.check_alive()
                ready = {w.worker_id for w in client.workers() if w.state == "ready"}
                if ready >= set(self.worker_addresses):
                    return
                if time.monotonic() > deadline:
                    missing = sorted(set(self.worker_addresses) - ready)
                    raise FleetError(f"workers not ready in time: {', '.join(missing)}\n"
                                     f"{self.log_tail(missing[0])}")
                time.sleep(0.1)

    def _warm_up(self) -> None:
        """One tiny generation per worker (and one through its OpenAI endpoint with ``http``),
        so no measured request pays for lazy start-up work. Prompt + completion stay under one
        page: nothing is cached or indexed."""
        for address in self.worker_addresses.values():
            with WorkerClient(address, timeout=30.0) as worker:
                worker.generate([1, 2, 3, 4], 2)
        body = json.dumps({"model": "default", "prompt": [1, 2, 3, 4], "max_tokens": 2,
                           "stream": True}).encode()
        for url in self.worker_urls.values():
            request = urllib.request.Request(f"{url}/v1/completions", body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as answer:
                answer.read()

    def start_gateway(self, timeout: float = 30.0) -> str:
        """Start ``kvcoord gateway`` in front of the fleet; its URL once ``/readyz`` says 200.
        FleetError if it exits or is not ready in time."""
        port = free_port()
        self._gateway = self._spawn("gateway", {}, [
            "gateway", "--coordinator", self.coordinator_target, "--listen",
            f"127.0.0.1:{port}", "--log-level", "warning"])
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            try:
                with urllib.request.urlopen(f"{url}/readyz", timeout=2) as answer:
                    if answer.status == 200:
                        self.gateway_url = url
                        return url
            except OSError:
                pass  # not listening yet, or 503 until a worker is routable
            if time.monotonic() > deadline:
                raise FleetError(f"gateway not ready in time\n{self.log_tail('gateway')}")
            time.sleep(0.1)

    def check_alive(self) -> None:
        """FleetError naming the first fleet process that has exited, with its log tail."""
        procs = {"coordinator": self._coordinator, **self._worker_procs,
                 "gateway": self._gateway}
        for name, process in procs.items():
            if process is not None and process.poll() is not None:
                raise FleetError(f"{name} exited with {process.returncode}\n"
                                 f"{self.log_tail(name)}")

    def log_tail(self, name: str, chars: int = 2000) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    @property
    def pids(self) -> list[int]:
        procs = [self._coordinator, *self._worker_procs.values(), self._gateway]
        return [p.pid for p in procs if p is not None]

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """The gateway, the workers (SIGTERM, then SIGKILL after ``grace``), then the
        coordinator. Idempotent."""
        if self._gateway is not None:
            child_process.stop_processes([self._gateway], grace)
        child_process.stop_processes(list(self._worker_procs.values()), grace)
        if self._coordinator is not None:
            child_process.stop_processes([self._coordinator], grace)
