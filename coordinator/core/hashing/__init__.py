"""Hashing: a prompt's token ids -> its chained, keyed page keys (PROTOCOL.md §3).

- ``hash_config``: the hash key, the namespace (model, adapter, tenant, policy version, page
  size) that roots every chain, and their limits.
- ``page_hasher``: ``PageHasher`` and ``page_keys``, the chain itself (compiled where built:
  ``coordinator.core.accel``).

Pure core: no I/O. ``coordinator.hashing`` re-exports ``page_keys`` as the documented contract.
"""

from coordinator.core.hashing.hash_config import (
    DEV_HASH_KEY,
    MAX_PAGE_SIZE,
    MAX_POLICY_VERSION,
    PAGE_KEY_BYTES,
    HashAlgorithm,
    HashConfig,
    Namespace,
    encode_root,
    load_hash_config,
)
from coordinator.core.hashing.page_hasher import PageHasher, PageKeys, page_keys, split_page_keys

__all__ = [
    "DEV_HASH_KEY", "MAX_PAGE_SIZE", "MAX_POLICY_VERSION", "PAGE_KEY_BYTES", "HashAlgorithm",
    "HashConfig", "Namespace", "PageHasher", "PageKeys", "encode_root", "load_hash_config",
    "page_keys", "split_page_keys",
]
