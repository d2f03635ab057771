"""The metadata store's protocol: ``MetadataStore``, its record types, and the checks both
implementations share (argument validation, the ``update_worker`` field rules), so the two cannot
drift apart. The policy record itself (``PolicyRecord``) belongs to the core's policy state
machine; the store only keeps it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from coordinator.core.policy_state import PolicyRecord

STREAMS = frozenset({"events", "rollouts"})
"""The streams ``append``/``read`` accept, beside a shard's ``events:<shard>``
(``events_stream``); anything else is refused with ValueError."""

_SHARD = re.compile(r"[a-z0-9-]{1,32}")  # as ``CoordinatorConfig.shard``


def events_stream(shard: str) -> str:
    """The replication stream of ``shard``'s replicas: ``events`` unsharded (""), else
    ``events:<shard>``. ValueError for a name that is not 1..32 of ``[a-z0-9-]``."""
    return "events" if not shard else f"events:{check_shard(shard)}"


def check_shard(shard: str) -> str:
    """A shard name ("" = unsharded) or ValueError."""
    if shard and not _SHARD.fullmatch(shard):
        raise ValueError(f"shard must be 1..32 of [a-z0-9-], got {shard!r}")
    return shard


class StoreUnavailable(Exception):
    """The backing store cannot be reached (connection refused or lost, timeout, loading).

    The outcome of a mutating call that raised it is unknown: re-read before retrying. A
    coordinator answers it UNAVAILABLE, reason ``STORE_UNAVAILABLE``, with a retry delay.
    """


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """A live worker registration. ``info`` holds the free-form extra fields."""

    worker_id: str
    incarnation: int
    address: str
    policy_version: int
    external: bool
    registered_at_ms: int
    info: Mapping[str, str] = field(default_factory=dict, hash=False)


@dataclass(frozen=True, slots=True)
class StreamEntry:
    entry_id: str
    fields: Mapping[str, str] = field(hash=False)


@dataclass(frozen=True, slots=True)
class StreamBounds:
    """A stream's oldest kept entry id and the last id it ever handed out (None when the
    stream does not exist: never written, or lost with a Redis restart without persistence)."""

    first_id: str | None
    last_id: str | None


class MetadataStore(Protocol):
    """What the coordinator keeps outside its process. Every method is a coroutine.

    Worker registry: each registration holds a lease (a TTL) and an incarnation. A calling
    worker identifies itself by (worker_id, incarnation); a call from any incarnation but the
    live one is refused (returns False, changes nothing) — that is the fencing.

    Every method but ``ping`` and ``close`` raises ``StoreUnavailable`` when the store cannot
    be reached (``MemoryStore`` never does), and ``ValueError`` for arguments the contract
    refuses (an empty worker id, a lease <= 0, an unknown stream), before touching the store.
    """

    namespace: str

    async def ping(self) -> bool:
        """True when the store answers; False (never raises) when it cannot be reached."""
        ...

    async def close(self) -> None:
        """Release connections. Idempotent."""
        ...

    async def register_worker(
        self,
        worker_id: str,
        *,
        address: str,
        policy_version: int,
        external: bool = False,
        lease_ms: int,
        info: Mapping[str, str] | None = None,
        min_incarnation: int = 1,
    ) -> WorkerRecord:
        """Atomically: take the next incarnation (strictly larger than any before for this id,
        even after the lease expired or a deregister, and at least ``min_incarnation``: the
        caller's floor, for a store that forgot its counters), replace the worker's record,
        start its lease of ``lease_ms`` and list it."""
        ...

    async def renew_lease(self, worker_id: str, incarnation: int, lease_ms: int) -> bool:
        """Atomically reset the lease to ``lease_ms`` from now. False, and no change, when the
        lease already expired or ``incarnation`` is not the live one."""
        ...

    async def get_worker(self, worker_id: str) -> WorkerRecord | None:
        """The live registration, or None when there is none (never registered, expired,
        deregistered)."""
        ...

    async def list_workers(self) -> list[WorkerRecord]:
        """Live registrations only, sorted by worker id; forgets ids whose lease expired."""
        ...

    async def deregister_worker(self, worker_id: str, incarnation: int) -> bool:
        """Remove the live registration. False, and no change, for any other incarnation or
        when the lease already expired. The incarnation counter is kept."""
        ...

    async def current_incarnation(self, worker_id: str) -> int:
        """The last incarnation handed out for this id (live or not); 0 when never
        registered."""
        ...

    async def update_worker(self, worker_id: str, incarnation: int, **fields: str) -> bool:
        """Atomically update ``address``, ``policy_version`` (a decimal string) and/or extra
        ``info`` fields (any other name) without touching the lease. False, and no change, for
        a stale incarnation or an expired lease. Raises ValueError for the fields that identify
        a registration (``worker_id``, ``incarnation``, ``external``, ``registered_at_ms``)."""
        ...

    async def get_policy(self) -> PolicyRecord:
        """The stored policy state; ``PolicyRecord()`` when none was ever written."""
        ...

    async def cas_policy(self, expected: PolicyRecord, new: PolicyRecord) -> bool:
        """Atomically replace the policy state with ``new`` when the stored state equals
        ``expected`` in every field; the written epoch is ``expected.epoch + 1`` whatever
        ``new.epoch`` says. False, and no change, when the stored state differs. Raises
        ValueError, before touching the store, when ``new.version < expected.version``: the
        version never decreases."""
        ...

    async def restore_policy(self, expected: PolicyRecord, new: PolicyRecord) -> bool:
        """Like ``cas_policy``, but ``new`` is written exactly, epoch included: for putting
        back a state the store lost (``coordinator.control.policy.high_water``). ValueError, before
        touching the store, unless ``new`` is ahead of ``expected`` (version not lower, epoch
        higher)."""
        ...

    async def record_ack(self, version: int, worker_id: str, stage: str) -> None:
        """Record (overwrite) the stage a worker acknowledged for a target version."""
        ...

    async def get_acks(self, version: int) -> dict[str, str]:
        """worker_id -> last acknowledged stage for ``version``; empty when none."""
        ...

    async def append(self, stream: str, fields: Mapping[str, str], *, maxlen: int) -> str:
        """Append an entry to ``stream`` (one of STREAMS) and return its id ``"<ms>-<seq>"``;
        ids only increase. The stream keeps at least the newest ``maxlen`` entries and is
        trimmed from the oldest end: exactly ``maxlen`` in memory, approximately (whole Redis
        stream nodes, up to ``stream-node-max-entries`` more) on Redis."""
        ...

    async def read(self, stream: str, *, after: str | None, count: int) -> list[StreamEntry]:
        """Up to ``count`` entries with ids strictly greater than ``after`` (None: from the
        oldest kept entry), oldest first. Entries trimmed away are silently skipped (a
        ``stream_bounds().first_id`` above ``after`` tells). ValueError for an ``after`` that
        is not ``"<ms>-<seq>"``."""
        ...

    async def append_many(
        self, stream: str, entries: Sequence[Mapping[str, str]], *, maxlen: int
    ) -> list[str]:
        """``append`` each entry, in order, in one round trip; their ids, in order. Not one
        atomic change on Redis (a pipeline, not a transaction): another writer's entries may
        land between them, and ``StoreUnavailable`` may leave some of them appended."""
        ...

    async def tail(
        self, stream: str, *, after: str, count: int, block_ms: int
    ) -> list[StreamEntry]:
        """Like ``read`` from ``after`` ("0-0": from the oldest), but waits up to ``block_ms``
        for the first entry to arrive; [] when none did. ``block_ms`` must stay below the
        store's command timeout."""
        ...

    async def stream_bounds(self, stream: str) -> StreamBounds:
        """The stream's first kept and last generated ids (see ``StreamBounds``)."""
        ...

    async def announce_replica(self, replica_id: str, ttl_ms: int, *, shard: str = "") -> None:
        """Mark coordinator replica ``replica_id`` of ``shard`` ("" = unsharded) alive for
        ``ttl_ms`` from now. Each shard has a replica set of its own."""
        ...

    async def live_replicas(self, *, shard: str = "") -> list[str]:
        """``shard``'s replicas whose announcement has not run out, sorted."""
        ...


# --- checks both implementations share ------------------------------------------------------

_IDENTITY_FIELDS = frozenset({"worker_id", "incarnation", "external", "registered_at_ms"})


def _is_decimal(text: str) -> bool:
    return text.isascii() and text.isdigit()


def check_namespace(namespace: str) -> str:
    """Refuse namespaces that would break the Redis key layout (empty, or braces)."""
    if not namespace or "{" in namespace or "}" in namespace:
        raise ValueError(f"namespace must be non-empty and free of braces, got {namespace!r}")
    return namespace


def check_worker_id(worker_id: str) -> str:
    if not worker_id:
        raise ValueError("worker_id must be non-empty")
    return worker_id


def check_lease(lease_ms: int) -> int:
    if lease_ms <= 0:
        raise ValueError(f"lease_ms must be positive, got {lease_ms}")
    return lease_ms


def check_policy_transition(expected: PolicyRecord, new: PolicyRecord) -> None:
    if new.version < expected.version:
        raise ValueError(
            f"policy version never decreases: {expected.version} -> {new.version} refused"
        )
    if new.version < 0 or (new.target_version is not None and new.target_version < 0):
        raise ValueError("policy versions are non-negative")


def check_policy_restore(expected: PolicyRecord, new: PolicyRecord) -> None:
    check_policy_transition(expected, new)
    if new.epoch <= expected.epoch:
        raise ValueError(
            f"a restored policy state must have a higher epoch: {expected.epoch} -> {new.epoch}"
        )


def check_min_incarnation(min_incarnation: int) -> int:
    if min_incarnation < 1:
        raise ValueError(f"min_incarnation must be >= 1, got {min_incarnation}")
    return min_incarnation


def split_worker_update(fields: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """Split ``update_worker`` fields into (record fields, info fields), validated."""
    refused = sorted(_IDENTITY_FIELDS & fields.keys())
    if refused:
        raise ValueError(f"update_worker cannot change {', '.join(refused)}")
    core = {k: v for k, v in fields.items() if k in ("address", "policy_version")}
    if "policy_version" in core and not _is_decimal(core["policy_version"]):
        raise ValueError(
            f"policy_version must be a decimal integer, got {core['policy_version']!r}"
        )
    info = {k: v for k, v in fields.items() if k not in core}
    return core, info


def check_stream(stream: str, *, count_or_maxlen: int) -> None:
    prefix, sep, shard = stream.partition(":")
    if stream not in STREAMS and not (sep and prefix == "events" and _SHARD.fullmatch(shard)):
        raise ValueError(f"unknown stream {stream!r}; expected one of {sorted(STREAMS)} "
                         "or events:<shard>")
    if count_or_maxlen <= 0:
        raise ValueError(f"count/maxlen must be positive, got {count_or_maxlen}")


def check_entry_fields(fields: Mapping[str, str]) -> dict[str, str]:
    if not fields:
        raise ValueError("a stream entry needs at least one field")
    return dict(fields)


def check_replica_id(replica_id: str) -> str:
    if not replica_id or not replica_id.isprintable() or len(replica_id) > 128:
        raise ValueError(f"replica id must be 1..128 printable characters, got {replica_id!r}")
    return replica_id


def parse_entry_id(entry_id: str) -> tuple[int, int]:
    """``"<ms>-<seq>"`` -> (ms, seq); ValueError for anything else."""
    ms, sep, seq = entry_id.partition("-")
    if not (sep and _is_decimal(ms) and _is_decimal(seq)):
        raise ValueError(f"stream entry id must look like '<ms>-<seq>', got {entry_id!r}")
    return int(ms), int(seq)
