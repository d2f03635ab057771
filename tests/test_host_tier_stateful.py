"""Hypothesis state machine: a PrefixCache with a host tier over two PageAllocators.

Requests acquire their prefix (either tier) and the rest of their pages, record what they
computed and release; plain allocations come and go; the cache is invalidated under a new
policy version. A mover keeps each pool's page *contents* (the key a page's KV was computed
for), so every hit is checked to read the KV of exactly its key, wherever it had travelled.
After every step: free + cached + referenced == total on each tier
(``check_integrity``, the host tier's included), no key in both tiers, every event agrees with
where each key is, and no key of an older version is ever held again.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from coordinator.core.hashing import HashConfig, Namespace, PageHasher
from coordinator.core.index import Tier
from worker.kv import OutOfPages, PageAllocator, PrefixCache
from worker.kv.prefix_cache import CacheInUse

DEVICE_PAGES = 6
HOST_PAGES = 4
PAGE = 4
HASHER = PageHasher(HashConfig(bytes(range(32)), page_size=PAGE))


class ContentMover:
    """What each page of each pool holds (a key's KV, named by the key), moved as a real
    copier moves bytes."""

    def __init__(self) -> None:
        self.device: list[bytes | None] = [None] * DEVICE_PAGES
        self.host: list[bytes | None] = [None] * HOST_PAGES

    def to_host(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        for d, h in zip(device_pages, host_pages, strict=True):
            self.host[h] = self.device[d]

    def to_device(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> None:
        for h, d in zip(host_pages, device_pages, strict=True):
            self.device[d] = self.host[h]


def make_keys(version: int, prompt: list[int]) -> list[bytes]:
    # Key i names pages 0..i of the prompt under `version`, like a real chained key.
    return [bytes([version, *prompt[: i + 1]]) for i in range(len(prompt))]


class TwoTiers(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.device = PageAllocator(DEVICE_PAGES)
        self.host = PageAllocator(HOST_PAGES)
        self.contents = ContentMover()
        self.where: dict[bytes, Tier] = {}  # the coordinator's view, from the events alone
        self.cache = PrefixCache(
            self.device, HASHER, Namespace(page_size=PAGE),
            on_stored=self._stored, on_removed=self._removed,
            host=self.host, mover=self.contents, on_moved=self._moved,
        )
        self.version = 0
        self.stale: set[bytes] = set()
        # (version, keys, pages, hit pages) of running requests
        self.requests: list[tuple[int, list[bytes], list[int], int]] = []
        self.raw: list[list[int]] = []

    def _stored(self, keys: list[bytes]) -> None:
        for key in keys:
            # A key recomputed while a copy sits in the host tier: that copy is dropped and
            # the Stored event moves the key to the device (one tier per key).
            assert self.where.get(key) is not Tier.GPU, "stored a key already on the device"
            self.where[key] = Tier.GPU

    def _removed(self, keys: list[bytes]) -> None:
        for key in keys:
            del self.where[key]

    def _moved(self, keys: list[bytes], tier: Tier) -> None:
        for key in keys:
            assert self.where[key] != tier, f"moved to {tier} where it already was"
            self.where[key] = tier

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=4), extra=st.integers(0, 1))
    def start_request(self, prompt: list[int], extra: int) -> None:
        keys = make_keys(self.version, prompt)
        expected_hits = 0
        for key in keys:
            if key not in self.where:
                break
            expected_hits += 1
        expected_host = sum(self.where[k] is Tier.CPU for k in keys[:expected_hits])
        before = self.snapshot()
        try:
            got = self.cache.acquire(keys, len(keys) + extra)
        except OutOfPages:
            assert self.snapshot() == before  # all or nothing: nothing held, nothing moved
            return
        assert (got.hit_pages, got.host_hits) == (expected_hits, expected_host)
        assert len(got.pages) == len(keys) + extra == len(set(got.pages))
        for key, page in zip(keys, got.pages[: got.hit_pages], strict=False):
            assert self.contents.device[page] == key  # a hit reads its own key's KV
            assert self.where[key] is Tier.GPU
        self.requests.append((self.version, keys, got.pages, got.hit_pages))

    def snapshot(self) -> tuple[object, ...]:
        return (self.cache.inventory_by_tier(), self.device.cached_pages(),
                self.host.cached_pages(), [self.device.refcount(p) for p in range(DEVICE_PAGES)],
                [self.host.refcount(p) for p in range(HOST_PAGES)])

    @precondition(lambda self: any(r[0] == self.version for r in self.requests))
    @rule(data=st.data())
    def compute_and_record(self, data: st.DataObject) -> None:
        current = [r for r in self.requests if r[0] == self.version]
        _, keys, pages, hits = data.draw(st.sampled_from(current))
        upto = data.draw(st.integers(0, len(keys)))
        for i in range(hits, upto):  # the forward pass writes the KV of the pages it computed
            self.contents.device[pages[i]] = keys[i]
        self.cache.record(keys[:upto], pages[:upto])

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        _, _, pages, _ = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        self.cache.release(pages)

    @rule(n=st.integers(0, 3))
    def alloc_raw(self, n: int) -> None:
        try:
            pages = self.device.alloc(n)  # evictions move to the host tier all the same
        except OutOfPages:
            return
        for page in pages:
            self.contents.device[page] = None  # someone else's data
        self.raw.append(pages)

    @precondition(lambda self: self.raw)
    @rule(data=st.data())
    def free_raw(self, data: st.DataObject) -> None:
        self.device.free(self.raw.pop(data.draw(st.integers(0, len(self.raw) - 1))))

    @rule()
    def invalidate(self) -> None:
        busy = any(self.cache.holds(p) and self.device.refcount(p) for p in range(DEVICE_PAGES))
        try:
            self.cache.invalidate(Namespace(policy_version=self.version + 1, page_size=PAGE))
        except CacheInUse:
            assert busy
            return
        assert self.where == {}  # both tiers reported dropped
        self.stale |= {k for r in self.requests for k in r[1]}
        self.version += 1

    @invariant()
    def integrity(self) -> None:
        self.device.check_integrity()
        self.cache.check_integrity()  # the host tier and its allocator, no key in both tiers
        tiers = self.cache.inventory_by_tier()
        held = {k: tier for tier, keys in tiers.items() for k in keys}
        assert held == self.where  # the events told the whole story
        assert self.cache.host_count == len(tiers.get(Tier.CPU, []))
        assert self.host.referenced_count == 0  # host pages are pinned only inside acquire
        assert self.stale.isdisjoint(held)


TwoTiers.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestTwoTiers = TwoTiers.TestCase
