"""``RedisStore``: the metadata store in Redis, shared by coordinator replicas.

Keys (all under ``kvcoord:{<namespace>}:``, one Redis Cluster slot per namespace):
``policy`` (hash), ``workers`` (set of ids), ``worker:<id>`` (hash; its TTL is the lease),
``incarnation:<id>`` (counter, never expires), ``events`` / ``rollouts`` (streams),
``acks:<version>`` (hash worker_id -> stage).

Every change that reads before it writes is one Lua script, so it is atomic across any number
of clients. Timestamps come from Redis (``TIME``), never from the local clock. Commands are
not retried automatically: a retried CAS whose first reply was lost would report False for a
change it made. Connection errors and timeouts surface as ``StoreUnavailable``.
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

from coordinator.core.policy_state import PolicyPhase, PolicyRecord
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
    check_stream,
    check_worker_id,
    parse_entry_id,
    split_worker_update,
)

# KEYS: incarnation counter, worker hash, workers set. ARGV: worker id, lease ms, minimum
# incarnation, field/value...
_REGISTER = """
local incarnation = redis.call('INCR', KEYS[1])
if incarnation < tonumber(ARGV[3]) then
  incarnation = tonumber(ARGV[3])
  redis.call('SET', KEYS[1], incarnation)
end
local now = redis.call('TIME')
local ms = now[1] .. string.sub(string.format('%06d', tonumber(now[2])), 1, 3)
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'incarnation', incarnation, 'registered_at_ms', ms, unpack(ARGV, 4))
redis.call('PEXPIRE', KEYS[2], ARGV[2])
redis.call('SADD', KEYS[3], ARGV[1])
return {incarnation, ms}
"""

# The fencing check every per-incarnation call starts with: a missing (expired) hash fails too.
_IF_LIVE = "if redis.call('HGET', KEYS[1], 'incarnation') ~= ARGV[1] then return 0 end\n"

# KEYS: worker hash. ARGV: incarnation, lease ms.
_RENEW = _IF_LIVE + "redis.call('PEXPIRE', KEYS[1], ARGV[2])\nreturn 1"

# KEYS: worker hash, workers set. ARGV: incarnation, worker id.
_DEREGISTER = (
    _IF_LIVE + "redis.call('DEL', KEYS[1])\nredis.call('SREM', KEYS[2], ARGV[2])\nreturn 1"
)

# KEYS: worker hash. ARGV: incarnation, field/value... (HSET keeps the key's TTL).
_UPDATE = _IF_LIVE + "if #ARGV > 1 then redis.call('HSET', KEYS[1], unpack(ARGV, 2)) end\nreturn 1"

# KEYS: workers set, worker hashes. ARGV: worker ids. Forget ids whose hash (lease) is gone;
# re-checked here because the worker may have re-registered since the caller looked.
_PRUNE = """
for i, worker_id in ipairs(ARGV) do
  if redis.call('EXISTS', KEYS[i + 1]) == 0 then redis.call('SREM', KEYS[1], worker_id) end
end
return 0
"""

# KEYS: replicas sorted set (score = expiry, Redis ms). ARGV: replica id or "", ttl ms.
# Drops the expired, then (with an id) announces it; returns the live ids.
_REPLICAS = """
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ms)
if ARGV[1] ~= '' then redis.call('ZADD', KEYS[1], ms + tonumber(ARGV[2]), ARGV[1]) end
return redis.call('ZRANGE', KEYS[1], 0, -1)
"""

# KEYS: policy hash. ARGV: field names, expected, new, defaults: n values each (n = #ARGV / 4),
# in the order of _POLICY_FIELDS. A field absent from the hash (no hash yet, or one written
# before the field existed) compares as its default.
_CAS = """
local n = #ARGV / 4
local stored = redis.call('HMGET', KEYS[1], unpack(ARGV, 1, n))
local written = {}
for i = 1, n do
  if (stored[i] or ARGV[3 * n + i]) ~= ARGV[n + i] then return 0 end
  written[2 * i - 1], written[2 * i] = ARGV[i], ARGV[2 * n + i]
end
redis.call('HSET', KEYS[1], unpack(written))
return 1
"""


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


def _str(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _text(raw: Mapping[Any, Any]) -> dict[str, str]:
    return {_str(k): _str(v) for k, v in raw.items()}


# Every PolicyRecord field, in the order the CAS script receives them.
_POLICY_FIELDS = tuple(f.name for f in dataclasses.fields(PolicyRecord))


def _encode_policy(record: PolicyRecord) -> list[str]:
    values = (getattr(record, name) for name in _POLICY_FIELDS)
    return ["" if value is None else str(value) for value in values]  # None: no target


def _decode_worker(worker_id: str, fields: Mapping[str, str]) -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id,
        incarnation=int(fields["incarnation"]),
        address=fields["address"],
        policy_version=int(fields["policy_version"]),
        external=fields["external"] == "1",
        registered_at_ms=int(fields["registered_at_ms"]),
        info={k.removeprefix("info:"): v for k, v in fields.items() if k.startswith("info:")},
    )


def _flatten(fields: Mapping[str, str]) -> list[str]:
    return [item for pair in fields.items() for item in pair]


class RedisStore:
    """``MetadataStore`` on Redis. Build it with ``await RedisStore.connect(url, namespace=)``."""

    def __init__(self, client: Redis, *, url: str, namespace: str) -> None:
        self.namespace = check_namespace(namespace)
        self._redis = client
        self._url = redact_url(url)
        self._prefix = f"kvcoord:{{{namespace}}}:"
        self._register = client.register_script(_REGISTER)
        self._renew = client.register_script(_RENEW)
        self._deregister = client.register_script(_DEREGISTER)
        self._update = client.register_script(_UPDATE)
        self._prune = client.register_script(_PRUNE)
        self._cas = client.register_script(_CAS)
        self._replicas = client.register_script(_REPLICAS)

    @classmethod
    async def connect(cls, url: str, *, namespace: str, timeout_s: float = 5.0) -> RedisStore:
        """Connect and PING. Raises StoreUnavailable when Redis does not answer."""
        client = Redis.from_url(
            url,
            decode_responses=False,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
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
                                 *_flatten(fields)]
            )
        stamped = {"incarnation": _str(incarnation), "registered_at_ms": _str(ms)}
        return _decode_worker(worker_id, fields | stamped)

    async def renew_lease(self, worker_id: str, incarnation: int, lease_ms: int) -> bool:
        check_lease(lease_ms)
        key = self._key(f"worker:{worker_id}")
        with self._unavailable():
            return bool(await self._renew(keys=[key], args=[str(incarnation), str(lease_ms)]))

    async def get_worker(self, worker_id: str) -> WorkerRecord | None:
        with self._unavailable():
            raw = await self._redis.hgetall(self._key(f"worker:{worker_id}"))
        return _decode_worker(worker_id, _text(raw)) if raw else None

    async def list_workers(self) -> list[WorkerRecord]:
        set_key = self._key("workers")
        with self._unavailable():
            ids = sorted(_str(member) for member in await self._redis.smembers(set_key))
            async with self._redis.pipeline(transaction=False) as pipe:
                for worker_id in ids:
                    pipe.hgetall(self._key(f"worker:{worker_id}"))
                hashes = await pipe.execute()
            expired = [worker_id for worker_id, raw in zip(ids, hashes, strict=True) if not raw]
            if expired:
                keys = [set_key, *(self._key(f"worker:{worker_id}") for worker_id in expired)]
                await self._prune(keys=keys, args=expired)
        return [
            _decode_worker(worker_id, _text(raw))
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
            return bool(await self._update(keys=[key], args=[str(incarnation), *_flatten(updates)]))

    # --- policy ---------------------------------------------------------------------------

    async def get_policy(self) -> PolicyRecord:
        with self._unavailable():
            raw = _text(await self._redis.hgetall(self._key("policy")))
        if not raw:
            return PolicyRecord()
        return PolicyRecord(
            version=int(raw["version"]),
            phase=PolicyPhase(raw["phase"]),
            target_version=int(raw["target_version"]) if raw["target_version"] else None,
            mode=raw["mode"],
            epoch=int(raw["epoch"]),
            weights_uri=raw.get("weights_uri", ""),
            target_weights_uri=raw.get("target_weights_uri", ""),
            restored_at_ms=int(raw.get("restored_at_ms", "0")),
        )

    async def cas_policy(self, expected: PolicyRecord, new: PolicyRecord) -> bool:
        check_policy_transition(expected, new)
        return await self._write_policy(expected, dataclasses.replace(new,
                                                                      epoch=expected.epoch + 1))

    async def restore_policy(self, expected: PolicyRecord, new: PolicyRecord) -> bool:
        check_policy_restore(expected, new)
        return await self._write_policy(expected, new)

    async def _write_policy(self, expected: PolicyRecord, written: PolicyRecord) -> bool:
        args = [
            *_POLICY_FIELDS,
            *_encode_policy(expected),
            *_encode_policy(written),
            *_encode_policy(PolicyRecord()),
        ]
        with self._unavailable():
            return bool(await self._cas(keys=[self._key("policy")], args=args))

    async def record_ack(self, version: int, worker_id: str, stage: str) -> None:
        check_worker_id(worker_id)
        with self._unavailable():
            await self._redis.hset(self._key(f"acks:{version}"), worker_id, stage)

    async def get_acks(self, version: int) -> dict[str, str]:
        with self._unavailable():
            return _text(await self._redis.hgetall(self._key(f"acks:{version}")))

    # --- streams --------------------------------------------------------------------------

    async def append(self, stream: str, fields: Mapping[str, str], *, maxlen: int) -> str:
        check_stream(stream, count_or_maxlen=maxlen)
        entry: dict[FieldT, EncodableT] = {k: v for k, v in check_entry_fields(fields).items()}
        with self._unavailable():
            entry_id = await self._redis.xadd(
                self._key(stream), entry, maxlen=maxlen, approximate=True
            )
        return _str(entry_id)

    async def read(self, stream: str, *, after: str | None, count: int) -> list[StreamEntry]:
        check_stream(stream, count_or_maxlen=count)
        start = "-" if after is None else f"({'-'.join(map(str, parse_entry_id(after)))}"
        with self._unavailable():
            raw = await self._redis.xrange(self._key(stream), min=start, max="+", count=count)
        return [StreamEntry(_str(entry_id), _text(fields or {})) for entry_id, fields in raw or []]

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
        return [_str(entry_id) for entry_id in ids]

    async def tail(
        self, stream: str, *, after: str, count: int, block_ms: int
    ) -> list[StreamEntry]:
        check_stream(stream, count_or_maxlen=count)
        cursor = "-".join(map(str, parse_entry_id(after)))
        with self._unavailable():
            raw = await self._redis.xread(
                {self._key(stream): cursor}, count=count, block=max(block_ms, 1)
            )
        streams: list[Any] = list(raw or [])
        return [
            StreamEntry(_str(entry_id), _text(fields or {}))
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
        return StreamBounds(_str(first[0]) if first else None, _str(info["last-generated-id"]))

    async def announce_replica(self, replica_id: str, ttl_ms: int) -> None:
        check_replica_id(replica_id)
        check_lease(ttl_ms)
        with self._unavailable():
            await self._replicas(keys=[self._key("replicas")], args=[replica_id, ttl_ms])

    async def live_replicas(self) -> list[str]:
        with self._unavailable():
            ids = await self._replicas(keys=[self._key("replicas")], args=["", 0])
        return sorted(_str(replica_id) for replica_id in ids)
