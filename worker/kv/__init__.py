"""A worker's KV bookkeeping, with no torch: which page holds which prefix, on which tier.

- ``allocator``: ``PageAllocator``, a free stack, reference counts and an LRU of cached pages
  (``worker.allocator`` re-exports it as the documented contract).
- ``prefix_cache``: ``PrefixCache``, chained page key -> the page holding that prefix's KV.
- ``host_tier``: ``HostTier``, the host-memory tier below it.

Pure core: no I/O (import-linter checks it).
"""

from worker.kv.allocator import AllocatorIntegrityError, OutOfPages, PageAllocator
from worker.kv.host_tier import HostTier
from worker.kv.prefix_cache import PrefixCache, PrefixHit

__all__ = ["AllocatorIntegrityError", "HostTier", "OutOfPages", "PageAllocator", "PrefixCache",
           "PrefixHit"]
