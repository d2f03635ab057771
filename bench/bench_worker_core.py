"""Benchmarks of the worker core (allocator, slot-table write) against the seed, same run.

Every function returns a flat dict of numbers; the `make bench` runner prints and writes them.
Units are in the key names (``_us`` microseconds, ``_per_s`` rates); ``speedup.<what>`` is the
seed's time over ours (ours faster => > 1). Each figure is the median of ``repeats`` runs.
The baseline is :mod:`bench.seed_baseline`, a re-implementation of the seed's semantics.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from bench.seed_baseline import SeedBitmaskAllocator, seed_write_indices
from worker.kv import PageAllocator
from worker.runtime.strategy import PagedStrategy, ReqToTokenPool, TaskCacheState

BATCH_PAGES = 4096
PROMPT_TOKENS = 4096
PAGE_SIZE = 16


def bench_allocator(
    n_pages: int = 2**20, pairs: int = 200_000, seed_pairs: int = 2_000, repeats: int = 5
) -> dict[str, float]:
    """Single-page alloc+free pairs per second, and a 4,096-page batch alloc+free.

    Both allocators have ``n_pages`` pages, a quarter of them held (a busy worker), so the
    seed's lowest free bit is not bit 0. Ours batches with ``alloc(n)`` / ``free(pages)``; the
    seed has no batch call, so its batch is a loop of single allocs and frees.
    """
    ours, seed = PageAllocator(n_pages), SeedBitmaskAllocator(n_pages)
    ours.alloc(n_pages // 4)
    for _ in range(n_pages // 4):
        seed.alloc()

    def ours_pairs() -> None:
        alloc, free = ours.alloc, ours.free
        for _ in range(pairs):
            free(alloc(1))

    def seed_pairs_loop() -> None:
        alloc, free = seed.alloc, seed.free
        for _ in range(seed_pairs):
            free(alloc())

    def ours_batch() -> None:
        ours.free(ours.alloc(BATCH_PAGES))

    def seed_batch() -> None:
        pages = [seed.alloc() for _ in range(BATCH_PAGES)]
        for page in pages:
            seed.free(page)

    ours_pair_rate = pairs / (_median_us(ours_pairs, repeats) / 1e6)
    seed_pair_rate = seed_pairs / (_median_us(seed_pairs_loop, repeats) / 1e6)
    ours_batch_us = _median_us(ours_batch, repeats)
    seed_batch_us = _median_us(seed_batch, max(1, repeats // 2))
    ours.check_integrity()
    return {
        "n_pages": n_pages,
        "ours_single_pairs_per_s": ours_pair_rate,
        "seed_single_pairs_per_s": seed_pair_rate,
        "ours_batch_4096_us": ours_batch_us,
        "seed_batch_4096_us": seed_batch_us,
        "speedup.alloc_free_single": ours_pair_rate / seed_pair_rate,
        "speedup.alloc_free_batch_4096": seed_batch_us / ours_batch_us,
    }


def bench_index_write(
    n_tokens: int = PROMPT_TOKENS, page_size: int = PAGE_SIZE, repeats: int = 7
) -> dict[str, float]:
    """Writing one request's slot table for an ``n_tokens`` prompt on the CPU.

    Ours is the real code path, ``PagedStrategy.write_indices`` (one tensor op per request,
    the page list's conversion to a tensor included); the seed writes one element per token.
    Both write the same int32 table and must produce identical rows.
    """
    n_pages = -(-n_tokens // page_size)
    allocator = PageAllocator(4 * n_pages)
    allocator.alloc(n_pages)  # shift the pages so slots are not just 0..n-1
    pool = ReqToTokenPool(2, n_tokens, torch.device("cpu"))
    strategy = PagedStrategy(allocator, None, page_size, pool)
    state = TaskCacheState(req_idx=pool.alloc())
    strategy.alloc(state, list(range(n_tokens)), n_tokens)
    seed_row = pool.alloc()
    table = pool.req_to_token

    ours_us = _median_us(lambda: strategy.write_indices(state), repeats)
    seed_us = _median_us(
        lambda: seed_write_indices(table, seed_row, state.pages, page_size, n_tokens), repeats
    )
    if not torch.equal(table[state.req_idx], table[seed_row]):
        raise AssertionError("ours and the seed wrote different slot tables")
    return {
        "tokens": n_tokens,
        "page_size": page_size,
        "ours_us": ours_us,
        "seed_us": seed_us,
        "speedup.index_write_4096": seed_us / ours_us,
    }


def _median_us(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm up: first-call costs (allocations, torch dispatch caches) are not the steady state
    times = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - start) / 1e3)
    return statistics.median(times)
