"""PageAllocator: exact allocation and eviction orders, all-or-nothing refusals, integrity."""

from __future__ import annotations

import pytest

from worker.kv import AllocatorIntegrityError, OutOfPages, PageAllocator


def state(a: PageAllocator) -> tuple[list[int], list[int], list[int]]:
    """(refcounts, cached pages in eviction order, the next pages alloc would hand out)."""
    return [a.refcount(p) for p in range(a.n_pages)], a.cached_pages(), list(a._free)


def test_fresh_allocator_hands_out_pages_in_index_order() -> None:
    a = PageAllocator(8)
    assert a.alloc(3) == [0, 1, 2]
    assert a.alloc(1) == [3]
    assert (a.free_count, a.cached_count, a.referenced_count) == (4, 0, 4)
    assert [a.refcount(p) for p in range(8)] == [1, 1, 1, 1, 0, 0, 0, 0]
    a.check_integrity()


def test_alloc_zero_returns_nothing_and_negative_is_refused() -> None:
    a = PageAllocator(2)
    assert a.alloc(0) == []
    with pytest.raises(ValueError):
        a.alloc(-1)
    assert a.free_count == 2


def test_constructor_refuses_an_empty_pool() -> None:
    with pytest.raises(ValueError):
        PageAllocator(0)


def test_freed_pages_are_reused_in_list_order_most_recent_first() -> None:
    a = PageAllocator(8)
    a.alloc(6)
    a.free([4, 1, 3])
    assert a.alloc(3) == [4, 1, 3]
    a.free([5])
    assert a.alloc(2) == [5, 6]
    a.check_integrity()


def test_free_with_keep_cached_puts_tails_before_heads_in_the_lru() -> None:
    a = PageAllocator(6)
    first = a.alloc(3)  # [0, 1, 2]
    second = a.alloc(3)  # [3, 4, 5]
    a.free(first, keep_cached=True)
    a.free(second, keep_cached=True)
    # Least recently freed call first; within a call, the list's last page first.
    assert a.cached_pages() == [2, 1, 0, 5, 4, 3]
    assert (a.free_count, a.cached_count, a.referenced_count) == (0, 6, 0)
    a.check_integrity()


def test_alloc_takes_free_pages_before_evicting_in_lru_order() -> None:
    evicted: list[int] = []
    a = PageAllocator(6, on_evict=evicted.append)
    a.alloc(6)
    a.free([0, 1, 2], keep_cached=True)
    a.free([3, 4])  # to the free stack
    assert a.alloc(4) == [3, 4, 2, 1]
    assert evicted == [2, 1]
    assert a.cached_pages() == [0]
    a.check_integrity()


def test_on_evict_runs_before_the_page_is_handed_out() -> None:
    a = PageAllocator(2)
    seen: list[tuple[int, int, bool]] = []
    a.on_evict = lambda p: seen.append((p, a.refcount(p), a.is_cached(p)))
    a.free(a.alloc(2), keep_cached=True)
    assert a.alloc(1) == [1]
    assert seen == [(1, 0, True)]  # still cached and unreferenced when the callback ran


def test_out_of_pages_changes_nothing_and_calls_no_callback() -> None:
    evicted: list[int] = []
    a = PageAllocator(5, on_evict=evicted.append)
    a.alloc(5)
    a.free([0, 1], keep_cached=True)
    a.free([2])
    before = state(a)
    with pytest.raises(OutOfPages) as info:
        a.alloc(4)
    assert (info.value.requested, info.value.available) == (4, 3)
    assert "4" in str(info.value) and "3" in str(info.value)
    assert state(a) == before
    assert evicted == []
    assert a.can_alloc(3) and not a.can_alloc(4)
    a.check_integrity()


def test_on_evict_raising_leaves_the_allocator_unchanged() -> None:
    a = PageAllocator(2)
    a.free(a.alloc(2), keep_cached=True)

    def boom(page: int) -> None:
        raise RuntimeError("callback failed")

    a.on_evict = boom
    before = state(a)
    with pytest.raises(RuntimeError):
        a.alloc(1)
    assert state(a) == before
    a.check_integrity()


def test_ref_on_a_cached_page_removes_it_from_the_lru() -> None:
    a = PageAllocator(4)
    a.free(a.alloc(4), keep_cached=True)  # LRU: 3, 2, 1, 0
    a.ref([2, 0])
    assert a.cached_pages() == [3, 1]
    assert (a.refcount(2), a.refcount(0)) == (1, 1)
    assert a.alloc(2) == [3, 1]  # 2 and 0 are held, so they are not victims
    with pytest.raises(OutOfPages):
        a.alloc(1)
    # Freed again with keep_cached: back at the most-recent end, tail first.
    a.free([2, 0], keep_cached=True)
    assert a.cached_pages() == [0, 2]
    a.check_integrity()


def test_ref_on_a_referenced_page_adds_a_reference() -> None:
    a = PageAllocator(2)
    a.alloc(1)
    a.ref([0, 0])
    assert a.refcount(0) == 3
    a.free([0, 0])
    a.free([0], keep_cached=True)
    assert (a.refcount(0), a.cached_pages()) == (0, [0])
    a.check_integrity()


def test_ref_refuses_a_free_page_and_changes_nothing() -> None:
    a = PageAllocator(4)
    a.alloc(2)
    a.free([1], keep_cached=True)
    before = state(a)
    with pytest.raises(ValueError, match="page 3 is free"):
        a.ref([1, 0, 3])
    with pytest.raises(ValueError):
        a.ref([4])
    with pytest.raises(ValueError):
        a.ref([-1])
    assert state(a) == before


def test_free_refuses_double_free_out_of_range_and_overcount_atomically() -> None:
    a = PageAllocator(4)
    a.alloc(3)
    a.free([2])
    before = state(a)
    with pytest.raises(ValueError, match="double free"):
        a.free([2])  # the one-page fast path refuses it too
    with pytest.raises(ValueError, match="double free"):
        a.free([0, 2])
    with pytest.raises(ValueError):
        a.free([4])
    with pytest.raises(ValueError):
        a.free([0, 4])
    with pytest.raises(ValueError):
        a.free([-1])  # would silently be page 3 without the range check
    with pytest.raises(ValueError, match="freed 2 times"):
        a.free([1, 0, 1])
    assert state(a) == before
    a.check_integrity()


def test_touch_moves_cached_pages_to_the_most_recent_end() -> None:
    a = PageAllocator(4)
    a.alloc(4)
    a.free([0, 1, 2], keep_cached=True)  # LRU: 2, 1, 0
    a.touch([2, 3])  # 3 is referenced: ignored
    assert a.cached_pages() == [1, 0, 2]
    assert a.refcount(3) == 1


def test_evict_cached_frees_in_order_and_refuses_uncached_pages() -> None:
    evicted: list[int] = []
    a = PageAllocator(5, on_evict=evicted.append)
    a.alloc(5)
    a.free([0, 1, 2], keep_cached=True)
    a.free([4])
    before = state(a)
    for bad in ([1, 3], [1, 4], [1, 1], [7]):
        with pytest.raises(ValueError):
            a.evict_cached(bad)
        assert state(a) == before
    assert evicted == []
    a.evict_cached([0, 2])
    assert evicted == [0, 2]
    assert a.cached_pages() == [1]
    assert a.alloc(3) == [0, 2, 4]
    a.check_integrity()


def test_check_integrity_detects_corruption() -> None:
    a = PageAllocator(4)
    a.alloc(2)
    a.check_integrity()
    a._refs[3] = 1  # page 3 is on the free stack and referenced
    with pytest.raises(AllocatorIntegrityError):
        a.check_integrity()
    b = PageAllocator(4)
    b._free.append(0)  # on the stack twice
    with pytest.raises(AllocatorIntegrityError):
        b.check_integrity()
    c = PageAllocator(4)
    c.alloc(1)
    c._lru[0] = None  # cached and referenced
    with pytest.raises(AllocatorIntegrityError):
        c.check_integrity()


def test_large_batch_alloc_free_round_trip() -> None:
    a = PageAllocator(2**16)
    pages = a.alloc(4096)
    assert pages == list(range(4096))
    a.free(pages)
    assert a.alloc(4096) == pages
    assert a.free_count == 2**16 - 4096
    a.check_integrity()
