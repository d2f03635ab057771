"""The host-memory tier of a worker's prefix cache: page keys -> pages of a host pool.

A full, hashed page the device pool evicts moves here instead of being dropped; a request whose
prefix is here copies it back to the device instead of recomputing it. A page lives in exactly
one tier at a time (exclusive, as LMCache and vLLM's CPU offload keep it): moving down frees
the device page, moving back up frees the host page. The pool is a
:class:`worker.kv.allocator.PageAllocator` of its own, so it has its own LRU: when it is full, its
least recently used unreferenced page is dropped (reported through ``on_dropped``).

Which bytes move is not this module's business: it names the pages to copy and calls a
:class:`TierMover` (the worker's is torch, ``worker.runtime.kv_tier_copy``; the simulator has none).

Pure core: no torch, no I/O, no clock. Not thread-safe (the runtime serialises calls).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from worker.kv.allocator import AllocatorIntegrityError, PageAllocator

KeysCallback = Callable[[list[bytes]], None]


def check_key_maps(
    page_of: Mapping[bytes, int], key_of: Mapping[int, bytes], allocator: PageAllocator,
    pool: str = "",
) -> None:
    """Raise AllocatorIntegrityError unless ``page_of`` and ``key_of`` are inverse maps and
    every mapped page is referenced or cached in ``allocator`` (no free page is mapped).
    ``pool`` prefixes the messages ("host ")."""
    if len(page_of) != len(key_of):
        raise AllocatorIntegrityError(f"{pool}key->page and page->key maps differ in size")
    for key, page in page_of.items():
        if key_of.get(page) != key:
            raise AllocatorIntegrityError(f"{pool}page {page} does not map back to its key")
        if allocator.refcount(page) == 0 and not allocator.is_cached(page):
            raise AllocatorIntegrityError(f"free {pool}page {page} is still mapped")


class TierMover(Protocol):
    """Copies page contents between the device pool and the host pool, ``src[i] -> dst[i]``,
    in one batch per call (never a loop per page). Called while both sides' pages are intact:
    the source is read before anything may overwrite it."""

    def to_host(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None: ...

    def to_device(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> None: ...


class HostTier:
    """Key <-> host page maps over ``allocator`` (the host pool), whose ``on_evict_many`` it
    takes over: one tier per allocator.

    Pages it maps are either cached in the allocator's LRU (reusable, evictable) or referenced
    (pinned by a request about to copy them back); no mapped page is free.
    """

    def __init__(self, allocator: PageAllocator, on_dropped: KeysCallback | None = None) -> None:
        self.allocator = allocator
        self.on_dropped = on_dropped
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        allocator.on_evict_many = self._evicted

    def __len__(self) -> int:
        return len(self._page_of)

    def page(self, key: bytes) -> int | None:
        """The host page holding ``key``, or None."""
        return self._page_of.get(key)

    def key(self, page: int) -> bytes:
        """The key a mapped ``page`` holds (KeyError for an unmapped page)."""
        return self._key_of[page]

    def inventory(self) -> list[bytes]:
        """Every key held here, oldest admission first."""
        return list(self._page_of)

    def admit(
        self, keys: Sequence[bytes], device_pages: Sequence[int], mover: TierMover | None
    ) -> list[bytes]:
        """Move ``keys`` (held in ``device_pages``, in eviction order: the coldest first) into
        host pages and copy them with one ``mover.to_host``; returns the keys admitted.

        When fewer host pages are free or evictable than keys, the hottest keys (the last
        ones) are admitted and the rest are not (the caller drops them). Admitting may evict
        this pool's own LRU pages (``on_dropped``). Keys must not be held here already.
        """
        room = self.allocator.free_count + self.allocator.cached_count
        skip = max(0, len(keys) - room)
        keys, device_pages = keys[skip:], device_pages[skip:]
        if not keys:
            return []
        host_pages = self.allocator.alloc(len(keys))
        if mover is not None:
            mover.to_host(device_pages, host_pages)
        for key, page in zip(keys, host_pages, strict=True):
            self._page_of[key] = page
            self._key_of[page] = key
        # NOTE: admitted pages are unreferenced: cached. Reversed because ``free`` queues a
        # list tail first: the LRU then holds them coldest first, the next to be evicted.
        self.allocator.free(host_pages[::-1], keep_cached=True)
        return list(keys)

    def pin(self, pages: Sequence[int]) -> None:
        """Take a reference on mapped pages (a request will copy them back): never evicted
        until ``unpin`` or ``take``."""
        self.allocator.ref(pages)

    def unpin(self, pages: Sequence[int]) -> None:
        """Give back ``pin``'s references; the pages stay here, cached."""
        self.allocator.free(pages, keep_cached=True)

    def take(self, pages: Sequence[int]) -> None:
        """Forget pinned ``pages`` and free them (their contents were copied back: the keys
        now live on the device). Fires no callback."""
        for page in pages:
            del self._page_of[self._key_of.pop(page)]
        self.allocator.free(pages)

    def pinned(self, key: bytes) -> bool:
        """Whether ``key`` is here with a reference on its page (a copy back in progress)."""
        page = self._page_of.get(key)
        return page is not None and self.allocator.refcount(page) > 0

    def discard(self, key: bytes) -> bool:
        """Drop ``key``'s unpinned copy without reporting it (the device holds the key again,
        computed anew); False when it is not here or pinned."""
        page = self._page_of.get(key)
        if page is None or not self.allocator.is_cached(page):
            return False
        del self._page_of[key], self._key_of[page]
        self.allocator.evict_cached([page])
        return True

    def busy(self) -> list[int]:
        """Mapped pages a request holds a reference on."""
        refcount = self.allocator.refcount
        return [page for page in self._key_of if refcount(page) > 0]

    def clear(self) -> list[bytes]:
        """Forget every key and free every page; returns the keys (no callback). The caller
        checks ``busy()`` first: a pinned page stays referenced."""
        dropped = list(self._page_of)
        self._page_of.clear()
        self._key_of.clear()
        self.allocator.evict_cached(self.allocator.cached_pages())
        return dropped

    def check_integrity(self) -> None:
        """Raise AllocatorIntegrityError unless the pool's allocator is sound, the maps are
        inverse, every mapped page is cached or referenced and every cached page is mapped."""
        self.allocator.check_integrity()
        check_key_maps(self._page_of, self._key_of, self.allocator, "host ")
        unmapped = [p for p in self.allocator.cached_pages() if p not in self._key_of]
        if unmapped:
            raise AllocatorIntegrityError(f"host page {unmapped[0]} is cached but holds no key")

    def _evicted(self, pages: list[int]) -> None:
        # The pool reuses `pages` (an admission needs room): their copies are gone.
        dropped = [self._key_of.pop(page) for page in pages if page in self._key_of]
        for key in dropped:
            del self._page_of[key]
        if dropped and self.on_dropped is not None:
            self.on_dropped(dropped)
