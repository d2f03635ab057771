"""What :class:`~coordinator.store.redis_store.RedisStore` sends to Redis and reads back.

- The Lua scripts: every change that reads before it writes is one script, so it is atomic
  across any number of clients. Each states the KEYS and ARGV it takes; timestamps come from
  Redis (``TIME``), never from a local clock. A per-incarnation script starts with the fencing
  check (a missing or re-registered worker hash fails it) and returns 0 when it fails.
- The encoding of records as hash fields and back: a worker hash holds ``incarnation``,
  ``registered_at_ms``, ``address``, ``policy_version``, ``external`` ("1"/"0") and
  ``info:<key>``; the policy hash holds every :class:`PolicyRecord` field as text, "" for None.
  Replies may be bytes or str; :func:`decode` takes either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from coordinator.core.policy_state import PolicyPhase, PolicyRecord
from coordinator.store.protocol import WorkerRecord

# KEYS: incarnation counter, worker hash, workers set. ARGV: worker id, lease ms, minimum
# incarnation, field/value...
REGISTER = """
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
RENEW = _IF_LIVE + "redis.call('PEXPIRE', KEYS[1], ARGV[2])\nreturn 1"

# KEYS: worker hash, workers set. ARGV: incarnation, worker id.
DEREGISTER = _IF_LIVE + "redis.call('DEL', KEYS[1])\nredis.call('SREM', KEYS[2], ARGV[2])\nreturn 1"

# KEYS: worker hash. ARGV: incarnation, field/value... (HSET keeps the key's TTL).
UPDATE = _IF_LIVE + "if #ARGV > 1 then redis.call('HSET', KEYS[1], unpack(ARGV, 2)) end\nreturn 1"

# KEYS: workers set, worker hashes. ARGV: worker ids. Forget ids whose hash (lease) is gone;
# re-checked here because the worker may have re-registered since the caller looked.
PRUNE = """
for i, worker_id in ipairs(ARGV) do
  if redis.call('EXISTS', KEYS[i + 1]) == 0 then redis.call('SREM', KEYS[1], worker_id) end
end
return 0
"""

# KEYS: replicas sorted set (score = expiry, Redis ms). ARGV: replica id or "", ttl ms.
# Drops the expired, then (with an id) announces it; returns the live ids.
REPLICAS = """
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ms)
if ARGV[1] ~= '' then redis.call('ZADD', KEYS[1], ms + tonumber(ARGV[2]), ARGV[1]) end
return redis.call('ZRANGE', KEYS[1], 0, -1)
"""

# KEYS: policy hash. ARGV: field names, expected, new, defaults: n values each (n = #ARGV / 4),
# in the order of POLICY_FIELDS. A field absent from the hash (no hash yet, or one written
# before the field existed) compares as its default.
CAS = """
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


def decode(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def decode_fields(raw: Mapping[Any, Any]) -> dict[str, str]:
    return {decode(k): decode(v) for k, v in raw.items()}


# Every PolicyRecord field, in the order the CAS script receives them.
POLICY_FIELDS = tuple(f.name for f in dataclasses.fields(PolicyRecord))


def encode_policy(record: PolicyRecord) -> list[str]:
    values = (getattr(record, name) for name in POLICY_FIELDS)
    return ["" if value is None else str(value) for value in values]  # None: no target


def decode_policy(raw: Mapping[str, str]) -> PolicyRecord:
    """The policy hash's fields as a record; no fields (no hash yet) is the initial record."""
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


def decode_worker(worker_id: str, fields: Mapping[str, str]) -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id,
        incarnation=int(fields["incarnation"]),
        address=fields["address"],
        policy_version=int(fields["policy_version"]),
        external=fields["external"] == "1",
        registered_at_ms=int(fields["registered_at_ms"]),
        info={k.removeprefix("info:"): v for k, v in fields.items() if k.startswith("info:")},
    )


def flatten(fields: Mapping[str, str]) -> list[str]:
    return [item for pair in fields.items() for item in pair]
