"""The kvcoord fleet a fuzz campaign is aimed at: a ``kvcoord coordinator`` and a ``kvcoord
worker`` subprocess, with auth on, and a fake worker identity the campaign's Sync cases use."""

from __future__ import annotations

import secrets
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from coordinator.core.hashing import HashConfig
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from kvcoord.child_process import stop_processes
from kvcoord.fleet_procs import free_port, spawn, wait_healthy
from tests.fuzz_campaign import Endpoint, Metadata
from worker.v1 import worker_pb2 as wpb

# ---------------------------------------------------------------------------------- the fleet

FAKE_WORKER = "w0"
"""The worker identity the fuzz itself registers (again before every block, so its hello always
opens a stream). ``PLAIN`` strings name it: fuzzed Deregister, Cordon, Sync and ReportRollouts
calls find a worker, and whatever they do to it is undone for the next block."""
REAL_WORKER = "worker-1"
ROLES = ("admin", "scheduler", "trainer")


@dataclass
class FuzzFleet:
    """A ``kvcoord coordinator`` and one ``kvcoord worker`` subprocess (CPU, one torch thread)
    on free 127.0.0.1 ports, stderr logged under ``log_dir``. With ``auth``, both serve with an
    identities file (one identity per role in ``ROLES``, plus the worker's own) and a rate limit
    far above the campaign's pace. ``KVCOORD_ROUTE_WAIT_MS`` is 100: a fuzzed BeginPolicyUpdate
    may start a drain, and each route then waits at most that long, not 2 s."""

    log_dir: Path
    auth: bool = True
    tokens: dict[str, str] = field(default_factory=dict)
    coordinator_target: str = ""
    worker_target: str = ""
    _processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _hash: HashConfig | None = None
    _incarnation: int = 0
    _channel: grpc.Channel | None = None

    def __enter__(self) -> FuzzFleet:
        key = secrets.token_hex(32)
        self._hash = HashConfig.from_hex_key(key, "blake2b-128", 16)
        env = {"KVCOORD_HASH_KEY": key, "KVCOORD_ROUTE_WAIT_MS": "100", "OMP_NUM_THREADS": "1"}
        security = self._write_identities() if self.auth else []
        self.coordinator_target = f"127.0.0.1:{free_port()}"
        self.worker_target = f"127.0.0.1:{free_port()}"
        token = ["--token-file", str(self.log_dir / "worker.token")] if self.auth else []
        commands = {
            self.coordinator_target: ["coordinator", "--listen", self.coordinator_target],
            self.worker_target: ["worker", "--coordinator", self.coordinator_target,
                                 "--listen", self.worker_target, "--worker-id", REAL_WORKER,
                                 "--pages", "256", "--device", "cpu", *token],
        }
        try:
            for (target, args), name in zip(commands.items(), ("coordinator", "worker"),
                                            strict=True):
                with (self.log_dir / f"{name}.log").open("ab") as log:
                    self._processes[name] = spawn(
                        [*args, *security, "--log-level", "warning"], env=env, stderr=log)
                wait_healthy(target, self._processes[name], timeout=60.0)
            self._channel = grpc.insecure_channel(self.coordinator_target)
            self._wait_worker_ready()
            self.register_fake_worker()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._channel is not None:
            self._channel.close()
        stop_processes([self._processes[n] for n in ("worker", "coordinator")
                        if n in self._processes])

    def _write_identities(self) -> list[str]:
        """Write the identities file and the worker's token file; the servers' flags."""
        self.tokens = {role: secrets.token_hex(24) for role in (*ROLES, REAL_WORKER)}
        entries = [(role, role, "") for role in ROLES]
        entries.append((REAL_WORKER, "worker", f'worker_id = "{REAL_WORKER}"\n'))
        (self.log_dir / "identities.toml").write_text("".join(
            f'[[identity]]\nname = "{name}"\nrole = "{role}"\n{extra}'
            f'token = "{self.tokens[name]}"\n' for name, role, extra in entries))
        (self.log_dir / "worker.token").write_text(self.tokens[REAL_WORKER] + "\n")
        # Far above the campaign's pace: the limiter runs, but does not answer the fuzz
        # RESOURCE_EXHAUSTED before it reaches the handlers.
        return ["--auth-file", str(self.log_dir / "identities.toml"),
                "--rate-limit-per-s", "1000000"]

    def metadata(self, role: str | None = "admin") -> Metadata:
        """Call metadata of ``role`` (none without auth, or for ``role=None``)."""
        if not self.auth or role is None:
            return ()
        return (("authorization", f"Bearer {self.tokens[role]}"),)

    def _coordinator(self, call: Callable[[pb_grpc.CoordinatorStub], Any]) -> Any:
        assert self._channel is not None, "start the fleet first"
        return call(pb_grpc.CoordinatorStub(self._channel))

    def _wait_worker_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            listed = self._coordinator(lambda stub: stub.ListWorkers(
                pb.ListWorkersRequest(), timeout=5.0, metadata=self.metadata()))
            if any(w.worker_id == REAL_WORKER and w.state == pb.WORKER_STATE_READY
                   for w in listed.workers):
                return
            time.sleep(0.1)
        raise TimeoutError(f"{REAL_WORKER} not ready at the coordinator in {timeout}s")

    def register_fake_worker(self) -> None:
        """(Re-)register ``FAKE_WORKER``: a new incarnation, its old entries dropped."""
        assert self._hash is not None, "start the fleet first"
        request = pb.RegisterRequest(
            worker_id=FAKE_WORKER, address=f"{FAKE_WORKER}.invalid:1", total_pages=1024,
            hash_config=pb.HashConfig(algorithm=self._hash.algorithm.value,
                                      page_size=self._hash.page_size,
                                      fingerprint=self._hash.fingerprint()))
        self._incarnation = self._coordinator(lambda stub: stub.Register(
            request, timeout=5.0, metadata=self.metadata())).incarnation

    def hello(self) -> bytes:
        """A well-formed first Sync message of ``FAKE_WORKER``'s current incarnation."""
        return pb.SyncRequest(hello=pb.SyncHello(
            worker_id=FAKE_WORKER, incarnation=self._incarnation)).SerializeToString()

    def before_block(self, method: str) -> None:
        """Undo what the last block may have changed: abort a policy update it began (or every
        route would wait on its drain) and register the fake worker again."""
        def abort_update(stub: pb_grpc.CoordinatorStub) -> None:
            state = stub.GetPolicy(pb.GetPolicyRequest(), timeout=5.0, metadata=self.metadata())
            if state.HasField("target_version"):
                stub.AbortPolicyUpdate(pb.AbortPolicyUpdateRequest(version=state.target_version),
                                       timeout=5.0, metadata=self.metadata())

        self._coordinator(abort_update)
        self.register_fake_worker()

    def alive(self, name: str) -> bool:
        return self._processes[name].poll() is None

    def pid(self, name: str) -> int:
        return self._processes[name].pid

    def log_tail(self, name: str, chars: int = 4000) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")[-chars:]

    def endpoints(self) -> list[Endpoint]:
        """The coordinator and the worker as campaign endpoints. Probes and resets run as admin,
        so a campaign without credentials can still check that the servers answer."""
        admin = self.metadata()
        return [
            Endpoint("coordinator", self.coordinator_target, self.pid("coordinator"),
                     lambda: self.alive("coordinator"), pb.DESCRIPTOR.services_by_name[
                         "Coordinator"], probe=("GetStats", b""),
                     first_message={"Sync": self.hello}, before_block=self.before_block,
                     probe_metadata=admin),
            Endpoint("worker", self.worker_target, self.pid("worker"),
                     lambda: self.alive("worker"), wpb.DESCRIPTOR.services_by_name["Worker"],
                     probe=("GetStats", b""), probe_metadata=admin),
        ]
