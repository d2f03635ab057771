"""Chained, keyed page hashing: the contract every worker and the coordinator share.

Tokens are cut into pages of ``page_size`` tokens; only full pages get a key. Page i's key is

    h_i    = H(h_{i-1} || le_u32(tokens of page i))        (16 bytes)
    h_{-1} = H(root(namespace, algorithm))

so a key names a whole prefix, not one page. ``root`` binds the model, adapter, tenant salt,
policy version, page size and algorithm (see :func:`encode_root`), so identical tokens under
another version, tenant or adapter never share a key.

``H`` is keyed BLAKE2b with a 16-byte digest; the key is the deployment secret. The opt-in
``xxh3-128`` mode is several times faster but NOT collision resistant against an adversary:
use it only for single-tenant fleets whose prompts are trusted.

Re-hash only what is new: :class:`PageHasher` keeps a bounded chain cache mapping
``parent key || page bytes`` to the child key, so a multi-turn conversation or a GRPO group
re-hashes only its new pages. The parent of page 0 is the namespace root, hence cached chains of
different namespaces can never mix.

Pure core: no I/O and no clock; configuration comes in as a mapping (the environment by default).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import os
import struct
import sys
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import structlog

log = structlog.get_logger(__name__)

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

# array('I') is 4 bytes on every platform CPython supports; pick 'L' only if that ever changes.
_U32_TYPECODE = next(code for code in ("I", "L") if array(code).itemsize == 4)
_BYTES_LIKE = (bytes, bytearray, memoryview)
# Pages per run entry of the chain cache: one lookup finds this many cached pages.
CHUNK_PAGES = 16


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
        if self.key == DEV_HASH_KEY:
            log.warning("hashing.dev_key", detail="set KVCOORD_HASH_KEY; the dev key is public")

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


def tokens_to_bytes(tokens: Sequence[int] | bytes | bytearray | memoryview) -> bytes:
    """Token ids as little-endian uint32, converted once per prompt.

    Bytes-like input is taken as already encoded (e.g. a proto ``bytes`` field) and must be a
    multiple of 4 bytes. Raises ValueError for an id outside uint32 (negatives included).
    """
    if isinstance(tokens, _BYTES_LIKE):
        raw = bytes(tokens)
        if len(raw) % 4:
            raise ValueError(f"encoded tokens must be a multiple of 4 bytes, got {len(raw)}")
        return raw
    try:
        packed = array(_U32_TYPECODE, tokens)
    except OverflowError:
        bad = next(t for t in tokens if not 0 <= t <= 0xFFFFFFFF)
        raise ValueError(f"token id {bad} outside uint32") from None
    except TypeError:
        raise ValueError("token ids must be integers") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def split_page_keys(blob: bytes) -> list[bytes]:
    """Split concatenated 16-byte digests (the wire form) into keys; ValueError if ragged."""
    if len(blob) % PAGE_KEY_BYTES:
        raise ValueError(f"page key blob length {len(blob)} is not a multiple of {PAGE_KEY_BYTES}")
    # One C-level unpack ("16s" repeated) is ~6x faster than slicing in a comprehension.
    return list(struct.unpack(f"{PAGE_KEY_BYTES}s" * (len(blob) // PAGE_KEY_BYTES), blob))


class PageHasher:
    """Computes page keys under one :class:`HashConfig`, with a bounded chain cache.

    The cache maps ``parent key || page bytes`` to the page's key, and, for every aligned run
    of :data:`CHUNK_PAGES` pages, ``parent key || the run's bytes`` to the run's keys, so a
    cached prefix is found with one lookup per 16 pages (then one per page inside the run
    where it ends). It holds at most ``cache_pages`` entries (both kinds) in two generations:
    lookups hit either, new entries go into the young one, and when the young one is full the
    old one is dropped whole (O(1) eviction, roughly LRU because hits in the old generation
    are promoted). ``cache_pages=0`` disables it. Memory is about 250 bytes per cached page
    (~60 MiB at the default of 262,144 pages). Not thread-safe.
    """

    def __init__(self, config: HashConfig, *, cache_pages: int = 262_144) -> None:
        if cache_pages < 0:
            raise ValueError("cache_pages must be >= 0")
        self.config = config
        self.hits = 0
        self.misses = 0
        self._digest = _make_digest(config)
        self._generation_size = cache_pages // 2 if cache_pages > 1 else cache_pages
        self._young: dict[bytes, bytes] = {}
        self._old: dict[bytes, bytes] = {}
        self._young_runs: dict[bytes, tuple[bytes, ...]] = {}
        self._old_runs: dict[bytes, tuple[bytes, ...]] = {}
        self._roots: dict[Namespace, bytes] = {}  # few namespaces in practice; bounded anyway

    def root(self, namespace: Namespace) -> bytes:
        """``h_{-1}`` for ``namespace``: H(encode_root(namespace, algorithm))."""
        root = self._roots.get(namespace)
        if root is None:
            root = self._digest(encode_root(namespace, self.config.algorithm))
            if len(self._roots) >= 4096:  # tenants are unbounded; roots are cheap to redo
                self._roots.clear()
            self._roots[namespace] = root
        return root

    def page_keys(
        self,
        tokens: Sequence[int] | bytes | bytearray | memoryview,
        namespace: Namespace,
    ) -> list[bytes]:
        """Keys of the full pages of ``tokens`` (cut by ``namespace.page_size``), in order.

        A partial last page gets no key. Updates the ``hits``/``misses`` counters.
        """
        root = parent = self.root(namespace)
        data = tokens_to_bytes(tokens)
        page_bytes = 4 * namespace.page_size
        run_bytes = CHUNK_PAGES * page_bytes
        full = len(data) - len(data) % page_bytes
        keys: list[bytes] = []
        pos = 0
        if self._generation_size:
            # Warm phase 1: whole runs of pages, one lookup each.
            young_runs, old_runs = self._young_runs, self._old_runs
            while pos + run_bytes <= full:
                message = parent + data[pos : pos + run_bytes]
                run = young_runs.get(message)
                if run is None:
                    run = old_runs.get(message)
                    if run is None:
                        break
                    young_runs[message] = run  # promote so it survives the next rotation
                keys += run
                parent = run[-1]
                pos += run_bytes
        runs_found = pos
        # Warm phase 2: page by page inside the run where the cached prefix ends. Each call
        # leaves every page it walked or hashed in the young generation, so both generations
        # hold whole chain prefixes: after the first miss no later page can hit. (Slicing
        # bytes measured faster than a memoryview.)
        append = keys.append
        young, old = self._young, self._old
        for end in range(pos + page_bytes, full + 1, page_bytes):
            message = parent + data[end - page_bytes : end]
            child = young.get(message)
            if child is None:
                child = old.get(message)
                if child is None:
                    break
                young[message] = child
            append(child)
            parent = child
            pos = end
        self.hits += len(keys)
        # Cold phase: hash the rest and remember each link.
        digest = self._digest
        cold = range(pos + page_bytes, full + 1, page_bytes)
        for end in cold:
            message = parent + data[end - page_bytes : end]
            parent = digest(message)
            append(parent)
            young[message] = parent
        self.misses += len(cold)
        if self._generation_size:
            self._remember_runs(root, data, keys, runs_found // page_bytes, page_bytes)
        if len(self._young) + len(self._young_runs) > self._generation_size:
            self._rotate()
        return keys

    def extend(self, parent: bytes, tokens: Sequence[int], page_size: int) -> list[bytes]:
        """Keys of the full pages of ``tokens`` continuing the chain after ``parent`` (the key of
        the page before them, or ``root(namespace)`` for a prompt's first page): what
        ``page_keys`` gives for those pages of the whole prompt. Uncached (the bridge hashes
        each engine block once, as it is stored)."""
        data = tokens_to_bytes(tokens)
        page_bytes = 4 * page_size
        keys: list[bytes] = []
        digest = self._digest
        for end in range(page_bytes, len(data) - len(data) % page_bytes + 1, page_bytes):
            parent = digest(parent + data[end - page_bytes : end])
            keys.append(parent)
        return keys

    def cache_len(self) -> int:
        """Entries held by the chain cache (never above ``cache_pages`` + one prompt)."""
        return len(self._young) + len(self._old) + len(self._young_runs) + len(self._old_runs)

    def _remember_runs(
        self, root: bytes, data: bytes, keys: list[bytes], first: int, page_bytes: int
    ) -> None:
        # Every aligned run from page `first` on (the runs before it were found). Run and page
        # entries are found independently and either may have been dropped; a miss only costs
        # hashing, never a wrong key.
        run_bytes = CHUNK_PAGES * page_bytes
        for start in range(first, len(keys) - CHUNK_PAGES + 1, CHUNK_PAGES):
            parent = keys[start - 1] if start else root
            message = parent + data[start * page_bytes : start * page_bytes + run_bytes]
            self._young_runs[message] = tuple(keys[start : start + CHUNK_PAGES])

    def _rotate(self) -> None:
        # Entries from this call may push young past its size; the overshoot is at most one
        # prompt, then everything older than the previous generation is dropped at once.
        self._old, self._old_runs = self._young, self._young_runs
        self._young, self._young_runs = {}, {}
        if self._generation_size == 0:
            self._old, self._old_runs = {}, {}


@functools.cache
def _default_hasher() -> PageHasher:
    return PageHasher(load_hash_config())


def page_keys(
    tokens: Sequence[int] | bytes | bytearray | memoryview,
    namespace: Namespace | None = None,
) -> list[bytes]:
    """Page keys under the configured deployment key (built once from the environment).

    ``namespace=None`` means model "default", version 0 and the configured page size.
    """
    hasher = _default_hasher()
    if namespace is None:
        namespace = Namespace(page_size=hasher.config.page_size)
    return hasher.page_keys(tokens, namespace)


def _make_digest(config: HashConfig) -> Callable[[bytes], bytes]:
    """``H`` as a one-argument function returning 16 bytes."""
    if config.algorithm is HashAlgorithm.XXH3:
        import xxhash  # optional dependency: only the fast mode needs it

        # xxh3 takes a 64-bit seed, not a real key: derive it from the key so each deployment
        # gets its own keys. This gives separation, not secrecy or collision resistance.
        seed_bytes = hashlib.blake2b(
            b"kvcoord.xxh3-seed.v1", key=config.key, digest_size=8
        ).digest()
        seed = int.from_bytes(seed_bytes, "little")
        xxh3_128_digest = xxhash.xxh3_128_digest

        def xxh3_digest(message: bytes) -> bytes:
            # A closure with a positional seed: functools.partial(seed=...) measured 3x slower.
            return xxh3_128_digest(message, seed)

        return xxh3_digest

    # Preparing the keyed state once and copying it per page skips the key block compression;
    # measured ~30% faster than hashlib.blake2b(message, key=...) for 80-byte messages.
    keyed = hashlib.blake2b(key=config.key, digest_size=PAGE_KEY_BYTES)

    copy = keyed.copy

    def blake2b_digest(message: bytes) -> bytes:
        state = copy()
        state.update(message)
        return state.digest()

    return blake2b_digest


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
