"""Contract import path (DESIGN): ``coordinator.hashing.page_keys``. Hashing lives in
``coordinator.core.hashing``; this module re-exports its public names."""

from coordinator.core.hashing import (
    DEV_HASH_KEY,
    HashAlgorithm,
    HashConfig,
    Namespace,
    PageHasher,
    load_hash_config,
    page_keys,
    split_page_keys,
    tokens_to_bytes,
)

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
