"""The seed's allocator and index write, re-implemented as the benchmark baseline.

Written from the semantics described in ../shared/seeds/001_*.txt (not copied), keeping
exactly what makes it cost what it costs:

- :class:`SeedBitmaskAllocator`: the free set is one Python int with bit i set when page i is
  free; ``alloc()`` takes the lowest set bit (a big-int negate, and, xor: O(n_pages / 30)
  digit operations per call, however few pages are in use), returns -1 when nothing is free or
  evictable, and otherwise evicts the least recently cached page of an OrderedDict LRU; every
  call takes a ``threading.Lock``. One page per call: a batch is a loop of single calls.
- :func:`seed_write_indices`: the request-to-slot table written one element at a time,
  ``req_to_token[req, pos] = pages[pos // page_size] * page_size + pos % page_size``, each a
  separate torch indexing call from Python.

Not for production use; it exists so `make bench` can compare against it in the same run.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch


class SeedBitmaskAllocator:
    """Bitmask page allocator with ref counts and LRU eviction (the seed's semantics)."""

    def __init__(self, n_pages: int) -> None:
        self.free_mask = (1 << n_pages) - 1  # bit i set: page i is free
        self.refs = [0] * n_pages
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.on_evict: Callable[[int], None] | None = None
        self.lock = threading.Lock()

    def alloc(self) -> int:
        """One page with refcount 1, or -1 when none is free or evictable."""
        with self.lock:
            if self.free_mask:
                lowest = self.free_mask & -self.free_mask  # isolate the lowest free page's bit
                page = lowest.bit_length() - 1
                self.free_mask ^= lowest
                self.refs[page] = 1
                return page
            if self.lru:
                page, _ = self.lru.popitem(last=False)
                if self.on_evict is not None:
                    self.on_evict(page)
                self.refs[page] = 1
                self.free_mask &= ~(1 << page)  # the seed clears the bit here too
                return page
            return -1

    def free(self, page: int, keep_cached: bool = False) -> None:
        """Drop one reference; at zero the page is cached (LRU) or its free bit is set."""
        with self.lock:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if keep_cached:
                    self.lru[page] = None
                else:
                    self.free_mask |= 1 << page

    def inc_ref(self, page: int) -> None:
        with self.lock:
            self.refs[page] += 1
            self.lru.pop(page, None)

    def ref_count(self, page: int) -> int:
        with self.lock:
            return self.refs[page]


def seed_write_indices(
    req_to_token: torch.Tensor, req_idx: int, pages: Sequence[int], page_size: int, n_tokens: int
) -> None:
    """Write the slots of positions ``0..n_tokens-1`` of one request, one element at a time."""
    for pos in range(n_tokens):
        page_idx, offset = divmod(pos, page_size)
        if page_idx < len(pages):
            req_to_token[req_idx, pos] = pages[page_idx] * page_size + offset
