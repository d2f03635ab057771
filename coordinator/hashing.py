"""Contract import path (DESIGN): ``coordinator.hashing.page_keys``. Hashing lives in
``coordinator.core.hashing.page_hasher`` (the hasher) and ``coordinator.core.hashing.hash_config``
(its parameters);
this module re-exports their public names."""

from coordinator.core.hashing import (
    DEV_HASH_KEY,
    HashAlgorithm,
    HashConfig,
    Namespace,
    PageHasher,
    load_hash_config,
    page_keys,
    split_page_keys,
)
from coordinator.core.hashing.page_hasher import tokens_to_bytes

__all__ = [
    "DEV_HASH_KEY",
    "HashAlgorithm",
    "HashConfig",
    "Namespace",
    "PageHasher",
    "load_hash_config",
    "page_keys",
    "split_page_keys",
    "tokens_to_bytes",
]
