"""A benchmark server process: the real coordinator (index pre-populated) or a bare echo servicer.

Both use the same grpc.aio server settings and the same generated stubs, so the difference in
Route throughput between them is the coordinator's own work (conversion, hashing, index walk,
routing, pending entries, interceptor). Run: ``python -m bench.rpc_server MODE PORT WORKERS
CONVERSATIONS [TLS_DIR]``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile

import grpc

from bench.workload import populate
from coordinator.client.channels import channel_options
from coordinator.config import CoordinatorConfig
from coordinator.logs import configure_logging
from coordinator.server.main import start_coordinator
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from coordinator.wire import PROTOCOL_VERSION


class EchoServicer(pb_grpc.CoordinatorServicer):  # type: ignore[misc]
    """Answers Route/RouteBatch with a fixed reply of the real reply's shape; does nothing else."""

    def __init__(self) -> None:
        self._reply = pb.RouteResponse(
            protocol_version=PROTOCOL_VERSION, worker_id="worker-00", address="10.0.0.1:7000",
            matched_pages=128, matched_tokens=2048, policy_version=0, prompt_pages=256,
            routing_policy="kv_aware",
        )

    async def Route(self, request: pb.RouteRequest, context: object) -> pb.RouteResponse:
        return self._reply

    async def RouteBatch(
        self, request: pb.RouteBatchRequest, context: object
    ) -> pb.RouteBatchResponse:
        n = len(request.prompts)
        return pb.RouteBatchResponse(routes=[self._reply] * n, order=range(n))


async def serve_echo(port: int) -> None:
    server = grpc.aio.server(options=channel_options(16 * 1024 * 1024))
    pb_grpc.add_CoordinatorServicer_to_server(EchoServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


BENCH_TOKEN = "bench-scheduler-token-0123456789"
"""The bearer token of the scheduler identity of mode ``coordinator_auth``."""


def _identities_file() -> str:
    """A one-identity file (a scheduler holding ``BENCH_TOKEN``) in a temporary directory."""
    directory = tempfile.mkdtemp(prefix="kvcoord-bench-")
    path = os.path.join(directory, "identities.toml")
    with open(path, "w") as out:
        # The default tenant: the pre-populated index is hashed under it, so both modes hit alike.
        out.write(f'[[identity]]\nname = "bench"\nrole = "scheduler"\n'
                  f'token = "{BENCH_TOKEN}"\n')
    return path


async def serve_coordinator(port: int, workers: int, conversations: int, *, auth: bool = False,
                            tls_dir: str | None = None) -> None:
    """``auth``: every call authenticates and is authorized, and the rate limiter runs (at a
    limit the bench never reaches, so its cost is measured, not its refusals). ``tls_dir``:
    serve TLS with ``server.pem``/``server-key.pem`` from there (``tests.tls_certs``)."""
    security: dict[str, object] = (
        {"auth_file": _identities_file(), "rate_limit_per_s": 1e9} if auth else {}
    )
    if tls_dir is not None:
        security |= {"tls_cert": os.path.join(tls_dir, "server.pem"),
                     "tls_key": os.path.join(tls_dir, "server-key.pem")}
    running = await start_coordinator(
        CoordinatorConfig(listen=f"127.0.0.1:{port}", log_level="error", **security)  # type: ignore[arg-type]
    )
    populate(running.service, workers, conversations)
    print("ready", flush=True)
    await running.server.wait_for_termination()


def main() -> None:
    mode, port, workers, conversations = sys.argv[1], *map(int, sys.argv[2:5])
    tls_dir = sys.argv[5] if len(sys.argv) > 5 else None
    configure_logging("error")
    if mode == "echo":
        asyncio.run(serve_echo(port))
    else:
        asyncio.run(serve_coordinator(port, workers, conversations, auth=mode != "coordinator",
                                      tls_dir=tls_dir))


if __name__ == "__main__":
    main()
