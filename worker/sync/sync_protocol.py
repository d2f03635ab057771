"""The worker side of the ``Sync`` protocol's vocabulary: who the worker is (``WorkerIdentity``),
how its client talks (``SyncSettings``), what the client asks of the worker (``SyncOwner``), the
messages that open a registration and a stream, and what a stream's end means (``stream_end``).
``worker.sync.sync_client`` runs the protocol with them; ``bench/scripted_worker.py`` sends them one
step at a time.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass
from typing import Protocol

import grpc

from coordinator.client.channels import ClientTls
from coordinator.client.outcomes import outcome_of
from coordinator.core.hashing import HashConfig
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.wire import PROTOCOL_VERSION, Reason
from worker.sync.event_log import Holdings


class StreamEnd(enum.Enum):
    """What the client does after a stream (or a registration) ended with an error."""

    RECONNECT = "reconnect"  # same incarnation, same target, after a backoff
    NEXT_TARGET = "next_target"  # this target cannot serve: the next one, after a backoff
    REGISTER_AGAIN = "register_again"  # the coordinator forgot this incarnation
    LEAVE = "leave"  # removed from the fleet for good: never register again


def stream_end(exc: grpc.RpcError) -> StreamEnd:
    """What to do after the coordinator ended the stream with ``exc``: decided on the status
    code and the ``ErrorInfo`` reason (docs/PROTOCOL.md §6), never on the details text."""
    outcome = outcome_of(exc)
    if outcome.reason is Reason.DEREGISTERED:
        return StreamEnd.LEAVE
    if outcome.reason in (Reason.REREGISTER, Reason.FENCED):
        return StreamEnd.REGISTER_AGAIN
    if outcome.code == grpc.StatusCode.UNAVAILABLE:
        return StreamEnd.NEXT_TARGET
    return StreamEnd.RECONNECT


def refused_for_good(exc: grpc.RpcError) -> bool:
    """Whether a refused ``Register`` can never succeed as configured (a hash configuration or
    protocol version mismatch, or a request the coordinator cannot accept)."""
    outcome = outcome_of(exc)
    return (outcome.reason in (Reason.HASH_CONFIG, Reason.PROTOCOL_VERSION)
            or outcome.code == grpc.StatusCode.INVALID_ARGUMENT)


class RegistrationRefused(Exception):
    """The coordinator refused ``Register`` for good (hash key/config or protocol mismatch, bad
    identity): retrying cannot help, the worker's configuration must change."""


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    """What ``Register`` says about the worker. ``external``: an engine behind a bridge (kept
    out of policy barriers, serves the version it is given)."""

    worker_id: str
    address: str
    model: str
    total_pages: int
    hash_config: HashConfig
    external: bool = False
    http_url: str = ""
    """Base URL of the worker's OpenAI-compatible endpoint ("" = none), for gateways."""
    host_pages: int = 0
    """Pages of the worker's host-memory tier (0 = none): the coordinator's per-worker page
    cap counts them with ``total_pages``."""


@dataclass(frozen=True, slots=True)
class SyncSettings:
    """How the client talks. ``heartbeat_ms`` None: the period the coordinator asks for."""

    targets: str
    heartbeat_ms: int | None = None
    event_flush_ms: int = 5
    max_unacked_batches: int = 1024
    max_message_bytes: int = 16 * 1024 * 1024
    max_pending_keys: int = 1 << 20
    rpc_timeout_s: float = 5.0
    backoff_initial_ms: int = 100
    backoff_max_ms: int = 5_000
    token: str | None = None
    tls: ClientTls | None = None

    def reconnect_delay_s(self, attempt: int) -> float:
        """Before the ``attempt``-th reconnect (1-based): exponential, capped at
        ``backoff_max_ms``, with equal jitter (so a fleet cut off together comes back spread)."""
        ceiling = min(self.backoff_max_ms, self.backoff_initial_ms << min(attempt - 1, 16))
        return (ceiling / 2 + random.uniform(0, ceiling / 2)) / 1000


@dataclass(slots=True)
class SyncCounters:
    """What the client did, for the owner's metrics (plain counts, only ever increasing)."""

    registrations: int = 0
    streams: int = 0
    batches: int = 0
    resyncs: int = 0
    keys_stored: int = 0
    keys_removed: int = 0


def register_request(identity: WorkerIdentity, policy_version: int) -> pb.RegisterRequest:
    """``Register`` for ``identity`` serving ``policy_version`` (a new incarnation)."""
    hashing = identity.hash_config
    return pb.RegisterRequest(
        protocol_version=PROTOCOL_VERSION, worker_id=identity.worker_id,
        address=identity.address, total_pages=identity.total_pages,
        policy_version=policy_version, external=identity.external, model=identity.model,
        http_url=identity.http_url, host_pages=identity.host_pages,
        hash_config=pb.HashConfig(algorithm=hashing.algorithm.value,
                                  page_size=hashing.page_size, fingerprint=hashing.fingerprint()),
    )


def hello_request(worker_id: str, incarnation: int, last_acked_seq: int) -> pb.SyncRequest:
    """The first message of a Sync stream: which incarnation, and the last batch acked."""
    hello = pb.SyncHello(worker_id=worker_id, incarnation=incarnation,
                         last_acked_seq=last_acked_seq)
    return pb.SyncRequest(protocol_version=PROTOCOL_VERSION, hello=hello)


class SyncOwner(Protocol):
    """What the client asks of the worker it speaks for."""

    def policy_version(self) -> int:
        """The policy version the worker serves now (Register and heartbeats carry it)."""

    async def holdings(self) -> Holdings:
        """Every page held, by tier, as one consistent snapshot (it may be large: an owner
        whose state lives outside the loop takes it in a worker thread)."""

    def heartbeat(self) -> pb.Heartbeat:
        """The worker's load now (``policy_version`` is filled in by the client)."""

    async def registered(self, response: pb.RegisterResponse) -> None:
        """A new incarnation was registered: serve the version it names (a worker fenced by a
        barrier or registering mid-update must load it) before its stream opens."""

    def command(self, command: pb.PolicyCommand) -> None:
        """A policy command arrived (DRAIN / APPLY / RESUME); must return at once."""
