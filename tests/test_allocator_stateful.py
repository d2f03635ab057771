"""Hypothesis state machine: PageAllocator + PrefixCache against a plain-list model.

Requests look up their prefix, allocate the rest, record their pages and release them; plain
allocations come and go; cached pages are touched and evicted; the cache is invalidated under
a new policy version. After every step both ``check_integrity()`` pass and the real state
(refcounts, free-stack order, LRU order, cached keys, namespace) equals the model's exactly.
Keys are synthetic but chained like real ones (a key names its whole prefix) and carry the
policy version, so a key of an older version must never be cached again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from coordinator.core.hashing import HashConfig, Namespace, PageHasher
from worker.kv import OutOfPages, PageAllocator, PrefixCache
from worker.kv.prefix_cache import CacheInUse

N_PAGES = 7
PAGE = 4
HASHER = PageHasher(HashConfig(bytes(range(32)), page_size=PAGE))


@dataclass
class Model:
    refs: list[int] = field(default_factory=lambda: [0] * N_PAGES)
    free: list[int] = field(default_factory=lambda: list(range(N_PAGES - 1, -1, -1)))
    lru: list[int] = field(default_factory=list)  # eviction order
    page_of: dict[bytes, int] = field(default_factory=dict)  # insertion order = inventory
    removed: list[list[bytes]] = field(default_factory=list)

    def key_of(self, page: int) -> bytes | None:
        return next((k for k, p in self.page_of.items() if p == page), None)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self.free) + len(self.lru):
            return None
        k = min(n, len(self.free))
        pages = [self.free.pop() for _ in range(k)]
        self.evicted(self.lru[: n - k])
        pages += self.lru[: n - k]
        del self.lru[: n - k]
        for page in pages:
            self.refs[page] = 1
        return pages

    def evicted(self, pages: list[int]) -> None:
        # One removed report per reclaiming call, its keys in eviction order.
        keys = [key for key in map(self.key_of, pages) if key is not None]
        for key in keys:
            del self.page_of[key]
        if keys:
            self.removed.append(keys)

    def free_pages(self, pages: list[int], keep_cached: bool) -> None:
        for page in reversed(pages):
            self.refs[page] -= 1
            if self.refs[page] == 0:
                (self.lru if keep_cached else self.free).append(page)

    def release(self, pages: list[int]) -> None:
        held = set(self.page_of.values())
        self.free_pages([p for p in pages if p not in held], keep_cached=False)
        self.free_pages([p for p in pages if p in held], keep_cached=True)


def make_keys(version: int, prompt: list[int]) -> list[bytes]:
    # Key i names pages 0..i of the prompt under `version`, like a real chained key.
    return [bytes([version, *prompt[: i + 1]]) for i in range(len(prompt))]


class AllocatorAndCache(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.model = Model()
        self.stored: list[list[bytes]] = []
        self.removed: list[list[bytes]] = []
        self.alloc = PageAllocator(N_PAGES)
        self.cache = PrefixCache(
            self.alloc,
            HASHER,
            Namespace(page_size=PAGE),
            on_stored=self.stored.append,
            on_removed=self.removed.append,
        )
        self.version = 0
        self.stale: set[bytes] = set()
        # (version, keys, pages) of running requests
        self.requests: list[tuple[int, list[bytes], list[int]]] = []
        self.raw: list[list[int]] = []  # plain allocations, no keys

    # ---- requests ----

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=4), extra=st.integers(0, 1))
    def start_request(self, prompt: list[int], extra: int) -> None:
        keys = make_keys(self.version, prompt)
        hit = self.cache.lookup(keys)
        expected: list[int] = []
        for key in keys:
            if key not in self.model.page_of:
                break
            expected.append(self.model.page_of[key])
        assert hit.pages == expected
        assert hit.keys == keys[: len(expected)]
        for page in expected:
            self.model.refs[page] += 1
            if page in self.model.lru:
                self.model.lru.remove(page)
        need = len(keys) + extra - len(expected)
        want = self.model.alloc(need)
        try:
            got = self.alloc.alloc(need)
        except OutOfPages:
            assert want is None
            self.cache.release(hit.pages)  # a refused request gives its hit back
            self.model.release(hit.pages)
            return
        assert got == want
        self.requests.append((self.version, keys, hit.pages + got))

    @precondition(lambda self: any(r[0] == self.version for r in self.requests))
    @rule(data=st.data())
    def record(self, data: st.DataObject) -> None:
        # Only requests of the current version record: one that straddled invalidate() holds
        # keys of the old namespace, which the cache cannot tell apart (the runtime's job).
        current = [r for r in self.requests if r[0] == self.version]
        _, keys, pages = data.draw(st.sampled_from(current))
        upto = data.draw(st.integers(0, len(keys)))
        new = [k for k in keys[:upto] if k not in self.model.page_of]
        for key, page in zip(keys[:upto], pages, strict=False):
            if key in new:
                self.model.page_of[key] = page
        before = len(self.stored)
        assert self.cache.record(keys[:upto], pages[:upto]) == new
        assert self.stored[before:] == ([new] if new else [])

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.requests) - 1))
        _, _, pages = self.requests.pop(i)
        self.cache.release(pages)
        self.model.release(pages)

    # ---- plain allocations ----

    @rule(n=st.integers(0, 4))
    def alloc_raw(self, n: int) -> None:
        want = self.model.alloc(n)
        try:
            got = self.alloc.alloc(n)
        except OutOfPages:
            assert want is None
            return
        assert got == want
        self.raw.append(got)

    @precondition(lambda self: self.raw)
    @rule(data=st.data(), keep_cached=st.booleans())
    def free_raw(self, data: st.DataObject, keep_cached: bool) -> None:
        # keep_cached on unrecorded pages parks them in the LRU: legal, and evicted first-come.
        pages = self.raw.pop(data.draw(st.integers(0, len(self.raw) - 1)))
        self.alloc.free(pages, keep_cached=keep_cached)
        self.model.free_pages(pages, keep_cached)

    # ---- cache maintenance ----

    @precondition(lambda self: self.model.lru)
    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        page = data.draw(st.sampled_from(self.model.lru))
        self.alloc.touch([page])
        self.model.lru.remove(page)
        self.model.lru.append(page)

    @precondition(lambda self: self.model.lru)
    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        pages = data.draw(st.lists(st.sampled_from(self.model.lru), min_size=1, unique=True))
        self.alloc.evict_cached(pages)
        self.model.evicted(pages)
        for page in pages:
            self.model.lru.remove(page)
        self.model.free.extend(reversed(pages))

    @rule()
    def invalidate(self) -> None:
        busy = any(self.model.refs[p] for p in self.model.page_of.values())
        nxt = Namespace(policy_version=self.version + 1, page_size=PAGE)
        try:
            freed = self.cache.invalidate(nxt)
        except CacheInUse:
            assert busy
            return
        assert not busy
        assert freed == len(self.model.lru)
        if self.model.page_of:
            self.model.removed.append(list(self.model.page_of))
        self.stale |= set(self.model.page_of)
        for _, keys, _ in self.requests:
            self.stale |= set(keys)
        self.model.page_of.clear()
        self.model.free.extend(reversed(self.model.lru))
        self.model.lru.clear()
        self.version += 1

    @precondition(lambda self: self.stale)
    @rule(data=st.data())
    def lookup_stale(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.stale)))
        hit = self.cache.lookup([key])
        assert hit.pages == [] and hit.keys == []

    # ---- invariants ----

    @invariant()
    def integrity_and_exact_state(self) -> None:
        self.alloc.check_integrity()
        self.cache.check_integrity()
        m = self.model
        assert [self.alloc.refcount(p) for p in range(N_PAGES)] == m.refs
        assert self.alloc._free == m.free
        assert self.alloc.cached_pages() == m.lru
        assert self.cache.inventory() == list(m.page_of)
        assert [self.cache.holds(p) for p in range(N_PAGES)] == [
            p in m.page_of.values() for p in range(N_PAGES)
        ]
        assert self.removed == m.removed
        assert self.cache.namespace.policy_version == self.version
        assert self.stale.isdisjoint(self.cache.inventory())


AllocatorAndCache.TestCase.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None
)
TestAllocatorAndCache = AllocatorAndCache.TestCase
