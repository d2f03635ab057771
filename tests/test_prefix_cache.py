"""PrefixCache over a PageAllocator: hits, first-writer-wins records, eviction events,
invalidation refused while in use, namespace switches that make old keys unreachable."""

from __future__ import annotations

import pytest

from coordinator.core.hashing import HashConfig, Namespace, PageHasher
from worker.kv import AllocatorIntegrityError, PageAllocator, PrefixCache, PrefixHit
from worker.kv.prefix_cache import CacheInUse

PAGE = 4
KEY = bytes(range(32))


class Recorder:
    def __init__(self) -> None:
        self.stored: list[list[bytes]] = []
        self.removed: list[list[bytes]] = []


def make(n_pages: int = 8, version: int = 0) -> tuple[PageAllocator, PrefixCache, Recorder]:
    alloc = PageAllocator(n_pages)
    rec = Recorder()
    cache = PrefixCache(
        alloc,
        PageHasher(HashConfig(KEY, page_size=PAGE)),
        Namespace(policy_version=version, page_size=PAGE),
        on_stored=rec.stored.append,
        on_removed=rec.removed.append,
    )
    return alloc, cache, rec


def check(alloc: PageAllocator, cache: PrefixCache) -> None:
    alloc.check_integrity()
    cache.check_integrity()


def serve(cache: PrefixCache, alloc: PageAllocator, tokens: list[int]) -> list[int]:
    """What a request does: look up, allocate the rest, record full pages; returns its pages."""
    keys = cache.keys_for(tokens)
    hit = cache.lookup(keys)
    pages = hit.pages + alloc.alloc(-(-len(tokens) // PAGE) - len(hit.pages))
    cache.record(keys, pages[: len(keys)])
    return pages


PROMPT = list(range(100, 110))  # 2 full pages + 2 tokens


def test_keys_for_matches_the_coordinators_hasher() -> None:
    _, cache, _ = make()
    expected = PageHasher(HashConfig(KEY, page_size=PAGE)).page_keys(
        PROMPT, Namespace(page_size=PAGE)
    )
    assert cache.keys_for(PROMPT) == expected
    assert len(expected) == 2


def test_lookup_of_an_empty_cache_is_an_empty_hit() -> None:
    alloc, cache, _ = make()
    assert cache.lookup(cache.keys_for(PROMPT)) == PrefixHit([], [])
    assert alloc.free_count == 8


def test_record_then_lookup_hits_the_leading_pages_and_references_them() -> None:
    alloc, cache, rec = make()
    pages = serve(cache, alloc, PROMPT)
    assert pages == [0, 1, 2]
    keys = cache.keys_for(PROMPT)
    assert rec.stored == [keys]
    assert cache.inventory() == keys
    assert [cache.holds(p) for p in pages] == [True, True, False]
    cache.release(pages)
    assert alloc.cached_pages() == [1, 0]  # page 2 was not recorded: back to the free stack
    assert alloc.free_count == 6
    # Another prompt sharing the first page only.
    other = [*PROMPT[:4], 7, 7, 7, 7]
    hit = cache.lookup(cache.keys_for(other))
    assert hit == PrefixHit([0], cache.keys_for(other)[:1])
    assert alloc.refcount(0) == 1 and alloc.cached_pages() == [1]
    check(alloc, cache)


def test_lookup_stops_at_the_first_missing_page() -> None:
    alloc, cache, _ = make()
    keys = cache.keys_for(list(range(12)))
    pages = alloc.alloc(3)
    cache.record([keys[0], keys[2]], [pages[0], pages[2]])
    hit = cache.lookup(keys)
    assert hit.pages == [0]
    assert alloc.refcount(0) == 2 and alloc.refcount(2) == 1
    check(alloc, cache)


def test_record_first_writer_wins_and_reports_only_new_keys() -> None:
    alloc, cache, rec = make()
    keys = cache.keys_for(list(range(12)))
    a = alloc.alloc(2)
    assert cache.record(keys[:2], a) == keys[:2]
    b = alloc.alloc(3)  # a concurrent request computed the same prefix into other pages
    assert cache.record(keys, b) == keys[2:]
    assert rec.stored == [keys[:2], keys[2:]]
    assert cache.lookup(keys).pages == [a[0], a[1], b[2]]
    assert cache.record(keys, b) == []  # nothing new: no event
    assert len(rec.stored) == 2
    check(alloc, cache)


def test_record_refuses_bad_input_and_changes_nothing() -> None:
    alloc, cache, rec = make()
    keys = cache.keys_for(list(range(12)))
    pages = alloc.alloc(3)
    cache.record(keys[:1], pages[:1])
    with pytest.raises(ValueError, match="2 keys for 1 pages"):
        cache.record(keys[1:], pages[:1])
    with pytest.raises(ValueError, match="already holds"):
        cache.record(keys[1:3], [pages[1], pages[0]])  # page 0 holds keys[0]
    with pytest.raises(ValueError, match="already holds"):
        cache.record(keys[1:3], [pages[1], pages[1]])
    with pytest.raises(ValueError, match="not referenced"):
        cache.record(keys[1:2], [7])  # a free page
    assert cache.inventory() == keys[:1]
    assert rec.stored == [keys[:1]]
    check(alloc, cache)


def test_a_repeated_key_in_one_record_keeps_its_first_page() -> None:
    alloc, cache, _ = make()
    keys = cache.keys_for(list(range(4)))
    pages = alloc.alloc(2)
    assert cache.record([keys[0], keys[0]], pages) == [keys[0]]
    assert cache.holds(pages[0]) and not cache.holds(pages[1])
    check(alloc, cache)


def test_eviction_drops_the_key_and_reports_it_tails_first() -> None:
    alloc, cache, rec = make(n_pages=3)
    pages = serve(cache, alloc, list(range(12)))
    keys = cache.keys_for(list(range(12)))
    cache.release(pages)
    assert alloc.cached_pages() == [2, 1, 0]
    assert alloc.alloc(2) == [2, 1]
    assert rec.removed == [[keys[2], keys[1]]]  # one report per allocation, tails first
    assert cache.inventory() == [keys[0]]
    assert cache.lookup(keys).pages == [0]
    check(alloc, cache)


def test_release_of_a_mixed_list_refuses_an_over_release_atomically() -> None:
    alloc, cache, _ = make()
    pages = serve(cache, alloc, PROMPT)  # 0, 1 held; 2 not
    with pytest.raises(ValueError):
        cache.release([0, 2, 2])
    assert [alloc.refcount(p) for p in pages] == [1, 1, 1]
    check(alloc, cache)


def test_invalidate_refuses_while_a_cached_page_is_referenced_and_changes_nothing() -> None:
    alloc, cache, rec = make()
    pages = serve(cache, alloc, PROMPT)
    keys = cache.keys_for(PROMPT)
    cache.release(pages)
    hit = cache.lookup(keys[:1])  # a running request holds page 0
    with pytest.raises(CacheInUse, match="1 cached pages"):
        cache.invalidate(Namespace(policy_version=1, page_size=PAGE))
    assert cache.namespace.policy_version == 0
    assert cache.inventory() == keys
    assert alloc.cached_pages() == [1]
    assert rec.removed == []
    cache.release(hit.pages)
    check(alloc, cache)


def test_invalidate_frees_everything_once_and_old_keys_never_hit_again() -> None:
    alloc, cache, rec = make()
    old_keys = cache.keys_for(PROMPT)
    cache.release(serve(cache, alloc, PROMPT))
    assert (alloc.free_count, alloc.cached_count) == (6, 2)
    assert cache.invalidate(Namespace(policy_version=1, page_size=PAGE)) == 2
    assert rec.removed == [old_keys]
    assert (alloc.free_count, alloc.cached_count, alloc.referenced_count) == (8, 0, 0)
    assert cache.inventory() == []
    assert cache.namespace.policy_version == 1
    new_keys = cache.keys_for(PROMPT)
    assert set(new_keys).isdisjoint(old_keys)
    assert cache.lookup(old_keys) == PrefixHit([], [])
    assert cache.lookup(new_keys) == PrefixHit([], [])
    # Serve under the new version: a fresh miss, then a hit under the new keys only.
    cache.release(serve(cache, alloc, PROMPT))
    assert cache.lookup(new_keys).pages == [1, 0]  # evicted LRU-first, reused in that order
    assert cache.lookup(old_keys).pages == []
    check(alloc, cache)


def test_invalidate_without_namespace_keeps_it_and_ignores_unrecorded_held_pages() -> None:
    alloc, cache, rec = make()
    running = alloc.alloc(2)  # referenced but never recorded: not cached, not in the way
    assert cache.invalidate() == 0
    assert rec.removed == []
    assert cache.namespace == Namespace(page_size=PAGE)
    assert alloc.referenced_count == 2
    alloc.free(running)
    check(alloc, cache)


def test_namespace_with_another_page_size_is_refused() -> None:
    alloc, cache, _ = make()
    with pytest.raises(ValueError, match="page_size"):
        cache.invalidate(Namespace(page_size=16))
    with pytest.raises(ValueError, match="page_size"):
        PrefixCache(alloc, PageHasher(HashConfig(KEY, page_size=PAGE)), Namespace(page_size=8))


def test_check_integrity_detects_a_mapped_free_page() -> None:
    alloc, cache, _ = make()
    keys = cache.keys_for(PROMPT)
    pages = alloc.alloc(1)
    cache.record(keys[:1], pages)
    alloc.free(pages)  # bypassing release: the mapped page went back to the free stack
    with pytest.raises(AllocatorIntegrityError, match="free page 0"):
        cache.check_integrity()


def test_keys_for_a_tenant_match_the_coordinators_hasher_under_that_tenant() -> None:
    _, cache, _ = make(version=3)
    hasher = PageHasher(HashConfig(KEY, page_size=PAGE))
    for tenant in ("", "acme", "other"):
        expected = hasher.page_keys(
            PROMPT, Namespace(tenant=tenant, policy_version=3, page_size=PAGE)
        )
        assert cache.keys_for(PROMPT, tenant) == expected
    assert cache.keys_for(PROMPT) == cache.keys_for(PROMPT, "")
    assert set(cache.keys_for(PROMPT, "acme")).isdisjoint(cache.keys_for(PROMPT, "other"))


def test_one_tenants_pages_never_hit_for_another_tenant() -> None:
    alloc, cache, rec = make()
    cache.release(serve(cache, alloc, PROMPT))  # recorded as the default tenant's
    a_keys = cache.keys_for(PROMPT, "a")
    assert cache.lookup(a_keys) == PrefixHit([], [])
    pages = alloc.alloc(2)
    assert cache.record(a_keys, pages) == a_keys  # same tokens, new keys, own pages
    cache.release(pages)
    assert cache.lookup(cache.keys_for(PROMPT, "b")) == PrefixHit([], [])
    hit = cache.lookup(a_keys)
    assert hit.pages == pages
    cache.release(hit.pages)
    assert rec.stored == [cache.keys_for(PROMPT), a_keys]
    check(alloc, cache)


def test_invalidate_drops_every_tenants_pages_and_moves_tenants_to_the_new_version() -> None:
    alloc, cache, rec = make()
    for tenant in ("a", "b"):
        keys = cache.keys_for(PROMPT, tenant)
        pages = alloc.alloc(2)
        cache.record(keys, pages)
        cache.release(pages)
    held = cache.inventory()
    assert len(held) == 4
    assert cache.invalidate(Namespace(policy_version=1, page_size=PAGE)) == 4
    assert rec.removed == [held] and cache.inventory() == []
    expected = PageHasher(HashConfig(KEY, page_size=PAGE)).page_keys(
        PROMPT, Namespace(tenant="a", policy_version=1, page_size=PAGE)
    )
    assert cache.keys_for(PROMPT, "a") == expected  # not a stale per-tenant namespace
    check(alloc, cache)


def test_a_namespace_with_a_tenant_is_refused_tenants_come_per_request() -> None:
    alloc, cache, _ = make()
    with pytest.raises(ValueError, match="tenant"):
        cache.invalidate(Namespace(tenant="a", page_size=PAGE))
    assert cache.namespace == Namespace(page_size=PAGE)
    with pytest.raises(ValueError, match="tenant"):
        PrefixCache(alloc, PageHasher(HashConfig(KEY, page_size=PAGE)),
                    Namespace(tenant="a", page_size=PAGE))
