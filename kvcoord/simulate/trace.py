"""Mooncake-format traces: loading, validation, and expansion into tokens and page keys.

A trace is JSON Lines, one request a line:
``{"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [...]}``. Each hash id
names one block of :data:`BLOCK_TOKENS` tokens and equal ids are equal blocks (the Mooncake
FAST'25 trace release, kvcache-ai/Mooncake ``FAST25-release/traces/``).

Expansion (deterministic, no state): hash id ``h`` becomes 512 pseudo-token ids below 2**24,
drawn from SHAKE-128 of ``h``, so equal ids give equal tokens and different ids (with
overwhelming probability) different ones; the prompt is the concatenation of its blocks, cut to
``input_length`` (the last block is usually partial). Page keys are then the production chained
keys (:class:`coordinator.hashing.PageHasher`), exactly what the coordinator would compute.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from coordinator.core.hashing import Namespace, PageHasher

BLOCK_TOKENS = 512
_TOKEN_BYTES = 4
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ValueError):
    """The trace cannot be read or a line is malformed; the message names the line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of the trace; ``index`` is its position (0-based) among kept requests."""

    index: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """The first ``limit`` requests of the trace (all when None), in arrival order.

    Requests are stably sorted by timestamp, so equal timestamps keep file order. Blank lines
    are skipped. TraceError for a missing or unreadable file, and for a line that is not a JSON
    object with the four fields, non-negative numbers, integer hash ids, and an
    ``input_length`` that fits its blocks (``(len(hash_ids)-1)*512 < input_length <=
    len(hash_ids)*512``); ValueError for ``limit < 1``.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    path = Path(path)
    try:
        handle = path.open(encoding="utf-8")
    except FileNotFoundError:
        raise TraceError(f"trace file not found: {path}") from None
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None
    requests: list[TraceRequest] = []
    with handle:
        for lineno, line in enumerate(handle, start=1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            requests.append(_parse_line(line, lineno, path, len(requests)))
    if not requests:
        raise TraceError(f"trace {path} holds no requests")
    ordered = sorted(requests, key=lambda r: r.timestamp_ms)
    return [_reindexed(r, i) for i, r in enumerate(ordered)]


def _reindexed(request: TraceRequest, index: int) -> TraceRequest:
    if request.index == index:
        return request
    return TraceRequest(index, request.timestamp_ms, request.input_length,
                        request.output_length, request.hash_ids)


def _parse_line(line: str, lineno: int, path: Path, index: int) -> TraceRequest:
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object")
    missing = [f for f in _FIELDS if f not in obj]
    if missing:
        raise TraceError(f"{where}: missing field(s) {', '.join(missing)}")
    timestamp = obj["timestamp"]
    if isinstance(timestamp, bool) or not isinstance(timestamp, int | float) or not (
        math.isfinite(timestamp) and timestamp >= 0
    ):
        raise TraceError(f"{where}: timestamp must be a number >= 0 (ms)")
    lengths = []
    for name in ("input_length", "output_length"):
        value = obj[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TraceError(f"{where}: {name} must be an integer >= 0")
        lengths.append(value)
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids
    ):
        raise TraceError(f"{where}: hash_ids must be a list of integers >= 0")
    input_length, output_length = lengths
    if not (len(ids) - 1) * BLOCK_TOKENS < input_length <= len(ids) * BLOCK_TOKENS:
        raise TraceError(
            f"{where}: input_length {input_length} does not fit {len(ids)} block(s) of "
            f"{BLOCK_TOKENS} tokens"
        )
    return TraceRequest(index, float(timestamp), input_length, output_length, tuple(ids))


def block_tokens(hash_id: int) -> bytes:
    """The 512 pseudo-token ids of block ``hash_id`` as little-endian u32 bytes (each < 2**24)."""
    raw = bytearray(hashlib.shake_128(b"kvcoord.trace.block:%d" % hash_id).digest(
        BLOCK_TOKENS * _TOKEN_BYTES
    ))
    raw[3::4] = bytes(BLOCK_TOKENS)  # clear each id's top byte: ids stay below 2**24
    return bytes(raw)


def prompt_bytes(request: TraceRequest) -> bytes:
    """The request's prompt as little-endian u32 token ids: its blocks cut to input_length."""
    data = b"".join(block_tokens(h) for h in request.hash_ids)
    return data[: request.input_length * _TOKEN_BYTES]


def trace_page_keys(
    requests: Sequence[TraceRequest], hasher: PageHasher, namespace: Namespace
) -> list[list[bytes]]:
    """Every request's page keys (production chained keys), computed once for all policies.

    Equal keys are shared as one object across requests, so memory grows with the distinct
    pages of the trace rather than with the sum of prompt lengths.
    """
    canonical: dict[bytes, bytes] = {}
    out: list[list[bytes]] = []
    for request in requests:
        keys = hasher.page_keys(prompt_bytes(request), namespace)
        out.append([canonical.setdefault(k, k) for k in keys])
    return out
