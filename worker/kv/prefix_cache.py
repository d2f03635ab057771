"""A worker's local prefix cache: chained page key -> the page holding that prefix's KV.

Keys are the coordinator's (``coordinator.hashing.PageHasher`` under a :class:`Namespace`), so
what this cache reports in Stored/Removed events is exactly what the global index holds. The
namespace carries the policy version: after a weight update the worker switches namespace and
keys computed under the old version can never hit again, even for a page not yet dropped.
Each request hashes under its tenant too (the namespace's tenant salt), so one tenant's prompt
never reuses, and cannot time, another tenant's cached pages; one cache holds every tenant's.

A key names a whole prefix (it chains every earlier page), so the cache is two flat dicts, not a
radix tree: a lookup walks the prompt's keys until the first miss. Which pages to keep is the
allocator's business (its LRU); this cache only learns of an eviction through its callback.

With a host tier (:class:`worker.kv.host_tier.HostTier`), a page the device pool evicts moves to
host memory instead of being dropped, and :meth:`PrefixCache.acquire` copies a prefix found
there back to the device. Each key lives in one tier at a time.

Pure core: no torch, no I/O, no clock. Not thread-safe (the runtime serialises calls).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from coordinator.core.hashing import Namespace, PageHasher
from coordinator.core.index import Tier
from worker.kv.allocator import AllocatorIntegrityError, OutOfPages, PageAllocator
from worker.kv.host_tier import HostTier, KeysCallback, TierMover, check_key_maps

MovedCallback = Callable[[list[bytes], Tier], None]
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


@dataclass(frozen=True, slots=True)
class Acquired:
    """A request's device pages from :meth:`PrefixCache.acquire`: ``pages`` in position order,
    the caller holding one reference on each. The first ``hit_pages`` hold the prompt's cached
    prefix: ``device_hits`` of them were on the device already, ``host_hits`` were copied back
    from host memory (and now live on the device)."""

    pages: list[int]
    device_hits: int
    host_hits: int

    @property
    def hit_pages(self) -> int:
        return self.device_hits + self.host_hits


class PrefixCache:
    """Local prefix cache: chained page keys (coordinator.hashing.PageHasher, same keys as the
    coordinator) -> page. Version-namespaced: keys are hashed under ``namespace`` (which carries
    policy_version) with the request's tenant in its ``tenant`` field, so ``namespace`` itself
    must have no tenant (ValueError).

    ``on_stored(keys)`` fires once per ``record`` that added keys (on the device);
    ``on_removed(keys)`` once per eviction batch (the keys an allocation reclaimed and no tier
    kept) and once per ``invalidate`` (every key, both tiers); ``on_moved(keys, tier)`` when
    keys changed tier: ``Tier.CPU`` moved down to the host tier, ``Tier.GPU`` copied back up.
    All are called after the cache has changed and must not call back into the cache or the
    allocators.

    ``host`` (optional) is the host pool's allocator and ``mover`` what copies page contents
    between the pools (None: bookkeeping only, as the simulator needs). Takes over
    ``allocator.on_evict_many`` (and the host allocator's): one cache per allocator.
    """

    def __init__(
        self,
        allocator: PageAllocator,
        hasher: PageHasher,
        namespace: Namespace,
        on_stored: KeysCallback | None = None,
        on_removed: KeysCallback | None = None,
        *,
        host: PageAllocator | None = None,
        mover: TierMover | None = None,
        on_moved: MovedCallback | None = None,
    ) -> None:
        if host is allocator:
            raise ValueError("the host tier needs a pool of its own, not the device allocator")
        self._alloc = allocator
        self._hasher = hasher
        self.namespace = self._checked(namespace)
        self.on_stored = on_stored
        self.on_removed = on_removed
        self.on_moved = on_moved
        self._mover = mover
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._tenant_namespaces: dict[str, Namespace] = {}
        self._host = None if host is None else HostTier(host, self._report_removed)
        allocator.on_evict_many = self._pages_evicted

    def __len__(self) -> int:
        """Keys held, both tiers."""
        return len(self._page_of) + self.host_count

    @property
    def device_count(self) -> int:
        """Keys held in device pages."""
        return len(self._page_of)

    @property
    def host_count(self) -> int:
        """Keys held in the host tier (0 without one)."""
        return 0 if self._host is None else len(self._host)

    @property
    def host_allocator(self) -> PageAllocator | None:
        """The host pool's allocator, or None without a host tier."""
        return None if self._host is None else self._host.allocator

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
        """The longest leading run of ``keys`` cached on the device, with a reference on each
        page (the host tier is not consulted: :meth:`acquire` is the tier-aware path).

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

    def acquire(self, keys: Sequence[bytes], n_pages: int) -> Acquired:
        """``n_pages`` device pages for a request whose leading full pages have ``keys``,
        reusing the longest leading run of them cached in either tier.

        In this order: host-tier hits are pinned (no allocation can drop them), the device
        hits referenced, ``n_pages`` minus the device hits allocated (which may evict device
        pages: they move to the host tier), then the host hits are copied back into the
        allocated pages in one batch and move to the device (``on_moved(keys, Tier.GPU)``).
        All or nothing: OutOfPages (nothing held, nothing moved) when the pages cannot be had;
        ValueError for ``n_pages < 0``.
        """
        if n_pages < 0:
            raise ValueError(f"cannot acquire {n_pages} pages")
        page_of, host = self._page_of, self._host
        slots: list[tuple[bool, int]] = []  # (on the device, page) per hit position
        for key in keys[:n_pages]:
            page = page_of.get(key)
            if page is not None:
                slots.append((True, page))
                continue
            page = None if host is None else host.page(key)
            if page is None:
                break
            slots.append((False, page))
        device_hits = [page for on_device, page in slots if on_device]
        host_hits = [page for on_device, page in slots if not on_device]
        need = n_pages - len(device_hits)
        # Checked before touching anything, so a refusal changes nothing (not even the LRU
        # order): the device hits still cached stop being evictable once referenced.
        alloc = self._alloc
        room = alloc.free_count + alloc.cached_count - sum(map(alloc.is_cached, device_hits))
        if need > room:
            raise OutOfPages(need, room)
        if host is not None and host_hits:
            host.pin(host_hits)
        alloc.ref(device_hits)
        fresh = alloc.alloc(need)
        targets = iter(fresh)  # host hits take the first fresh pages, in position order
        pages = [page if on_device else next(targets) for on_device, page in slots]
        if host is not None and host_hits:
            promoted = [p for (on_device, _), p in zip(slots, pages, strict=True) if not on_device]
            self._copy_back(host, host_hits, promoted)
        pages.extend(targets)
        return Acquired(pages, len(device_hits), len(host_hits))

    def record(self, keys: Sequence[bytes], pages: Sequence[int]) -> list[bytes]:
        """Remember that ``pages[i]`` now holds the computed KV of ``keys[i]``.

        A key already cached is skipped, first writer wins: the other page keeps serving it and
        the caller's duplicate page is simply freed later. A key whose copy sits in the host
        tier is recorded, and that copy dropped (the key moves to the device), unless the copy
        is pinned by a copy back in progress (then it wins). Returns the newly recorded keys in
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
        host = self._host
        for key, page in zip(keys, pages, strict=True):
            if key in page_of or key in claimed_keys:  # a repeated key: its first page wins
                continue
            if host is not None and host.pinned(key):
                continue  # being copied back: that copy wins
            if self._alloc.refcount(page) == 0:
                # Free or cached-unreferenced: the caller does not own its content.
                raise ValueError(f"page {page} is not referenced; record pages you hold")
            if page in key_of or page in claimed:
                raise ValueError(f"page {page} already holds another key")
            claimed.add(page)
            claimed_keys.add(key)
            new.append((key, page))
        for key, page in new:
            if host is not None:
                host.discard(key)  # checked unpinned above; a no-op for a key not there
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
        """Every key cached on the device, oldest record first."""
        return list(self._page_of)

    def inventory_by_tier(self) -> dict[Tier, list[bytes]]:
        """Every key held, by the tier holding it (for a resync); tiers holding none left out."""
        tiers = {Tier.GPU: list(self._page_of)}
        if self._host is not None:
            tiers[Tier.CPU] = self._host.inventory()
        return {tier: keys for tier, keys in tiers.items() if keys}

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
        if self._host is not None:
            busy += self._host.busy()
        if busy:
            raise CacheInUse(f"{len(busy)} cached pages are referenced (first: page {busy[0]})")
        dropped = list(self._page_of)
        # Forget first: the allocator's eviction callback then finds nothing to report (or
        # move to the host tier), so on_removed fires once for everything.
        self._page_of.clear()
        self._key_of.clear()
        cached = self._alloc.cached_pages()
        self._alloc.evict_cached(cached)
        if self._host is not None:
            dropped += self._host.clear()
        if namespace is not None:
            self.namespace = namespace
            self._tenant_namespaces.clear()  # derived from the old namespace
        if dropped and self.on_removed is not None:
            self.on_removed(dropped)
        return len(cached)

    def check_integrity(self) -> None:
        """Raise AllocatorIntegrityError unless the key<->page maps are inverse and every
        mapped page is referenced or cached in the allocator (so no free page is mapped); with
        a host tier, the same of it (``HostTier.check_integrity``, its allocator's included)
        and no key in both tiers."""
        check_key_maps(self._page_of, self._key_of, self._alloc)
        if self._host is not None:
            self._host.check_integrity()
            both = next((k for k in self._host.inventory() if k in self._page_of), None)
            if both is not None:
                raise AllocatorIntegrityError(f"key {both.hex()} is held in both tiers")

    def _pages_evicted(self, pages: list[int]) -> None:
        # The allocator is about to reuse `pages`: their KV will be overwritten. Every page
        # this cache maps is a full, hashed page, worth keeping in the host tier if there is
        # one (copied there now, before anything can overwrite it).
        evicted = [(self._key_of.pop(page), page) for page in pages if page in self._key_of]
        if not evicted:
            return
        keys = [key for key, _ in evicted]
        for key in keys:
            del self._page_of[key]
        kept: list[bytes] = []
        if self._host is not None:
            kept = self._host.admit(keys, [page for _, page in evicted], self._mover)
            if kept and self.on_moved is not None:
                self.on_moved(kept, Tier.CPU)
        # NOTE: ``admit`` keeps the hottest keys, the last ones: those before them were dropped.
        self._report_removed(keys[: len(keys) - len(kept)])

    def _copy_back(self, host: HostTier, host_pages: list[int], device_pages: list[int]) -> None:
        # The host pages are pinned and the device pages freshly ours: copy, then the keys
        # change tier (device maps take them, the host frees its pages).
        if self._mover is not None:
            self._mover.to_device(host_pages, device_pages)
        moved = [host.key(page) for page in host_pages]
        host.take(host_pages)
        for key, page in zip(moved, device_pages, strict=True):
            self._page_of[key] = page
            self._key_of[page] = key
        if self.on_moved is not None:
            self.on_moved(moved, Tier.GPU)

    def _report_removed(self, keys: list[bytes]) -> None:
        if keys and self.on_removed is not None:
            self.on_removed(keys)

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
