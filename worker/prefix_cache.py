"""A worker's local prefix cache: chained page key -> the page holding that prefix's KV.

Keys are the coordinator's (``coordinator.hashing.PageHasher`` under a :class:`Namespace`), so
what this cache reports in Stored/Removed events is exactly what the global index holds. The
namespace carries the policy version: after a weight update the worker switches namespace and
keys computed under the old version can never hit again, even for a page not yet dropped.
Each request hashes under its tenant too (the namespace's tenant salt), so one tenant's prompt
never reuses, and cannot time, another tenant's cached pages; one cache holds every tenant's.

A key names a whole prefix (it chains every earlier page), so the cache is two flat dicts, not a
radix tree: a lookup walks the prompt's keys until the first miss. Which pages to keep is the
allocator's business (its LRU); this cache only learns of an eviction through ``on_evict``.

Pure core: no torch, no I/O, no clock. Not thread-safe (the runtime serialises calls).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from coordinator.core.hash_config import Namespace
from coordinator.core.hashing import PageHasher
from worker.allocator import AllocatorIntegrityError, PageAllocator

KeysCallback = Callable[[list[bytes]], None]
# Per-tenant namespaces kept (dataclasses.replace costs about as much as hashing a short
# prompt); tenants are unbounded, so the dict is dropped whole when full.
MAX_TENANT_NAMESPACES = 1024


class CacheInUse(Exception):
    """``invalidate()`` was refused: a cached page is referenced by a running request."""


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The leading full pages of a prompt found in the cache; ``pages[i]`` holds ``keys[i]``.

    The caller owns one reference on each page (taken by ``lookup``) until it frees them.
    """

    pages: list[int]
    keys: list[bytes]


class PrefixCache:
    """Local prefix cache: chained page keys (coordinator.hashing.PageHasher, same keys as the
    coordinator) -> page. Version-namespaced: keys are hashed under ``namespace`` (which carries
    policy_version) with the request's tenant in its ``tenant`` field, so ``namespace`` itself
    must have no tenant (ValueError).

    ``on_stored(keys)`` fires once per ``record`` that added keys; ``on_removed(keys)`` once
    per evicted page (``[key]``) and once per ``invalidate`` (every key). Both are called after
    the cache has changed and must not call back into the cache or the allocator.

    Takes over ``allocator.on_evict``: one cache per allocator.
    """

    def __init__(
        self,
        allocator: PageAllocator,
        hasher: PageHasher,
        namespace: Namespace,
        on_stored: KeysCallback | None = None,
        on_removed: KeysCallback | None = None,
    ) -> None:
        self._alloc = allocator
        self._hasher = hasher
        self.namespace = self._checked(namespace)
        self.on_stored = on_stored
        self.on_removed = on_removed
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._tenant_namespaces: dict[str, Namespace] = {}
        allocator.on_evict = self._page_evicted

    def __len__(self) -> int:
        return len(self._page_of)

    def keys_for(self, tokens: Sequence[int], tenant: str = "") -> list[bytes]:
        """Page keys of the full pages of ``tokens`` under the current namespace and ``tenant``:
        what the coordinator computes for that tenant. Keys of different tenants never match."""
        return self._hasher.page_keys(tokens, self.namespace_for(tenant))

    def namespace_for(self, tenant: str) -> Namespace:
        """The current namespace with ``tenant`` as its tenant salt."""
        if not tenant:
            return self.namespace
        namespace = self._tenant_namespaces.get(tenant)
        if namespace is None:
            if len(self._tenant_namespaces) >= MAX_TENANT_NAMESPACES:
                self._tenant_namespaces.clear()
            namespace = self._tenant_namespaces[tenant] = replace(self.namespace, tenant=tenant)
        return namespace

    def lookup(self, keys: Sequence[bytes]) -> PrefixHit:
        """The longest leading run of ``keys`` that is cached, with a reference on each page.

        The references keep the pages from being evicted while the request reads them; give
        them back with ``release`` (or ``allocator.free(pages, keep_cached=True)``). Mutates
        only reference counts (a hit page leaves the LRU), never the cache's contents.
        """
        page_of = self._page_of
        pages: list[int] = []
        for key in keys:
            page = page_of.get(key)
            if page is None:
                break
            pages.append(page)
        self._alloc.ref(pages)
        return PrefixHit(pages, list(keys[: len(pages)]))

    def record(self, keys: Sequence[bytes], pages: Sequence[int]) -> list[bytes]:
        """Remember that ``pages[i]`` now holds the computed KV of ``keys[i]``.

        A key already cached is skipped, first writer wins: the other page keeps serving it and
        the caller's duplicate page is simply freed later. Returns the newly recorded keys in
        order and calls ``on_stored`` with them once if any. ValueError (nothing changed) when
        the lengths differ, a page is not referenced by the caller, a page already holds
        another key, or one page is given two new keys.
        """
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
        page_of, key_of = self._page_of, self._key_of
        new: list[tuple[bytes, int]] = []
        claimed: set[int] = set()
        claimed_keys: set[bytes] = set()
        for key, page in zip(keys, pages, strict=True):
            if key in page_of or key in claimed_keys:  # a repeated key: its first page wins
                continue
            if self._alloc.refcount(page) == 0:
                # Free or cached-unreferenced: the caller does not own its content.
                raise ValueError(f"page {page} is not referenced; record pages you hold")
            if page in key_of or page in claimed:
                raise ValueError(f"page {page} already holds another key")
            claimed.add(page)
            claimed_keys.add(key)
            new.append((key, page))
        for key, page in new:
            page_of[key] = page
            key_of[page] = key
        added = [key for key, _ in new]
        if added and self.on_stored is not None:
            self.on_stored(added)
        return added

    def release(self, pages: Sequence[int]) -> None:
        """Drop the caller's reference on ``pages`` (a request's whole page list, in order).

        Pages this cache holds stay cached (reusable), the rest go back to the free stack.
        Within each group the allocator's order applies: tail pages are evicted first.
        """
        key_of = self._key_of
        held = [p for p in pages if p in key_of]
        unheld = [p for p in pages if p not in key_of]
        if held and unheld:
            # Two free() calls: validate the whole list first so a bad page changes nothing.
            for page, count in Counter(pages).items():
                if self._alloc.refcount(page) < count:
                    raise ValueError(f"page {page} released {count} times, has fewer refs")
        self._alloc.free(unheld)
        self._alloc.free(held, keep_cached=True)

    def holds(self, page: int) -> bool:
        """Whether ``page`` holds a cached key (free it with ``keep_cached=True``)."""
        return page in self._key_of

    def inventory(self) -> list[bytes]:
        """Every key currently cached, oldest record first (for a resync)."""
        return list(self._page_of)

    def invalidate(self, namespace: Namespace | None = None) -> int:
        """Free every cached page and forget every key, every tenant's; optionally switch
        ``namespace``.

        CacheInUse (nothing changed, namespace included) while any cached page is referenced.
        Otherwise ``on_removed`` is called once with every dropped key, and the number of
        pages moved to the free stack is returned. ValueError (nothing changed) for a
        namespace whose page size differs from the hasher's, or that has a tenant.
        """
        if namespace is not None:
            self._checked(namespace)
        busy = [page for page in self._key_of if self._alloc.refcount(page) > 0]
        if busy:
            raise CacheInUse(f"{len(busy)} cached pages are referenced (first: page {busy[0]})")
        dropped = list(self._page_of)
        # Forget first: the allocator's on_evict callbacks then find nothing to report, so
        # on_removed fires once for the batch instead of once per page.
        self._page_of.clear()
        self._key_of.clear()
        cached = self._alloc.cached_pages()
        self._alloc.evict_cached(cached)
        if namespace is not None:
            self.namespace = namespace
            self._tenant_namespaces.clear()  # derived from the old namespace
        if dropped and self.on_removed is not None:
            self.on_removed(dropped)
        return len(cached)

    def check_integrity(self) -> None:
        """Raise AllocatorIntegrityError unless the key<->page maps are inverse and every
        mapped page is referenced or cached in the allocator (so no free page is mapped)."""
        if len(self._page_of) != len(self._key_of):
            raise AllocatorIntegrityError("key->page and page->key maps differ in size")
        for key, page in self._page_of.items():
            if self._key_of.get(page) != key:
                raise AllocatorIntegrityError(f"page {page} does not map back to its key")
            if self._alloc.refcount(page) == 0 and not self._alloc.is_cached(page):
                raise AllocatorIntegrityError(f"free page {page} is still mapped")

    def _page_evicted(self, page: int) -> None:
        # The allocator is about to reuse `page`: its KV will be overwritten.
        key = self._key_of.pop(page, None)
        if key is None:
            return
        del self._page_of[key]
        if self.on_removed is not None:
            self.on_removed([key])

    def _checked(self, namespace: Namespace) -> Namespace:
        # A page size other than the deployment's would produce keys the coordinator never
        # matches: refuse it rather than silently cache nothing useful.
        if namespace.page_size != self._hasher.config.page_size:
            raise ValueError(
                f"namespace page_size {namespace.page_size} != hash config page_size"
                f" {self._hasher.config.page_size}"
            )
        if namespace.tenant:
            # The tenant comes with each request (keys_for); a fixed one here would be
            # silently replaced, so refuse it.
            raise ValueError(f"namespace tenant {namespace.tenant!r} given: tenants are per "
                             "request (keys_for(tokens, tenant))")
        return namespace
