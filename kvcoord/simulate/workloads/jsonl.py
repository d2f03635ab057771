"""Generated requests as a Mooncake trace file: the bytes, their sha256, and the loader's checks.

:func:`dumps` writes what ``kvcoord simulate --write-trace`` saves: one JSON object a line,
``{"timestamp", "input_length", "output_length", "hash_ids"}``, timestamps in whole
milliseconds. A report's ``trace_sha256`` for a generated workload is the sha256 of these
bytes, so ``--trace`` on the written file names the very same content.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from kvcoord.simulate.trace import BLOCK_TOKENS, TraceRequest


def dumps(requests: Sequence[TraceRequest]) -> bytes:
    """The requests as Mooncake JSON Lines (UTF-8, one line each, a newline after each)."""
    lines = []
    for r in requests:
        stamp = int(r.timestamp_ms) if r.timestamp_ms.is_integer() else r.timestamp_ms
        lines.append(json.dumps({"timestamp": stamp, "input_length": r.input_length,
                                 "output_length": r.output_length,
                                 "hash_ids": list(r.hash_ids)}))
    return ("\n".join(lines) + "\n").encode()


def sha256(requests: Sequence[TraceRequest]) -> str:
    """Hex sha256 of :func:`dumps` (what ``trace_identity`` would say of the written file)."""
    return hashlib.sha256(dumps(requests)).hexdigest()


def write(requests: Sequence[TraceRequest], path: str | Path) -> None:
    """Write :func:`dumps` to ``path`` (replaced if it exists)."""
    Path(path).write_bytes(dumps(requests))


def check(requests: Sequence[TraceRequest]) -> None:
    """ValueError naming the first request the trace loader would refuse: a negative or
    non-finite time, negative lengths or ids, or an ``input_length`` that does not fit its
    blocks (``(len(hash_ids) - 1) * 512 < input_length <= len(hash_ids) * 512``)."""
    for position, r in enumerate(requests):
        fits = (len(r.hash_ids) - 1) * BLOCK_TOKENS < r.input_length <= (
            len(r.hash_ids) * BLOCK_TOKENS)
        if not (0 <= r.timestamp_ms < float("inf") and r.output_length >= 0 and fits
                and all(h >= 0 for h in r.hash_ids)):
            raise ValueError(f"request {position} is not a valid trace request: {r!r}")
