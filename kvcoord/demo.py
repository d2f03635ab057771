"""``make demo`` until ``kvcoord up`` exists: a real coordinator process and a scripted round trip.

Starts ``kvcoord coordinator`` as a subprocess on a free port (embedded store), waits for gRPC
health, attaches three scripted workers over ``Register``/``Sync``, has them report cached pages
for a shared system prompt and two conversations, then routes and looks up prompts through the
SDK and prints what the coordinator answered. Everything is torn down at the end, also on Ctrl-C.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.client import AsyncCoordinatorClient
from coordinator.hashing import DEV_HASH_KEY, HashConfig
from kvcoord.scripted_worker import ScriptedWorker
from kvcoord.tables import render_table


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_coordinator_process(
    port: int, *extra_args: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """``kvcoord coordinator`` in its own process group (so teardown reaches every child)."""
    return subprocess.Popen(
        [sys.executable, "-m", "kvcoord.cli", "coordinator", "--listen", f"127.0.0.1:{port}",
         "--log-level", "warning", *extra_args],
        env={**os.environ, **(env or {})}, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )


def wait_healthy(target: str, process: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """Block until the coordinator's gRPC health answers SERVING (or it exits / time runs out)."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                err = process.stderr.read().decode() if process.stderr else ""
                raise RuntimeError(f"coordinator exited with {process.returncode}: {err[-2000:]}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                time.sleep(0.1)
    raise TimeoutError(f"coordinator at {target} not healthy after {timeout}s")


def stop_process(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group (graceful drain), SIGKILL it if it lingers past 10 s."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


async def round_trip(target: str) -> None:
    rng = random.Random(7)
    system = [rng.randrange(32_000) for _ in range(512)]
    chats = {name: system + [rng.randrange(32_000) for _ in range(256)] for name in "AB"}
    hash_config = HashConfig(key=DEV_HASH_KEY)
    workers = [ScriptedWorker(target, f"worker-{i}", hash_config=hash_config,
                              address=f"127.0.0.1:{7100 + i}") for i in range(3)]
    for w in workers:
        await w.start()
    print(f"3 scripted workers registered and syncing with {target}")
    await workers[0].store(workers[0].keys(chats["A"]))
    await workers[1].store(workers[1].keys(chats["B"]))
    await workers[2].store(workers[2].keys(system))
    print("worker-0 holds chat A, worker-1 chat B, worker-2 the shared system prompt\n")
    rows = []
    async with AsyncCoordinatorClient(target) as client:
        for label, prompt in [
            ("chat A, turn 2", chats["A"] + [rng.randrange(32_000) for _ in range(64)]),
            ("chat B, turn 2", chats["B"] + [rng.randrange(32_000) for _ in range(64)]),
            ("new chat, same system prompt", system + [1, 2, 3] * 40),
            ("unrelated prompt", [rng.randrange(32_000) for _ in range(300)]),
        ]:
            lookup = await client.lookup(prompt)
            route = await client.route(prompt)
            cached = ", ".join(f"{w}:{t}" for w, t in sorted(lookup.matches.items())) or "-"
            rows.append([label, str(len(prompt)), cached, route.worker_id,
                         str(route.matched_tokens)])
        print(render_table(["prompt", "tokens", "cached (worker:tokens)", "routed to",
                            "reused"], rows))
        stats = await client.stats()
        print(f"\nindex: {stats.index_keys} keys, {stats.index_entries} entries, "
              f"{stats.pending_entries} pending; routed {stats.routes} prompts, "
              f"{stats.hit_ratio:.1%} of their tokens already cached")
    for w in workers:
        await w.close()


def run_demo() -> int:
    port = free_port()
    target = f"127.0.0.1:{port}"
    print(f"starting coordinator on {target} (embedded store)")
    process = start_coordinator_process(port)
    try:
        wait_healthy(target, process)
        asyncio.run(round_trip(target))
        print("\ndemo finished: coordinator stopped, nothing left running")
        return 0
    finally:
        stop_process(process)
