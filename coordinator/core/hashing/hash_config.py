"""What a page key is bound to: the deployment's hashing parameters and a key's namespace.

- :class:`HashConfig`: the hash key (the deployment secret, 16..64 bytes), the algorithm and
  the page size. Workers and the coordinator must agree on all three; its ``fingerprint()``
  lets them compare without revealing the key. :func:`load_hash_config` reads it from
  ``KVCOORD_HASH_KEY``, ``KVCOORD_HASH_ALGORITHM`` and ``KVCOORD_PAGE_SIZE``.
- :class:`Namespace`: model, adapter, tenant salt, policy version and page size.
  :func:`encode_root` turns it (with the algorithm) into the chain's root message, so identical
  tokens under another version, tenant or adapter never share a key.
- :data:`PAGE_KEY_BYTES`: every page key (and fingerprint) is 16 bytes; defined here only.

Out-of-range values raise ValueError, never echoing the key. The hasher that uses all this is
:mod:`coordinator.core.hashing.page_hasher`.

Pure core: no I/O and no clock; configuration comes in as a mapping (the environment by default).
"""

from __future__ import annotations

import enum
import hashlib
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

PAGE_KEY_BYTES = 16
MIN_KEY_BYTES = 16
MAX_KEY_BYTES = 64  # BLAKE2b accepts keys of at most 64 bytes
MAX_PAGE_SIZE = 4096
MAX_POLICY_VERSION = 2**64 - 1

# Fixed, public development key. Anyone can compute keys under it, so it gives no tenant
# isolation; HashConfig logs a warning whenever it is used.
DEV_HASH_KEY = b"kvcoord-development-hash-key-not-secret"

_ROOT_TAG = b"kvcoord.root.v1"
_FINGERPRINT_TAG = b"kvcoord.fingerprint.v1"


__all__ = [
    "DEV_HASH_KEY",
    "MAX_KEY_BYTES",
    "MAX_PAGE_SIZE",
    "MAX_POLICY_VERSION",
    "MIN_KEY_BYTES",
    "PAGE_KEY_BYTES",
    "HashAlgorithm",
    "HashConfig",
    "Namespace",
    "encode_root",
    "load_hash_config",
]

class HashAlgorithm(enum.StrEnum):
    """The page hash ``H``. The value is what goes into the root and on the wire."""

    BLAKE2B = "blake2b-128"
    XXH3 = "xxh3-128"  # fast, NOT collision resistant against adversaries


@dataclass(frozen=True, slots=True)
class Namespace:
    """What a key is valid for; all of it is bound into the chain's root.

    ValueError for a page size outside 1..4096 or a policy version outside uint64.
    """

    model: str = "default"
    adapter: str = ""
    tenant: str = ""
    policy_version: int = 0
    page_size: int = 16
    cache_salt: str = ""
    """An engine's per-request salt (vLLM's ``cache_salt``): bound after the root
    (``PageHasher.root``), so "" leaves every other namespace's keys as they were."""

    def __post_init__(self) -> None:
        _check_page_size(self.page_size)
        if not 0 <= self.policy_version <= MAX_POLICY_VERSION:
            raise ValueError(f"policy_version {self.policy_version} outside uint64")


@dataclass(frozen=True, slots=True)
class HashConfig:
    """Deployment hashing parameters. Workers and the coordinator must agree on all three.

    Raises ValueError for a key outside 16..64 bytes or a page size outside 1..4096.
    """

    key: bytes = field(repr=False)  # never log the secret
    algorithm: HashAlgorithm = HashAlgorithm.BLAKE2B
    page_size: int = 16

    def __post_init__(self) -> None:
        if not isinstance(self.key, bytes):
            raise ValueError("hash key must be bytes")
        if not MIN_KEY_BYTES <= len(self.key) <= MAX_KEY_BYTES:
            raise ValueError(
                f"hash key must be {MIN_KEY_BYTES}..{MAX_KEY_BYTES} bytes, got {len(self.key)}"
            )
        # Normalise strings to the enum; an unknown name raises ValueError listing nothing
        # secret. object.__setattr__ because the dataclass is frozen.
        object.__setattr__(self, "algorithm", _parse_algorithm(self.algorithm))
        _check_page_size(self.page_size)

    @classmethod
    def from_hex_key(
        cls,
        hex_key: str,
        algorithm: HashAlgorithm | str = HashAlgorithm.BLAKE2B,
        page_size: int = 16,
    ) -> HashConfig:
        """Build from a hex-encoded key (how ``KVCOORD_HASH_KEY`` is given)."""
        try:
            key = bytes.fromhex(hex_key.strip())
        except ValueError:
            raise ValueError("hash key is not valid hex") from None  # don't echo the secret
        return cls(key=key, algorithm=_parse_algorithm(algorithm), page_size=page_size)

    @property
    def uses_development_key(self) -> bool:
        """Whether the key is the public :data:`DEV_HASH_KEY` (no secret: callers warn)."""
        return self.key == DEV_HASH_KEY

    def fingerprint(self) -> bytes:
        """16 bytes that are equal iff key, algorithm and page size are equal.

        A keyed BLAKE2b of a fixed label, the algorithm and the page size: without the key it
        reveals nothing about the key (BLAKE2b is a PRF), so ``Register`` may send it in clear.
        """
        material = _lp(_FINGERPRINT_TAG) + _lp(self.algorithm.encode()) + _u32(self.page_size)
        return hashlib.blake2b(material, key=self.key, digest_size=PAGE_KEY_BYTES).digest()


def load_hash_config(env: Mapping[str, str] | None = None) -> HashConfig:
    """Read ``KVCOORD_HASH_KEY`` (hex), ``KVCOORD_HASH_ALGORITHM``, ``KVCOORD_PAGE_SIZE``.

    ``env`` defaults to ``os.environ``. No (or an empty) key means :data:`DEV_HASH_KEY`, with
    a warning. A bad value raises ValueError naming the variables (never echoing the key).
    """
    env = os.environ if env is None else env
    hex_key = env.get("KVCOORD_HASH_KEY", "")
    try:
        algorithm = _parse_algorithm(env.get("KVCOORD_HASH_ALGORITHM") or HashAlgorithm.BLAKE2B)
        page_size = int(env.get("KVCOORD_PAGE_SIZE") or 16)
        if not hex_key:
            return HashConfig(DEV_HASH_KEY, algorithm, page_size)
        return HashConfig.from_hex_key(hex_key, algorithm, page_size)
    except ValueError as exc:
        variables = "KVCOORD_HASH_KEY, KVCOORD_HASH_ALGORITHM, KVCOORD_PAGE_SIZE"
        raise ValueError(f"bad hash configuration in {variables}: {exc}") from None


def encode_root(namespace: Namespace, algorithm: HashAlgorithm) -> bytes:
    """The canonical root message: a tag, then length-prefixed strings and fixed-width ints.

    Layout: lp(tag) lp(algorithm) lp(model) lp(adapter) lp(tenant) u64(policy_version)
    u32(page_size), where lp(b) = u32le(len(b)) || b and strings are UTF-8. Every field has a
    length or a fixed width, so no two namespaces encode to the same bytes.
    """
    return b"".join(
        (
            _lp(_ROOT_TAG),
            _lp(algorithm.value.encode()),
            _lp(namespace.model.encode()),
            _lp(namespace.adapter.encode()),
            _lp(namespace.tenant.encode()),
            struct.pack("<Q", namespace.policy_version),
            _u32(namespace.page_size),
        )
    )


def _parse_algorithm(value: HashAlgorithm | str) -> HashAlgorithm:
    try:
        return HashAlgorithm(value)
    except ValueError:
        allowed = ", ".join(a.value for a in HashAlgorithm)
        raise ValueError(f"hash algorithm must be one of {allowed}, got {value!r}") from None


def _check_page_size(page_size: int) -> None:
    if not 1 <= page_size <= MAX_PAGE_SIZE:
        raise ValueError(f"page_size must be 1..{MAX_PAGE_SIZE}, got {page_size}")


def _u32(value: int) -> bytes:
    return struct.pack("<I", value)


def _lp(data: bytes) -> bytes:
    return _u32(len(data)) + data
