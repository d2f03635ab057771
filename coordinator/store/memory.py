"""``MemoryStore``: the metadata store kept in the coordinator's own memory.

For one coordinator process: nothing is shared and nothing survives a restart (it says so at
construction). Every method runs without awaiting anything, so each call is atomic with
respect to other tasks on the same event loop; the store is not thread-safe.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

import structlog

from coordinator.core.policy_state import PolicyRecord
from coordinator.store.protocol import (
    StreamBounds,
    StreamEntry,
    WorkerRecord,
    check_entry_fields,
    check_lease,
    check_min_incarnation,
    check_namespace,
    check_policy_restore,
    check_policy_transition,
    check_replica_id,
    check_shard,
    check_stream,
    check_worker_id,
    parse_entry_id,
    split_worker_update,
)


@dataclasses.dataclass(slots=True)
class _Lease:
    record: WorkerRecord
    expires_at: float  # in the injected clock's seconds


class MemoryStore:
    """In-process ``MetadataStore``. Records it returns are shared with the store, so their
    mappings are read-only views.

    ``clock`` (monotonic seconds) drives lease expiry, so tests advance time instead of
    sleeping; ``wall_clock`` (Unix seconds) stamps ``registered_at_ms`` and the millisecond part
    of stream ids, which stay strictly increasing even if the wall clock steps back.
    """

    def __init__(
        self,
        *,
        namespace: str = "default",
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.namespace = check_namespace(namespace)
        self._clock = clock
        self._wall_clock = wall_clock
        self._leases: dict[str, _Lease] = {}
        self._incarnations: dict[str, int] = {}
        self._policy = PolicyRecord()
        self._acks: dict[int, dict[str, str]] = {}
        self._streams: dict[str, deque[StreamEntry]] = {}
        self._last_ids: dict[str, tuple[int, int]] = {}
        self._appended: dict[str, asyncio.Event] = {}  # set (and replaced) on every append
        # shard -> replica id -> expiry, in ``clock`` seconds
        self._replicas: dict[str, dict[str, float]] = {}
        # A fresh logger each time, so log capture in tests works even with cached loggers.
        structlog.get_logger(__name__).warning(
            "store.embedded",
            namespace=namespace,
            detail="in-memory metadata store: for a single coordinator process only; "
            "nothing is kept across restarts (use --redis for durability and replicas)",
        )

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        return None

    # --- worker registry ------------------------------------------------------------------

    def _live(self, worker_id: str) -> _Lease | None:
        """The worker's lease when it has not expired; an expired one is dropped here."""
        lease = self._leases.get(worker_id)
        if lease is not None and lease.expires_at <= self._clock():
            del self._leases[worker_id]
            return None
        return lease

    def _live_incarnation(self, worker_id: str, incarnation: int) -> _Lease | None:
        lease = self._live(worker_id)
        return lease if lease is not None and lease.record.incarnation == incarnation else None

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
        check_worker_id(worker_id)
        check_lease(lease_ms)
        check_min_incarnation(min_incarnation)
        incarnation = max(self._incarnations.get(worker_id, 0) + 1, min_incarnation)
        self._incarnations[worker_id] = incarnation
        record = WorkerRecord(
            worker_id=worker_id,
            incarnation=incarnation,
            address=address,
            policy_version=policy_version,
            external=external,
            registered_at_ms=int(self._wall_clock() * 1000),
            info=MappingProxyType(dict(info or {})),
        )
        self._leases[worker_id] = _Lease(record, self._clock() + lease_ms / 1000)
        return record

    async def renew_lease(self, worker_id: str, incarnation: int, lease_ms: int) -> bool:
        check_lease(lease_ms)
        lease = self._live_incarnation(worker_id, incarnation)
        if lease is None:
            return False
        lease.expires_at = self._clock() + lease_ms / 1000
        return True

    async def get_worker(self, worker_id: str) -> WorkerRecord | None:
        lease = self._live(worker_id)
        return None if lease is None else lease.record

    async def list_workers(self) -> list[WorkerRecord]:
        live = (self._live(worker_id) for worker_id in sorted(self._leases))
        return [lease.record for lease in live if lease is not None]

    async def deregister_worker(self, worker_id: str, incarnation: int) -> bool:
        if self._live_incarnation(worker_id, incarnation) is None:
            return False
        del self._leases[worker_id]
        return True

    async def current_incarnation(self, worker_id: str) -> int:
        return self._incarnations.get(worker_id, 0)

    async def update_worker(self, worker_id: str, incarnation: int, **fields: str) -> bool:
        core, info = split_worker_update(fields)
        lease = self._live_incarnation(worker_id, incarnation)
        if lease is None:
            return False
        record = lease.record
        lease.record = dataclasses.replace(
            record,
            address=core.get("address", record.address),
            policy_version=int(core.get("policy_version", record.policy_version)),
            info=MappingProxyType({**record.info, **info}),
        )
        return True

    # --- policy ---------------------------------------------------------------------------

    async def get_policy(self) -> PolicyRecord:
        return self._policy

    async def cas_policy(self, expected: PolicyRecord, new: PolicyRecord) -> bool:
        check_policy_transition(expected, new)
        if self._policy != expected:
            return False
        self._policy = dataclasses.replace(new, epoch=expected.epoch + 1)
        return True

    async def restore_policy(self, expected: PolicyRecord, new: PolicyRecord) -> bool:
        check_policy_restore(expected, new)
        if self._policy != expected:
            return False
        self._policy = new
        return True

    async def record_ack(self, version: int, worker_id: str, stage: str) -> None:
        self._acks.setdefault(version, {})[check_worker_id(worker_id)] = stage

    async def get_acks(self, version: int) -> dict[str, str]:
        return dict(self._acks.get(version, {}))

    # --- streams --------------------------------------------------------------------------

    def _next_id(self, stream: str) -> tuple[int, int]:
        ms = int(self._wall_clock() * 1000)
        last_ms, last_seq = self._last_ids.get(stream, (0, -1))
        # Like Redis: never go back in time; within one millisecond count up the sequence.
        next_id = (ms, 0) if ms > last_ms else (last_ms, last_seq + 1)
        self._last_ids[stream] = next_id
        return next_id

    async def append(self, stream: str, fields: Mapping[str, str], *, maxlen: int) -> str:
        check_stream(stream, count_or_maxlen=maxlen)
        entry_fields = check_entry_fields(fields)
        ms, seq = self._next_id(stream)
        entry = StreamEntry(f"{ms}-{seq}", MappingProxyType(entry_fields))
        entries = self._streams.setdefault(stream, deque())
        entries.append(entry)
        while len(entries) > maxlen:
            entries.popleft()
        appended = self._appended.pop(stream, None)
        if appended is not None:
            appended.set()
        return entry.entry_id

    async def append_many(
        self, stream: str, entries: Sequence[Mapping[str, str]], *, maxlen: int
    ) -> list[str]:
        # No other task's entries land between these (unlike on Redis): ``append`` never
        # suspends.
        return [await self.append(stream, fields, maxlen=maxlen) for fields in entries]

    async def tail(
        self, stream: str, *, after: str, count: int, block_ms: int
    ) -> list[StreamEntry]:
        """The one method that awaits: it waits for an append (or ``block_ms``)."""
        found = await self.read(stream, after=after, count=count)
        if found or block_ms <= 0:
            return found
        appended = self._appended.setdefault(stream, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(appended.wait(), block_ms / 1000)
        return await self.read(stream, after=after, count=count)

    async def stream_bounds(self, stream: str) -> StreamBounds:
        check_stream(stream, count_or_maxlen=1)
        if stream not in self._last_ids:
            return StreamBounds(None, None)
        entries = self._streams.get(stream)
        last_ms, last_seq = self._last_ids[stream]
        return StreamBounds(entries[0].entry_id if entries else None, f"{last_ms}-{last_seq}")

    async def announce_replica(self, replica_id: str, ttl_ms: int, *, shard: str = "") -> None:
        check_replica_id(replica_id)
        check_lease(ttl_ms)
        self._replicas.setdefault(check_shard(shard), {})[replica_id] = (
            self._clock() + ttl_ms / 1000)

    async def live_replicas(self, *, shard: str = "") -> list[str]:
        now = self._clock()
        replicas = self._replicas.get(check_shard(shard), {})
        for replica_id in [r for r, expiry in replicas.items() if expiry <= now]:
            del replicas[replica_id]
        return sorted(replicas)

    async def read(self, stream: str, *, after: str | None, count: int) -> list[StreamEntry]:
        check_stream(stream, count_or_maxlen=count)
        entries = self._streams.get(stream, deque())
        start = 0
        if after is not None:
            cursor = parse_entry_id(after)
            start = bisect.bisect_right(entries, cursor, key=lambda e: parse_entry_id(e.entry_id))
        return [entries[i] for i in range(start, min(start + count, len(entries)))]
