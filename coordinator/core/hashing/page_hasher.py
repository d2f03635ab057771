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

The parameters (:class:`HashConfig`, :class:`Namespace`, :func:`encode_root`,
:data:`PAGE_KEY_BYTES`) live in :mod:`coordinator.core.hashing.hash_config`.

Pure core: no I/O and no clock; configuration comes in as a mapping (the environment by default).
"""

from __future__ import annotations

import functools
import hashlib
import struct
import sys
from array import array
from collections.abc import Callable, Sequence

from coordinator.core import accel
from coordinator.core.hashing.hash_config import (
    PAGE_KEY_BYTES,
    HashAlgorithm,
    HashConfig,
    Namespace,
    encode_root,
    load_hash_config,
)

# array('I') is 4 bytes on every platform CPython supports; pick 'L' only if that ever changes.
_U32_TYPECODE = next(code for code in ("I", "L") if array(code).itemsize == 4)
_BYTES_LIKE = (bytes, bytearray, memoryview)
# Pages per run entry of the chain cache: one lookup finds this many cached pages.
CHUNK_PAGES = 16


__all__ = ["PageHasher", "PageKeys", "page_keys", "split_page_keys", "tokens_to_bytes"]

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


_BIND_TAG = b"kvcoord-bind\x00"


def salt_content(salt: str) -> bytes:
    """What a cache salt binds into a chain (``PageHasher.bind``): length-prefixed, tagged."""
    raw = salt.encode()
    return b"cache_salt\x00" + len(raw).to_bytes(4, "little") + raw


class PageKeys(tuple[bytes, ...]):
    """Page keys known to be 16-byte ``bytes`` (cut from a wire blob by ``split_page_keys``):
    immutable, so the index's mutators skip re-checking them (``index_types.check_keys``)."""

    __slots__ = ()


def split_page_keys(blob: bytes) -> PageKeys:
    """Split concatenated 16-byte digests (the wire form) into keys; ValueError if ragged."""
    if len(blob) % PAGE_KEY_BYTES:
        raise ValueError(f"page key blob length {len(blob)} is not a multiple of {PAGE_KEY_BYTES}")
    # One C-level unpack ("16s" repeated) is ~6x faster than slicing in a comprehension.
    return PageKeys(struct.unpack(f"{PAGE_KEY_BYTES}s" * (len(blob) // PAGE_KEY_BYTES), blob))


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
        # The compiled chain (coordinator.core.accel) hashes runs of pages in C; blake2b-128
        # only (xxh3 is already one C call a page).
        chain_module = accel.enabled("_chain_accel")
        self._chain: Callable[..., list[bytes]] | None = (
            chain_module.KeyedChain(config.key).chain
            if chain_module is not None and config.algorithm is HashAlgorithm.BLAKE2B else None)
        self._generation_size = cache_pages // 2 if cache_pages > 1 else cache_pages
        self._young: dict[bytes, bytes] = {}
        self._old: dict[bytes, bytes] = {}
        self._young_runs: dict[bytes, tuple[bytes, ...]] = {}
        self._old_runs: dict[bytes, tuple[bytes, ...]] = {}
        self._roots: dict[Namespace, bytes] = {}  # few namespaces in practice; bounded anyway

    def root(self, namespace: Namespace) -> bytes:
        """``h_{-1}`` for ``namespace``: H(encode_root(namespace, algorithm)), bound to the
        namespace's cache salt when it has one (``bind``)."""
        root = self._roots.get(namespace)
        if root is None:
            root = self._digest(encode_root(namespace, self.config.algorithm))
            if namespace.cache_salt:
                root = self.bind(root, salt_content(namespace.cache_salt))
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

        A partial last page gets no key. Updates the ``hits``/``misses`` counters and the chain
        cache (every page walked or hashed lands in its young generation). ValueError for a
        token id outside uint32 or encoded bytes that are not whole ids.
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
        cold = range(pos + page_bytes, full + 1, page_bytes)
        if self._chain is not None and cold:
            keys += self._chain(parent, data, pos, full, page_bytes, young)
        else:
            digest = self._digest
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

    def bind(self, parent: bytes, content: bytes) -> bytes:
        """The chain point after ``parent`` that also binds ``content``: what an engine keyed a
        block on besides its tokens (an image's identifier, a prompt-embedding digest, a cache
        salt). Pages chained from it never share a key with the same tokens chained from
        ``parent`` or from another ``content``. ``H(parent || H(tag || content) || 0x01)``:
        33 bytes, never the length of a page's input (16 + 4 x page size), so no run of token
        ids hashes to a bound point."""
        inner = self._digest(_BIND_TAG + content)
        return self._digest(parent + inner + b"\x01")

    def extend(self, parent: bytes, tokens: Sequence[int], page_size: int) -> list[bytes]:
        """Keys of the full pages of ``tokens`` continuing the chain after ``parent`` (the key of
        the page before them, or ``root(namespace)`` for a prompt's first page): what
        ``page_keys`` gives for those pages of the whole prompt. Uncached (the bridge hashes
        each engine block once, as it is stored)."""
        data = tokens_to_bytes(tokens)
        page_bytes = 4 * page_size
        full = len(data) - len(data) % page_bytes
        if self._chain is not None:
            return self._chain(parent, data, 0, full, page_bytes, None)
        keys: list[bytes] = []
        digest = self._digest
        for end in range(page_bytes, full + 1, page_bytes):
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


# NOTE: built once per process, on the first ``page_keys`` call: changing KVCOORD_HASH_* after
# that has no effect here (build a PageHasher for another configuration).
@functools.cache
def _default_hasher() -> PageHasher:
    return PageHasher(load_hash_config())


def page_keys(
    tokens: Sequence[int] | bytes | bytearray | memoryview,
    namespace: Namespace | None = None,
) -> list[bytes]:
    """Page keys under the configured deployment key (built once from the environment).

    ``namespace=None`` means model "default", version 0 and the configured page size.
    ValueError for a bad configuration in the environment (see ``load_hash_config``) or a
    token id outside uint32.
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
