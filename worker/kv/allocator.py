"""Paged KV allocator: a free stack, reference counts and an LRU of cached pages.

Every page is in exactly one of three states:

- **free**: on the free stack, refcount 0, holds nothing anyone can find;
- **referenced**: refcount >= 1, in use by at least one request (never evicted);
- **cached**: refcount 0 but kept for reuse (its KV is in the prefix cache), in the LRU.

``alloc`` takes free pages first and only then evicts cached ones, least recently freed first,
and within one ``free`` call tail pages before head pages (a prompt's last pages are the least
likely to be shared, and a chained prefix is useless without its head). Every operation is
O(1) per page; the seed's bitmask allocator was O(pages) per call.

Pure core: no torch, no I/O, no clock, no lock. Not thread-safe: the owner (the worker runtime)
serialises calls, so a lock here would only cost time on the hot path.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from itertools import islice


class OutOfPages(Exception):
    """``alloc(n)`` could not get ``n`` pages even after evicting every cached page."""

    def __init__(self, requested: int, available: int) -> None:
        super().__init__(f"asked for {requested} pages, only {available} free or evictable")
        self.requested = requested
        self.available = available


class AllocatorIntegrityError(Exception):
    """An allocator (or prefix cache) invariant does not hold: a bug, never bad input."""


class PageAllocator:
    """Hands out page indices ``0..n_pages-1`` with reference counts and cached-page reuse.

    ``on_evict(page)`` is called for each cached page that ``alloc`` or ``evict_cached``
    reclaims, before the page is handed out again, so the prefix cache can forget its key. It
    must not call back into the allocator. The prefix cache sets it after construction.
    ``on_evict_many(pages)``, when set, is called instead, once per call with every page that
    call reclaims (in eviction order), so an owner can copy them elsewhere in one batch before
    they are overwritten (the host tier: ``worker.kv.host_tier``). Same rules.

    Refused input raises ValueError and changes nothing (every batch call validates first).
    """

    def __init__(self, n_pages: int, on_evict: Callable[[int], None] | None = None) -> None:
        if n_pages < 1:
            raise ValueError(f"n_pages must be >= 1, got {n_pages}")
        self.n_pages = n_pages
        self.on_evict = on_evict
        self.on_evict_many: Callable[[list[int]], None] | None = None
        self._refs = [0] * n_pages
        # Reversed so that a fresh allocator hands out 0, 1, 2, ... (pop takes from the end).
        self._free = list(range(n_pages - 1, -1, -1))
        # Cached pages, eviction order first. OrderedDict rather than dict: popping the oldest
        # of a dict is O(deleted entries) until it resizes; popitem(last=False) is O(1).
        self._lru: OrderedDict[int, None] = OrderedDict()

    # ---- counts ----

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def cached_count(self) -> int:
        return len(self._lru)

    @property
    def referenced_count(self) -> int:
        return self.n_pages - len(self._free) - len(self._lru)

    def can_alloc(self, n: int) -> bool:
        """Whether ``alloc(n)`` would succeed now (free plus evictable pages >= n)."""
        return n <= len(self._free) + len(self._lru)

    def refcount(self, page: int) -> int:
        """References held on ``page`` (0: free or cached); ValueError when out of range."""
        self._check_range((page,))
        return self._refs[page]

    def is_cached(self, page: int) -> bool:
        """True when ``page`` is unreferenced and kept in the LRU."""
        return page in self._lru

    def cached_pages(self) -> list[int]:
        """The cached pages in eviction order (the next victim first)."""
        return list(self._lru)

    # ---- verbs ----

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` pages, each returned with refcount 1; all or nothing.

        Free pages come first (most recently freed first, so the hottest memory is reused),
        then cached pages are evicted in LRU order, ``on_evict(page)`` being called for each
        before any state changes. OutOfPages (nothing changed, no callback) when fewer than
        ``n`` pages are free or cached; ValueError for ``n < 0``. If ``on_evict`` raises, the
        exception propagates and the allocator is unchanged.
        """
        free = self._free
        refs = self._refs
        if n == 1 and free:  # the common decode-step case, kept branch-light
            page = free.pop()
            refs[page] = 1
            return [page]
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        from_free = min(n, len(free))
        need = n - from_free
        if need > len(self._lru):
            raise OutOfPages(n, len(free) + len(self._lru))
        victims: list[int] = []
        if need:
            victims = list(islice(self._lru, need))
            self._notify_evicted(victims)
            pop = self._lru.pop
            for page in victims:
                pop(page)
        pages = free[len(free) - from_free :]
        del free[len(free) - from_free :]
        pages.reverse()  # the order single pops would have given
        pages += victims
        for page in pages:
            refs[page] = 1
        return pages

    def ref(self, pages: Sequence[int]) -> None:
        """Take one more reference on each page (a prefix hit); a cached page leaves the LRU.

        ValueError (nothing changed) for a page out of range or free: a free page's content is
        garbage, so referencing it is always a caller bug. A page may appear more than once.
        """
        self._check_range(pages)
        refs, lru = self._refs, self._lru
        for page in pages:
            if refs[page] == 0 and page not in lru:
                raise ValueError(f"page {page} is free: only a held or cached page can be ref'd")
        for page in pages:
            refs[page] += 1
            lru.pop(page, None)

    def free(self, pages: Sequence[int], keep_cached: bool = False) -> None:
        """Drop one reference on each page; a page reaching 0 is cached or freed.

        With ``keep_cached`` a page reaching 0 is appended to the LRU (its KV stays reusable),
        otherwise it goes back on the free stack. Pages are appended in reverse list order, so
        the later pages of the list (a prompt's tail) are evicted before the earlier ones (its
        head), and freed pages are reused head first. ValueError (nothing changed) for a page
        out of range or with fewer references than it appears in ``pages``.
        """
        refs = self._refs
        if len(pages) == 1:  # one page (a decode step's): skip the batch checks below
            page = pages[0]
            # NOTE: a page this test refuses falls through to the checks below, which raise.
            if 0 <= page < self.n_pages and refs[page] > 0:
                refs[page] -= 1
                if refs[page] == 0:
                    if keep_cached:
                        self._lru[page] = None
                    else:
                        self._free.append(page)
                return
        self._check_range(pages)
        for page in pages:
            if refs[page] == 0:
                raise ValueError(f"page {page} is not referenced (double free?)")
        if len(pages) > 1 and len(set(pages)) != len(pages):
            for page, count in Counter(pages).items():
                if count > refs[page]:
                    raise ValueError(f"page {page} freed {count} times but has {refs[page]} refs")
        lru, stack = self._lru, self._free
        for page in reversed(pages):
            refs[page] -= 1
            if refs[page] == 0:
                if keep_cached:
                    lru[page] = None
                else:
                    stack.append(page)

    def touch(self, pages: Iterable[int]) -> None:
        """Mark cached pages most recently used (evicted last); other pages are ignored."""
        lru = self._lru
        for page in pages:
            if page in lru:
                lru.move_to_end(page)

    def evict_cached(self, pages: Sequence[int]) -> None:
        """Move cached pages to the free stack now, calling ``on_evict`` for each, in order.

        ValueError (nothing changed, no callback) when a page is referenced, free or repeated.
        """
        self._check_range(pages)
        lru = self._lru
        for page in pages:
            if page not in lru:
                state = "free" if self._refs[page] == 0 else "referenced"
                raise ValueError(f"page {page} is {state}, not cached")
        if len(set(pages)) != len(pages):
            raise ValueError("evict_cached got a page more than once")
        self._notify_evicted(list(pages))
        for page in reversed(pages):  # same convention as free: reused in list order
            del lru[page]
            self._free.append(page)

    def check_integrity(self) -> None:
        """Raise AllocatorIntegrityError unless free + cached + referenced == n_pages.

        Also: the free stack and the LRU are disjoint and without duplicates, their pages have
        refcount 0, no refcount is negative. O(n_pages): for tests, not the hot path.
        """
        refs, free, lru = self._refs, self._free, self._lru
        free_set = set(free)
        if len(free_set) != len(free):
            raise AllocatorIntegrityError("a page is on the free stack twice")
        if not free_set.isdisjoint(lru):
            raise AllocatorIntegrityError("a page is both free and cached")
        for where, pages in (("free", free_set), ("cached", lru.keys())):
            for page in pages:
                if not 0 <= page < self.n_pages:
                    raise AllocatorIntegrityError(f"{where} page {page} out of range")
                if refs[page] != 0:
                    raise AllocatorIntegrityError(f"{where} page {page} has refcount {refs[page]}")
        if any(r < 0 for r in refs):
            raise AllocatorIntegrityError("negative refcount")
        referenced = sum(1 for r in refs if r > 0)
        if len(free) + len(lru) + referenced != self.n_pages:
            raise AllocatorIntegrityError(
                f"free {len(free)} + cached {len(lru)} + referenced {referenced}"
                f" != {self.n_pages} pages"
            )

    def _notify_evicted(self, pages: list[int]) -> None:
        if not pages:
            return
        if self.on_evict_many is not None:
            self.on_evict_many(pages)
        elif self.on_evict is not None:
            for page in pages:
                self.on_evict(page)

    def _check_range(self, pages: Sequence[int]) -> None:
        # Python lists accept negative indices, so an unchecked -1 would silently hit the
        # last page. min/max run in C: two passes are cheaper than a per-page test.
        if pages and (min(pages) < 0 or max(pages) >= self.n_pages):
            bad = next(p for p in pages if not 0 <= p < self.n_pages)
            raise ValueError(f"page {bad} outside 0..{self.n_pages - 1}")
