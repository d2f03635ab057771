"""Slot tables of the allocation strategies: exact values, prefix reuse, extension."""

from __future__ import annotations

import pytest
import torch

from coordinator.core.hashing import HashConfig, Namespace, PageHasher
from worker.kv import OutOfPages, PageAllocator, PrefixCache
from worker.runtime.strategy import (
    ContiguousStrategy,
    PagedStrategy,
    ReqToTokenPool,
    RequestSlotsExhausted,
    TaskCacheState,
)

CPU = torch.device("cpu")
KEY = bytes(range(32))


def row(pool: ReqToTokenPool, state: TaskCacheState) -> list[int]:
    return pool.slots(state.req_idx, state.length).tolist()


def paged(
    n_pages: int, page_size: int, *, prefix: bool = False, context: int = 64
) -> tuple[PagedStrategy, PageAllocator, ReqToTokenPool, PrefixCache | None]:
    allocator = PageAllocator(n_pages)
    pool = ReqToTokenPool(4, context, CPU)
    cache = None
    if prefix:
        hasher = PageHasher(HashConfig(KEY, page_size=page_size))
        cache = PrefixCache(allocator, hasher, Namespace(page_size=page_size))
    return PagedStrategy(allocator, cache, page_size, pool), allocator, pool, cache


def test_contiguous_rows_are_fixed_ranges() -> None:
    pool = ReqToTokenPool(2, 8, CPU)
    strategy = ContiguousStrategy(pool, total_slots=16)
    assert pool.req_to_token.tolist() == [list(range(8)), list(range(8, 16))]
    state = TaskCacheState(req_idx=pool.alloc())
    second = TaskCacheState(req_idx=pool.alloc())
    strategy.alloc(second, [1, 2, 3], capacity=5)
    strategy.write_indices(second)
    strategy.extend(second, 5)
    assert (second.length, second.cached, second.pages) == (6, 0, [])
    assert row(pool, second) == [8, 9, 10, 11, 12, 13]
    assert strategy.record(second, [1, 2, 3]) == []
    with pytest.raises(ValueError, match="capacity"):
        strategy.alloc(state, [1] * 9, capacity=9)
    with pytest.raises(RequestSlotsExhausted):
        pool.alloc()


def test_contiguous_refuses_buffers_too_small_for_the_layout() -> None:
    with pytest.raises(ValueError, match="needs 16 slots"):
        ContiguousStrategy(ReqToTokenPool(2, 8, CPU), total_slots=15)


def test_paged_page_size_1_slot_is_the_page() -> None:
    strategy, allocator, pool, _ = paged(8, 1)
    first = TaskCacheState(pool.alloc())
    strategy.alloc(first, [5, 6, 7], capacity=3)  # pages 0, 1, 2
    second = TaskCacheState(pool.alloc())
    strategy.alloc(second, [1, 2], capacity=4)  # pages 3, 4, 5, 6
    strategy.free(first)
    third = TaskCacheState(pool.alloc())
    strategy.alloc(third, [9, 9, 9, 9], capacity=4)  # 3 freed pages, then page 7
    for state in (second, third):
        strategy.write_indices(state)
        assert row(pool, state) == state.pages
    assert row(pool, second) == [3, 4, 5, 6]
    assert sorted(row(pool, third)) == [0, 1, 2, 7]
    assert allocator.free_count == 0


def test_paged_page_size_16_slots_follow_pages() -> None:
    strategy, _, pool, _ = paged(8, 16)
    first = TaskCacheState(pool.alloc())
    strategy.alloc(first, [1] * 20, capacity=20)  # pages 0, 1
    second = TaskCacheState(pool.alloc())
    strategy.alloc(second, [2] * 33, capacity=40)  # pages 2, 3, 4
    strategy.write_indices(second)
    assert second.pages == [2, 3, 4]
    assert row(pool, second) == list(range(32, 72))
    strategy.free(first)
    third = TaskCacheState(pool.alloc())
    strategy.alloc(third, [3] * 45, capacity=48)  # two reused pages, then page 5
    strategy.write_indices(third)
    expected = [third.pages[p // 16] * 16 + p % 16 for p in range(48)]
    assert row(pool, third) == expected
    assert sorted(third.pages) == [0, 1, 5]
    # A partial rewrite from the middle touches only positions >= start.
    pool.req_to_token[third.req_idx] = -1
    strategy.write_indices(third, start=17)
    assert row(pool, third) == [-1] * 17 + expected[17:]


def test_paged_alloc_is_all_or_nothing() -> None:
    strategy, allocator, pool, _ = paged(2, 16)
    state = TaskCacheState(pool.alloc())
    with pytest.raises(OutOfPages):
        strategy.alloc(state, [1] * 40, capacity=40)
    assert (allocator.free_count, state.pages, state.length) == (2, [], 0)


def test_paged_prefix_reuse_shares_full_pages_only() -> None:
    strategy, allocator, pool, cache = paged(8, 4, prefix=True)
    assert cache is not None
    prompt = list(range(10))  # two full pages and a partial one
    first = TaskCacheState(pool.alloc())
    strategy.alloc(first, prompt, capacity=12)
    assert (first.pages, first.cached) == ([0, 1, 2], 0)
    assert len(strategy.record(first, prompt)) == 2
    strategy.free(first)
    assert (allocator.cached_count, allocator.free_count) == (2, 6)

    second = TaskCacheState(pool.alloc())
    strategy.alloc(second, [*prompt[:8], 42, 43, 44], capacity=11)
    strategy.write_indices(second)
    assert second.cached == 8
    assert second.pages[:2] == [0, 1]
    assert row(pool, second)[:8] == list(range(8))
    assert allocator.refcount(0) == allocator.refcount(1) == 1
    strategy.free(second)
    allocator.check_integrity()
    cache.check_integrity()


def test_paged_failed_alloc_returns_prefix_hit_references() -> None:
    strategy, allocator, pool, cache = paged(3, 4, prefix=True)
    assert cache is not None
    state = TaskCacheState(pool.alloc())
    strategy.alloc(state, list(range(8)), capacity=8)
    strategy.record(state, list(range(8)))
    strategy.free(state)
    with pytest.raises(OutOfPages):
        strategy.alloc(state, list(range(16)), capacity=16)  # 2 hits + 2 new > 3 pages
    assert (allocator.referenced_count, allocator.cached_count, state.pages) == (0, 2, [])
    cache.check_integrity()


def test_extend_crosses_a_page_boundary() -> None:
    strategy, allocator, pool, _ = paged(4, 4)
    state = TaskCacheState(pool.alloc())
    strategy.alloc(state, [7, 7, 7], capacity=4)
    strategy.write_indices(state)
    assert state.pages == [0]
    strategy.extend(state, 4)  # first position of a new page
    strategy.extend(state, 5)
    assert state.pages == [0, 1]
    assert row(pool, state) == [0, 1, 2, 3, 4, 5]
    assert allocator.free_count == 2
    with pytest.raises(ValueError, match="no gaps"):
        strategy.extend(state, 7)
    strategy.free(state)
    assert allocator.free_count == 4
