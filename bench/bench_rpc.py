"""Route / RouteBatch over real gRPC: the coordinator against a bare echo servicer, same run,
and the coordinator with auth on (bearer token, role check, rate limiter) against it off.

Each server runs in its own process; the client sends pre-serialized requests (raw bytes, no
client-side protobuf work) from ``CONCURRENCY`` in-flight calls. Server and client share the
machine's cores unpinned (pinning the server to one core was tried: gRPC's own threads then
compete with the handler for that core and inflate every extra microsecond of handler work).
Reported per case: requests/s and the server process's CPU time per request (from /proc, all
threads). ``wrong_routes.<mode>`` (must be 0): answers checked against a Lookup after the measure.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from bench.rpc_server import BENCH_TOKEN
from bench.workload import conversation_pool, fresh_prompts
from coordinator.core.hashing import DEV_HASH_KEY, HashConfig, Namespace, PageHasher
from coordinator.core.hashing.page_hasher import tokens_to_bytes
from coordinator.v1 import coordinator_pb2 as pb
from kvcoord import child_process

ROOT = Path(__file__).resolve().parent.parent
CONCURRENCY = 32
ROUTE = "/coordinator.v1.Coordinator/Route"
ROUTE_BATCH = "/coordinator.v1.Coordinator/RouteBatch"


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ServerProcess:
    """``mode``: echo, coordinator, coordinator_auth, or coordinator_auth_tls (auth over TLS:
    a throwaway CA and server certificate written to a temporary directory)."""

    def __init__(self, mode: str, workers: int, conversations: int) -> None:
        self.mode = mode
        self.port = _free_port()
        self.ca: bytes | None = None
        extra: list[str] = []
        if mode == "coordinator_auth_tls":
            from tests.tls_certs import make_pki  # `cryptography`: the dev extra

            pki = make_pki(Path(tempfile.mkdtemp(prefix="kvcoord-bench-pki-")))
            self.ca = Path(pki.ca).read_bytes()
            extra = [str(Path(pki.server.cert).parent)]
        self.process = child_process.start(
            [sys.executable, "-m", "bench.rpc_server", mode, str(self.port), str(workers),
             str(conversations), *extra],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        assert self.process.stdout is not None
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{mode} bench server failed to start")

    @property
    def target(self) -> str:
        return f"localhost:{self.port}" if self.ca else f"127.0.0.1:{self.port}"

    def cpu(self) -> float:
        return _cpu_seconds(self.process.pid)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


async def _drive(target: str, method: str, payloads: Sequence[bytes], total: int,
                 metadata: tuple[tuple[str, str], ...] = (), ca: bytes | None = None) -> float:
    """Send ``total`` calls cycling over ``payloads`` with CONCURRENCY in flight; seconds taken.
    ``ca``: over TLS, verifying the server with that CA."""
    options = [("grpc.max_send_message_length", 64 << 20),
               ("grpc.max_receive_message_length", 64 << 20)]
    channel = (grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(ca), options=options)
               if ca else grpc.aio.insecure_channel(target, options=options))
    async with channel:
        call = channel.unary_unary(method)

        async def run(calls: int) -> None:
            counter = iter(range(calls))

            async def lane() -> None:
                for i in counter:
                    await call(payloads[i % len(payloads)], metadata=metadata)

            await asyncio.gather(*(lane() for _ in range(CONCURRENCY)))

        await run(_warmup(total))
        started = time.perf_counter()
        await run(total)
        return time.perf_counter() - started


def _warmup(total: int) -> int:
    return max(1, total // 4)


def _measure(server: ServerProcess, method: str, payloads: Sequence[bytes], total: int,
             items_per_call: int = 1) -> dict[str, float]:
    cpu_before = server.cpu()
    auth = server.mode.startswith("coordinator_auth")
    metadata = (("authorization", f"Bearer {BENCH_TOKEN}"),) if auth else ()
    seconds = asyncio.run(_drive(server.target, method, payloads, total, metadata, server.ca))
    cpu = server.cpu() - cpu_before
    calls = total + _warmup(total)  # warm-up calls also burn server CPU
    return {
        "per_s": total * items_per_call / seconds,
        "server_cpu_us": cpu / (calls * items_per_call) * 1e6,
    }


LOOKUP = "/coordinator.v1.Coordinator/Lookup"
CHECKED_PER_SHAPE = 8


def _wrong_answers(server: ServerProcess, payloads: dict[str, list[bytes]], workers: int) -> int:
    """Route a few prompts of each shape once more, each followed by a Lookup of the same
    prompt, and count the wrong answers: a worker the fleet does not have, a version other than
    0, a prompt that is not 256 pages, or ``matched_pages`` other than that worker's depth in
    the Lookup (nothing changes the index's confirmed entries in between: no worker streams)."""
    fleet = {f"worker-{i:04d}" for i in range(workers)}
    auth = server.mode.startswith("coordinator_auth")
    metadata = (("authorization", f"Bearer {BENCH_TOKEN}"),) if auth else ()
    channel = (grpc.secure_channel(server.target, grpc.ssl_channel_credentials(server.ca))
               if server.ca else grpc.insecure_channel(server.target))
    wrong = 0
    with channel:
        route = channel.unary_unary(ROUTE, response_deserializer=pb.RouteResponse.FromString)
        lookup = channel.unary_unary(LOOKUP, response_deserializer=pb.LookupResponse.FromString)
        for name, requests in payloads.items():
            if auth and name != "token_bytes":
                continue  # a scheduler may not send page keys; the measure skips them too
            for payload in requests[:CHECKED_PER_SHAPE]:
                answer = route(payload, metadata=metadata, timeout=30)
                prompt = pb.RouteRequest.FromString(payload).prompt
                found = lookup(pb.LookupRequest(prompt=prompt).SerializeToString(),
                               metadata=metadata, timeout=30)
                depth = {m.worker_id: m.matched_pages for m in found.matches}
                wrong += (answer.worker_id not in fleet or answer.policy_version != 0
                          or answer.prompt_pages != 256
                          or answer.matched_pages != depth.get(answer.worker_id, 0))
    return wrong


def _conversations(quick: bool) -> int:
    """The pool the servers index and the clients send (every pool prompt is a cache hit)."""
    return 32 if quick else 256


def _route_payloads(quick: bool) -> dict[str, list[bytes]]:
    pool = conversation_pool(_conversations(quick))
    hasher = PageHasher(HashConfig(key=DEV_HASH_KEY))
    fresh = fresh_prompts(100 if quick else 2000)
    return {
        "page_keys": [
            pb.RouteRequest(prompt=pb.Prompt(
                page_keys=b"".join(hasher.page_keys(t, Namespace())), token_count=len(t)
            )).SerializeToString()
            for t in pool
        ],
        "token_ids": [
            pb.RouteRequest(prompt=pb.Prompt(token_ids=t)).SerializeToString() for t in pool
        ],
        "token_bytes": [
            pb.RouteRequest(prompt=pb.Prompt(token_bytes=tokens_to_bytes(t))).SerializeToString()
            for t in pool
        ],
        "token_ids_fresh": [
            pb.RouteRequest(prompt=pb.Prompt(token_bytes=tokens_to_bytes(t))).SerializeToString()
            for t in fresh
        ],
    }


def _batch_payloads(quick: bool, prompts: int = 16, samples: int = 4) -> list[bytes]:
    pool = conversation_pool(_conversations(quick))
    batches = []
    for start in range(0, len(pool), prompts):
        group = pool[start:start + prompts]
        batch = [group[i % len(group)] for i in range(len(group) * samples)]
        batches.append(pb.RouteBatchRequest(
            prompts=[pb.Prompt(token_bytes=tokens_to_bytes(t)) for t in batch]
        ).SerializeToString())
    return batches


# RouteBatch shapes (prompts x samples = 64 per call): GRPO groups of 4 and of 16 siblings.
BATCH_SHAPES = {"grpo_16x4": (16, 4), "grpo_4x16": (4, 16)}


def bench_rpc(workers: int = 64, quick: bool = False) -> dict[str, Any]:
    """Route and RouteBatch throughput, coordinator vs echo, 4,096-token prompts."""
    payloads = _route_payloads(quick)
    batches = {name: _batch_payloads(quick, *shape) for name, shape in BATCH_SHAPES.items()}
    total = 300 if quick else 6_000
    batch_calls = 10 if quick else 200
    out: dict[str, Any] = {"workers": workers, "concurrency": CONCURRENCY, "prompt_tokens": 4096,
                           "batch_prompts": 64}
    for mode in ("echo", "coordinator", "coordinator_auth", "coordinator_auth_tls"):
        server = ServerProcess(mode, workers, _conversations(quick))
        try:
            for name, requests in payloads.items():
                if mode.startswith("coordinator_auth") and name != "token_bytes":
                    continue  # the auth cost is per call: one prompt shape shows it
                n = min(total, len(requests)) if name == "token_ids_fresh" else total
                out[f"{mode}.route.{name}"] = _measure(server, ROUTE, requests, n)
            for name, requests in batches.items():
                out[f"{mode}.route_batch.{name}"] = _measure(
                    server, ROUTE_BATCH, requests, batch_calls, items_per_call=64
                )
            if mode != "echo":
                out[f"wrong_routes.{mode}"] = _wrong_answers(server, payloads, workers)
        finally:
            server.stop()
    for name in payloads:
        out[f"ratio.route.{name}"] = (
            out[f"coordinator.route.{name}"]["per_s"] / out[f"echo.route.{name}"]["per_s"]
        )
    for case in ["route.token_bytes", *(f"route_batch.{name}" for name in batches)]:
        for mode in ("auth", "auth_tls"):
            out[f"ratio.{mode}_on_vs_off.{case}"] = (
                out[f"coordinator_{mode}.{case}"]["per_s"] / out[f"coordinator.{case}"]["per_s"]
            )
    for name in batches:
        out[f"ratio.batch_vs_unary.{name}"] = (
            out[f"coordinator.route_batch.{name}"]["per_s"]
            / out["coordinator.route.token_bytes"]["per_s"]
        )
    return out
