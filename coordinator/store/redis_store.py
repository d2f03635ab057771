"""``RedisStore``: the metadata store in Redis, shared by coordinator replicas.

Keys (all under ``kvcoord:{<namespace>}:``, one Redis Cluster slot per namespace):
``policy`` (hash), ``workers`` (set of ids), ``worker:<id>`` (hash; its TTL is the lease),
``incarnation:<id>`` (counter, never expires), ``events`` / ``rollouts`` (streams),
``acks:<version>`` (hash worker_id -> stage), ``replicas`` (sorted set: live coordinator
replicas, scored by expiry). A shard's replicas use ``events:<shard>`` and ``replicas:<shard>``
instead; every other key is shared by all shards of the namespace.

Every change that reads before it writes is one Lua script, so it is atomic across any number
of clients (the scripts, and how records are encoded as hash fields, are in
:mod:`coordinator.store.redis_scripts`). Timestamps come from Redis (``TIME``), never from the
local clock. Commands are not retried automatically: a retried CAS whose first reply was lost
would report False for a change it made. Connection errors and timeouts surface as
``StoreUnavailable``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.maint_notifications import MaintNotificationsConfig
from redis.typing import EncodableT, FieldT

from coordinator.core.policy_state import PolicyRecord
from coordinator.store.protocol import (
    StoreUnavailable,
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
from coordinator.store.redis_scripts import (
    CAS,
    DEREGISTER,
    POLICY_FIELDS,
    PRUNE,
    REGISTER,
    RENEW,
    REPLICAS,
    UPDATE,
    decode,
    decode_fields,
    decode_policy,
    decode_worker,
    encode_policy,
    flatten,
)


def redact_url(url: str) -> str:
    """The URL with any password (in the authority or a ``password=`` query) replaced by ***;
    everything else is left exactly as written."""
    scheme, sep, rest = url.partition("://")
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    tail = rest[len(authority) :]
    userinfo, at, host = authority.rpartition("@")
    if at and ":" in userinfo:
        authority = f"{userinfo.partition(':')[0]}:***@{host}"
    tail = re.sub(r"([?&]password=)[^&#]*", r"\1***", tail)
    return f"{scheme}{sep}{authority}{tail}"


class RedisStore:
    """``MetadataStore`` on Redis. Build it with ``await RedisStore.connect(url, namespace=)``."""

    def __init__(self, client: Redis, *, url: str, namespace: str) -> None:
        self.namespace = check_namespace(namespace)
        self._redis = client
        self._url = redact_url(url)
        self._prefix = f"kvcoord:{{{namespace}}}:"
        self._register = client.register_script(REGISTER)
        self._renew = client.register_script(RENEW)
        self._deregister = client.register_script(DEREGISTER)
        self._update = client.register_script(UPDATE)
        self._prune = client.register_script(PRUNE)
        self._cas = client.register_script(CAS)
        self._replicas = client.register_script(REPLICAS)

    @classmethod
    async def connect(cls, url: str, *, namespace: str, timeout_s: float = 5.0) -> RedisStore:
        """Connect and PING. Raises StoreUnavailable when Redis does not answer."""
        client = Redis.from_url(
            url,
            decode_responses=False,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            # NOTE: no automatic retry: a CAS retried after its reply was lost would report
            # False for a change it made. The error surfaces as StoreUnavailable instead.
            retry=Retry(NoBackoff(), 0),
            # With maintenance notifications on (redis-py's default, "auto") the pool skips its
            # check for connections the server closed, so every pooled connection would fail
            # once after a Redis restart. They are a managed-Redis feature we do not use.
            maint_notifications_config=MaintNotificationsConfig(enabled=False),
        )
        store = cls(client, url=url, namespace=namespace)
        try:
            with store._unavailable():
                await client.ping()
        except StoreUnavailable:
            await client.aclose()
            raise
        return store

    @contextlib.contextmanager
    def _unavailable(self) -> Iterator[None]:
        try:
            yield
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise StoreUnavailable(
                f"metadata store unavailable: redis at {self._url}: {exc}"
            ) from exc

    def _key(self, name: str) -> str:
        return self._prefix + name

    async def ping(self) -> bool:
        try:
            return bool(await self._redis.ping())
        except (RedisConnectionError, RedisTimeoutError):
            return False

    async def close(self) -> None:
        await self._redis.aclose()

    # --- worker registry ------------------------------------------------------------------

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
        fields = {
            "address": address,
            "policy_version": str(policy_version),
            "external": "1" if external else "0",
        } | {f"info:{k}": v for k, v in (info or {}).items()}
        keys = [
            self._key(f"incarnation:{worker_id}"),
            self._key(f"worker:{worker_id}"),
            self._key("workers"),
        ]
        with self._unavailable():
            incarnation, ms = await self._register(
                keys=keys, args=[worker_id, str(lease_ms), str(min_incarnation),
                                 *flatten(fields)]
            )
        stamped = {"incarnation": decode(incarnation), "registered_at_ms": decode(ms)}
        return decode_worker(worker_id, fields | stamped)

    async def renew_lease(self, worker_id: str, incarnation: int, lease_ms: int) -> bool:
        check_lease(lease_ms)
        key = self._key(f"worker:{worker_id}")
        with self._unavailable():
            return bool(await self._renew(keys=[key], args=[str(incarnation), str(lease_ms)]))

    async def get_worker(self, worker_id: str) -> WorkerRecord | None:
        with self._unavailable():
            raw = await self._redis.hgetall(self._key(f"worker:{worker_id}"))
        return decode_worker(worker_id, decode_fields(raw)) if raw else None

    async def list_workers(self) -> list[WorkerRecord]:
        """Reads the set, then each hash; ids whose hash expired are pruned from the set by a
        script that checks again (the worker may have registered anew in between)."""
        set_key = self._key("workers")
        with self._unavailable():
            ids = sorted(decode(member) for member in await self._redis.smembers(set_key))
            async with self._redis.pipeline(transaction=False) as pipe:
                for worker_id in ids:
                    pipe.hgetall(self._key(f"worker:{worker_id}"))
                hashes = await pipe.execute()
            expired = [worker_id for worker_id, raw in zip(ids, hashes, strict=True) if not raw]
            if expired:
                keys = [set_key, *(self._key(f"worker:{worker_id}") for worker_id in expired)]
                await self._prune(keys=keys, args=expired)
        return [
            decode_worker(worker_id, decode_fields(raw))
            for worker_id, raw in zip(ids, hashes, strict=True)
            if raw
        ]

    async def deregister_worker(self, worker_id: str, incarnation: int) -> bool:
        keys = [self._key(f"worker:{worker_id}"), self._key("workers")]
        with self._unavailable():
            return bool(await self._deregister(keys=keys, args=[str(incarnation), worker_id]))

    async def current_incarnation(self, worker_id: str) -> int:
        with self._unavailable():
            raw = await self._redis.get(self._key(f"incarnation:{worker_id}"))
        return 0 if raw is None else int(raw)

    async def update_worker(self, worker_id: str, incarnation: int, **fields: str) -> bool:
        core, info = split_worker_update(fields)
        updates = core | {f"info:{k}": v for k, v in info.items()}
        key = self._key(f"worker:{worker_id}")
        with self._unavailable():
            return bool(await self._update(keys=[key], args=[str(incarnation), *flatten(updates)]))

    # --- policy ---------------------------------------------------------------------------

    async def get_policy(self) -> PolicyRecord:
        with self._unavailable():
            raw = decode_fields(await self._redis.hgetall(self._key("policy")))
        return decode_policy(raw)

    async def cas_policy(self, expected: PolicyRecord, new: PolicyRecord) -> bool:
        check_policy_transition(expected, new)
        return await self._write_policy(expected, dataclasses.replace(new,
                                                                      epoch=expected.epoch + 1))

    async def restore_policy(self, expected: PolicyRecord, new: PolicyRecord) -> bool:
        check_policy_restore(expected, new)
        return await self._write_policy(expected, new)

    async def _write_policy(self, expected: PolicyRecord, written: PolicyRecord) -> bool:
        args = [
            *POLICY_FIELDS,
            *encode_policy(expected),
            *encode_policy(written),
            *encode_policy(PolicyRecord()),
        ]
        with self._unavailable():
            return bool(await self._cas(keys=[self._key("policy")], args=args))

    async def record_ack(self, version: int, worker_id: str, stage: str) -> None:
        check_worker_id(worker_id)
        with self._unavailable():
            await self._redis.hset(self._key(f"acks:{version}"), worker_id, stage)

    async def get_acks(self, version: int) -> dict[str, str]:
        with self._unavailable():
            return decode_fields(await self._redis.hgetall(self._key(f"acks:{version}")))

    # --- streams --------------------------------------------------------------------------

    async def append(self, stream: str, fields: Mapping[str, str], *, maxlen: int) -> str:
        check_stream(stream, count_or_maxlen=maxlen)
        entry: dict[FieldT, EncodableT] = {k: v for k, v in check_entry_fields(fields).items()}
        with self._unavailable():
            entry_id = await self._redis.xadd(
                self._key(stream), entry, maxlen=maxlen, approximate=True
            )
        return decode(entry_id)

    async def read(self, stream: str, *, after: str | None, count: int) -> list[StreamEntry]:
        check_stream(stream, count_or_maxlen=count)
        # "(" makes XRANGE's start exclusive: entries strictly after ``after``.
        start = "-" if after is None else f"({'-'.join(map(str, parse_entry_id(after)))}"
        with self._unavailable():
            raw = await self._redis.xrange(self._key(stream), min=start, max="+", count=count)
        return [
            StreamEntry(decode(entry_id), decode_fields(fields or {}))
            for entry_id, fields in raw or []
        ]

    async def append_many(
        self, stream: str, entries: Sequence[Mapping[str, str]], *, maxlen: int
    ) -> list[str]:
        check_stream(stream, count_or_maxlen=maxlen)
        checked = [check_entry_fields(fields) for fields in entries]
        if not checked:
            return []
        with self._unavailable():
            async with self._redis.pipeline(transaction=False) as pipe:
                for fields in checked:
                    entry: dict[FieldT, EncodableT] = dict(fields.items())
                    pipe.xadd(self._key(stream), entry, maxlen=maxlen, approximate=True)
                ids = await pipe.execute()
        return [decode(entry_id) for entry_id in ids]

    async def tail(
        self, stream: str, *, after: str, count: int, block_ms: int
    ) -> list[StreamEntry]:
        check_stream(stream, count_or_maxlen=count)
        cursor = "-".join(map(str, parse_entry_id(after)))
        with self._unavailable():
            # NOTE: at least 1 ms: XREAD BLOCK 0 would wait forever.
            raw = await self._redis.xread(
                {self._key(stream): cursor}, count=count, block=max(block_ms, 1)
            )
        streams: list[Any] = list(raw or [])
        return [
            StreamEntry(decode(entry_id), decode_fields(fields or {}))
            for _key, entries in streams
            for entry_id, fields in entries
        ]

    async def stream_bounds(self, stream: str) -> StreamBounds:
        check_stream(stream, count_or_maxlen=1)
        with self._unavailable():
            try:
                info = await self._redis.xinfo_stream(self._key(stream))
            except ResponseError:  # no such key
                return StreamBounds(None, None)
        first = info.get("first-entry")
        return StreamBounds(
            decode(first[0]) if first else None, decode(info["last-generated-id"])
        )

    def _replicas_key(self, shard: str) -> str:
        return self._key(f"replicas:{check_shard(shard)}" if shard else "replicas")

    async def announce_replica(self, replica_id: str, ttl_ms: int, *, shard: str = "") -> None:
        check_replica_id(replica_id)
        check_lease(ttl_ms)
        key = self._replicas_key(shard)
        with self._unavailable():
            await self._replicas(keys=[key], args=[replica_id, ttl_ms])

    async def live_replicas(self, *, shard: str = "") -> list[str]:
        key = self._replicas_key(shard)
        with self._unavailable():
            ids = await self._replicas(keys=[key], args=["", 0])
        return sorted(decode(replica_id) for replica_id in ids)
