"""The Register/Sync protocol's messages as domain values: what a worker sends (registration,
heartbeat, inventory chunk) and what its stream is answered with (welcome, ack, resync, command).
The gRPC layer converts them from and to protobuf (``coordinator.server.convert``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog

from coordinator.core.errors import (
    DomainError,
)
from coordinator.core.fleet import WorkerLoad
from coordinator.core.index import Tier
from coordinator.core.policy_state import PolicyRecord

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class RegistrationRequest:
    worker_id: str
    address: str
    algorithm: str
    page_size: int
    fingerprint: bytes
    total_pages: int
    policy_version: int
    external: bool
    model: str
    http_url: str = ""
    host_pages: int = 0  # pages of the worker's host-memory tier (0 = none)


@dataclass(frozen=True, slots=True)
class Registration:
    incarnation: int
    policy: PolicyRecord
    lease_ms: int
    heartbeat_ms: int
    max_events_per_batch: int
    max_message_bytes: int


@dataclass(frozen=True, slots=True)
class HeartbeatIn:
    load: WorkerLoad
    completed_routes: int
    policy_version: int


@dataclass(frozen=True, slots=True)
class InventoryIn:
    resync_id: int
    keys: Sequence[bytes]
    tier: Tier
    last: bool
    seq: int


@dataclass(frozen=True, slots=True)
class Welcome:
    next_seq: int


@dataclass(frozen=True, slots=True)
class Ack:
    seq: int


@dataclass(frozen=True, slots=True)
class Resync:
    resync_id: int
    reason: str


@dataclass(frozen=True, slots=True)
class Command:
    """A policy command for one worker (DRAIN / APPLY / RESUME; see
    ``coordinator.core.policy_state``)."""

    kind: str  # "drain" | "apply" | "resume"
    version: int
    weights_uri: str = ""
    abort_running: bool = False

Outbound = Welcome | Ack | Resync | Command
StreamCloser = Callable[[DomainError], None]
StreamSender = Callable[[Outbound], None]
