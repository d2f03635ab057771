"""Rollout attribution records (ARCHITECTURE §0, invariant 4): which policy version, on which
worker, produced each generation, and the bounds every record must respect."""

from __future__ import annotations

from dataclasses import dataclass

MAX_RECORDS_PER_CALL = 4096
MAX_ROLLOUT_ID_CHARS = 256
MAX_TOKENS = 2**32 - 1  # the wire fields are uint32
MAX_VERSION = 2**63 - 1  # uint64 on the wire; Redis and Python agree up to here
_MAX_ID_PART = 2**64 - 1  # each half of a Redis stream id is a u64
_COUNTS = ("prompt_tokens", "cached_tokens", "completion_tokens")


@dataclass(frozen=True, slots=True)
class Rollout:
    """One generation's attribution record. ``cached_tokens`` <= ``prompt_tokens``;
    ``cursor`` is the stream entry id, set only on records read back from the log."""

    rollout_id: str
    policy_version: int
    worker_id: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cursor: str = ""
