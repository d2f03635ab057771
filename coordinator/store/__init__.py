"""The metadata store: what must outlive a coordinator process or be shared between replicas.

One protocol (``coordinator.store.protocol``), two implementations:

- ``MemoryStore`` (``coordinator.store.memory``): in process, the default without ``--redis``;
  one coordinator only, nothing survives a restart.
- ``RedisStore`` (``coordinator.store.redis_store``): every key under ``kvcoord:{<namespace>}:``
  (a hash tag, so a namespace stays on one Redis Cluster slot); multi-key changes are Lua scripts.

The same contract tests (``tests/test_store_contract.py``) run against both. ``open_store`` picks
one from a URL; the implementations import only the protocol module, never this package face.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from coordinator.store.protocol import (
    STREAMS,
    MetadataStore,
    StoreUnavailable,
    StreamBounds,
    StreamEntry,
    WorkerRecord,
)

__all__ = [
    "STREAMS",
    "MetadataStore",
    "StoreUnavailable",
    "StreamBounds",
    "StreamEntry",
    "WorkerRecord",
    "open_store",
]

REDIS_SCHEMES = ("redis", "rediss", "unix")


async def open_store(
    url: str | None, *, namespace: str, clock: Callable[[], float] = time.monotonic,
    timeout_s: float = 5.0,
) -> MetadataStore:
    """``None`` -> a ``MemoryStore`` whose leases use ``clock`` (monotonic seconds); a
    ``redis://``, ``rediss://`` or ``unix://`` URL -> a connected ``RedisStore`` (leases are
    Redis TTLs, ``clock`` is unused). Raises ValueError for any other scheme and
    StoreUnavailable when Redis cannot be reached. ``timeout_s`` bounds every Redis command
    (an unreachable host must not stall a caller longer than that)."""
    if url is None:
        from coordinator.store.memory import MemoryStore

        return MemoryStore(namespace=namespace, clock=clock)
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme not in REDIS_SCHEMES:
        accepted = ", ".join(f"{s}://" for s in REDIS_SCHEMES)
        raise ValueError(f"unsupported store URL scheme {scheme!r}; accepted: {accepted}")
    from coordinator.store.redis_store import RedisStore

    return await RedisStore.connect(url, namespace=namespace, timeout_s=timeout_s)
