"""Slot allocation strategies: which KV slot each position of a request lives in.

- :class:`TaskCacheState`: the per-request contract between a strategy and its caller.
- :class:`ReqToTokenPool`: the request-to-slot table, a torch int32 tensor
  ``[max_requests, max_context]``; row ``req_idx`` maps position -> slot.
- :class:`ContiguousStrategy`: static partition, request row r owns slots
  ``[r * max_context, (r + 1) * max_context)``; no allocation, no prefix cache.
- :class:`PagedStrategy`: pages from a shared :class:`PageAllocator`, ``page_size`` a parameter,
  prefix cache optional. Slot of position p = ``pages[p // page_size] * page_size + p % page_size``.

Slots of a request are written into the table with one tensor assignment, never a per-token loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from coordinator.core.hashing import Namespace
from worker.kv import PageAllocator, PrefixCache

SLOT_DTYPE = torch.int32  # what SGLang uses: half the memory of int64; torch indexes with it


class RequestSlotsExhausted(Exception):
    """Every row of the request table is in use."""


@dataclass(slots=True)
class TaskCacheState:
    """Per-request cache state, mutated only by the strategy that serves the request.

    ``length``: positions ``[0, length)`` have a slot in the table. ``cached``: the leading
    tokens whose KV came from the prefix cache (a multiple of the page size), of which
    ``host_cached`` were copied back from its host tier. ``pages``: the
    request's pages in position order (prefix hits first); empty for the contiguous strategy.
    ``tenant``: whose prompt it is (set by the caller, never by the strategy): the prefix cache
    hashes under it, so the request reuses and records only its own tenant's pages.
    """

    req_idx: int
    length: int = 0
    cached: int = 0
    host_cached: int = 0
    pages: list[int] = field(default_factory=list)
    tenant: str = ""


class ReqToTokenPool:
    """Request rows of the position -> slot table, with a free list of rows."""

    def __init__(self, max_requests: int, max_context: int, device: torch.device) -> None:
        if max_requests < 1 or max_context < 1:
            raise ValueError("max_requests and max_context must be >= 1")
        self.max_requests = max_requests
        self.max_context = max_context
        self.req_to_token = torch.zeros(
            (max_requests, max_context), dtype=SLOT_DTYPE, device=device
        )
        self._free_rows = list(range(max_requests - 1, -1, -1))  # pop() hands out row 0 first

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int:
        """A free row index; RequestSlotsExhausted when none is left."""
        if not self._free_rows:
            raise RequestSlotsExhausted(f"all {self.max_requests} request rows are in use")
        return self._free_rows.pop()

    def free(self, req_idx: int) -> None:
        """Return a row; ValueError for a row that is not in use."""
        if not 0 <= req_idx < self.max_requests or req_idx in self._free_rows:
            raise ValueError(f"request row {req_idx} is not in use")
        self._free_rows.append(req_idx)

    def slots(self, req_idx: int, end: int) -> torch.Tensor:
        """Slots of positions ``[0, end)`` of a request (a view of the table)."""
        return self.req_to_token[req_idx, :end]


class AllocationStrategy(ABC):
    """Physical slot allocation for requests. Methods raise instead of returning flags."""

    page_size: int

    @abstractmethod
    def alloc(self, state: TaskCacheState, prompt: Sequence[int], capacity: int) -> None:
        """Give ``state`` slots for positions ``[0, capacity)``, ``capacity >= len(prompt)``.

        Reuses cached leading full pages of ``prompt`` where the strategy has a prefix cache
        (``state.cached`` says how many tokens, ``state.host_cached`` how many of them came
        back from its host tier), ``state.tenant``'s only. All or nothing: on OutOfPages nothing
        is held. Does not write the table; call :meth:`write_indices`.
        """

    @abstractmethod
    def write_indices(self, state: TaskCacheState, start: int = 0) -> None:
        """Write the slots of positions ``[start, state.length)`` into the request's row."""

    @abstractmethod
    def extend(self, state: TaskCacheState, pos: int) -> None:
        """Make position ``pos`` (at most ``state.length``) have a slot and write its index.

        May take one page when ``pos`` crosses into a new page; OutOfPages leaves state as is.
        """

    @abstractmethod
    def record(self, state: TaskCacheState, tokens: Sequence[int]) -> list[bytes]:
        """Offer the full pages of ``tokens`` (their KV computed) to the prefix cache.

        ``tokens[i]`` is the token at position i; keys are ``state.tenant``'s. Returns the
        newly recorded keys.
        """

    @abstractmethod
    def free(self, state: TaskCacheState) -> None:
        """Release the request's pages; pages the prefix cache holds stay cached."""

    def invalidate_cache(self, namespace: Namespace | None = None) -> int:
        """Drop every reusable KV page (after a weight update); returns the pages freed."""
        return 0


class ContiguousStrategy(AllocationStrategy):
    """Row r of the table is pre-filled with slots ``r * max_context + p`` at construction.

    Needs ``max_requests * max_context`` slots in the buffers; allocation only checks the
    length. No prefix cache, so ``state.cached`` stays 0.
    """

    page_size = 1

    def __init__(self, req_pool: ReqToTokenPool, total_slots: int) -> None:
        need = req_pool.max_requests * req_pool.max_context
        if need > total_slots:
            raise ValueError(f"contiguous layout needs {need} slots, buffers have {total_slots}")
        self._req_pool = req_pool
        table = req_pool.req_to_token
        # The whole table in one op: row r, column p -> r * max_context + p.
        table.copy_(
            torch.arange(need, dtype=SLOT_DTYPE, device=table.device).view(table.shape)
        )

    def alloc(self, state: TaskCacheState, prompt: Sequence[int], capacity: int) -> None:
        _check_capacity(len(prompt), capacity, self._req_pool.max_context)
        state.length = capacity

    def write_indices(self, state: TaskCacheState, start: int = 0) -> None:
        pass  # pre-filled

    def extend(self, state: TaskCacheState, pos: int) -> None:
        _check_extend(state, pos, self._req_pool.max_context)
        state.length = max(state.length, pos + 1)

    def record(self, state: TaskCacheState, tokens: Sequence[int]) -> list[bytes]:
        return []

    def free(self, state: TaskCacheState) -> None:
        state.length = 0


class PagedStrategy(AllocationStrategy):
    """Pages from a shared pool; ``prefix=None`` disables prefix caching.

    Never writes into a page it got from the prefix cache: hits are full pages of the prompt,
    and every position after the hit lies in a page of the request's own.
    """

    def __init__(
        self,
        allocator: PageAllocator,
        prefix: PrefixCache | None,
        page_size: int,
        req_pool: ReqToTokenPool,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._alloc = allocator
        self._prefix = prefix
        self._req_pool = req_pool
        device = req_pool.req_to_token.device
        self._offsets = torch.arange(page_size, dtype=SLOT_DTYPE, device=device)

    def alloc(self, state: TaskCacheState, prompt: Sequence[int], capacity: int) -> None:
        _check_capacity(len(prompt), capacity, self._req_pool.max_context)
        n_pages = -(-capacity // self.page_size)
        if self._prefix is None:
            state.pages = self._alloc.alloc(n_pages)
        else:
            # Both tiers: host hits are copied back into pages of the request's own.
            got = self._prefix.acquire(self._prefix.keys_for(prompt, state.tenant), n_pages)
            state.pages = got.pages
            state.cached = got.hit_pages * self.page_size
            state.host_cached = got.host_hits * self.page_size
        state.length = capacity

    def write_indices(self, state: TaskCacheState, start: int = 0) -> None:
        end = state.length
        if start >= end:
            return
        first, last = start // self.page_size, (end - 1) // self.page_size
        pages = torch.tensor(
            state.pages[first : last + 1], dtype=SLOT_DTYPE, device=self._offsets.device
        )
        slots = (pages[:, None] * self.page_size + self._offsets).flatten()
        skip = start - first * self.page_size
        self._req_pool.req_to_token[state.req_idx, start:end] = slots[skip : skip + end - start]

    def extend(self, state: TaskCacheState, pos: int) -> None:
        _check_extend(state, pos, self._req_pool.max_context)
        page_idx, offset = divmod(pos, self.page_size)
        if page_idx == len(state.pages):
            state.pages.extend(self._alloc.alloc(1))
        slot = state.pages[page_idx] * self.page_size + offset
        self._req_pool.req_to_token[state.req_idx, pos] = slot
        state.length = max(state.length, pos + 1)

    def record(self, state: TaskCacheState, tokens: Sequence[int]) -> list[bytes]:
        if self._prefix is None:
            return []
        full = min(len(tokens) // self.page_size, len(state.pages))
        keys = self._prefix.keys_for(tokens[: full * self.page_size], state.tenant)
        # Keys already cached (the hits, or the same prefix cached on another page) are
        # skipped by the cache: first writer wins, and such a page is freed normally.
        return self._prefix.record(keys, state.pages[:full])

    def free(self, state: TaskCacheState) -> None:
        if self._prefix is None:
            self._alloc.free(state.pages)
        else:
            # Held pages stay cached (tails evicted before heads), the rest go to free.
            self._prefix.release(state.pages)
        state.pages = []
        state.length = state.cached = state.host_cached = 0

    def invalidate_cache(self, namespace: Namespace | None = None) -> int:
        if self._prefix is None:
            return 0
        return self._prefix.invalidate(namespace)


def _check_capacity(prompt_len: int, capacity: int, max_context: int) -> None:
    if not prompt_len <= capacity <= max_context:
        raise ValueError(
            f"capacity {capacity} must be between the prompt length {prompt_len} "
            f"and max_context {max_context}"
        )


def _check_extend(state: TaskCacheState, pos: int, max_context: int) -> None:
    if not 0 <= pos <= state.length or pos >= max_context:
        raise ValueError(
            f"position {pos} outside 0..{min(state.length, max_context - 1)} (no gaps allowed)"
        )
