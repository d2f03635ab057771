"""A simulated worker: the real page allocator and prefix cache, a FIFO prefill queue, no GPU.

Memory is the production :class:`worker.allocator.PageAllocator` (LRU of unreferenced cached
pages, tail pages evicted first) under the production :class:`worker.prefix_cache.PrefixCache`,
whose Stored/Removed callbacks feed the coordinator's :class:`PrefixIndex` exactly as a real
worker's Sync events would (evictions are batched into one ``remove`` per allocation).

Lifecycle of a :class:`Job` (times come from the cost model, see ``cost_model``):

1. ``enqueue``: joins the FIFO queue.
2. ``start_next``: at the head, when no prefill runs, the job looks up its leading cached pages
   (taking references) and allocates pages for the rest of its prompt plus its output. If they
   do not fit because running decodes pin too many pages, it waits (head-of-line) until a
   decode ends. A job needing more pages than the whole worker has streams through uncached:
   it reads its hits, computes the rest and stores nothing.
3. ``finish_prefill``: the computed full pages are recorded (Stored -> index).
4. ``finish_decode``: every page is released; cached ones become evictable (LRU).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from coordinator.hashing import Namespace, PageHasher
from coordinator.index import PrefixIndex
from coordinator.routing import WorkerLoad
from kvcoord.simulate.cost_model import CostModel
from kvcoord.simulate.trace import TraceRequest
from worker.allocator import PageAllocator
from worker.prefix_cache import PrefixCache


@dataclass(slots=True)
class Job:
    """One request in flight on a simulated worker. ``expected_uncached`` is the router-side
    estimate (prompt tokens minus the pages the index expected there) used for queue load;
    the ``*_tokens`` and ``*_s`` fields are filled in when its prefill starts."""

    request: TraceRequest
    keys: list[bytes]
    arrival_s: float
    expected_uncached: int = 0
    cached_tokens: int = 0
    uncached_tokens: int = 0
    prefill_start_s: float = 0.0
    prefill_end_s: float = 0.0
    pages: list[int] = field(default_factory=list)  # pinned: hit pages first, then new ones
    hit_pages: int = 0


class SimWorker:
    """One worker of ``n_pages`` pages of ``page_size`` tokens. Not thread-safe."""

    def __init__(
        self,
        worker_id: str,
        n_pages: int,
        *,
        hasher: PageHasher,
        namespace: Namespace,
        cost: CostModel,
        index: PrefixIndex | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.page_size = namespace.page_size
        self.cost = cost
        self.allocator = PageAllocator(n_pages)
        self._index = index
        self._evicted: list[bytes] = []
        self.cache = PrefixCache(
            self.allocator, hasher, namespace,
            on_stored=self._stored if index is not None else None,
            on_removed=self._evicted.extend,
        )
        self.queue: deque[Job] = deque()
        self.prefilling: Job | None = None
        self.decoding = 0
        self.computed_tokens = 0  # prompt tokens this worker prefilled (not served from cache)
        self._queued_expected = 0  # sum of expected_uncached over the queue

    # ---- lifecycle ------------------------------------------------------------------------

    def enqueue(self, job: Job) -> None:
        self.queue.append(job)
        self._queued_expected += job.expected_uncached

    def start_next(self, now: float) -> Job | None:
        """Start the head job's prefill if the server is free and its pages fit; returns it
        (with ``prefill_end_s`` set) or None when nothing can start now."""
        if self.prefilling is not None or not self.queue:
            return None
        job = self.queue[0]
        request, page = job.request, self.page_size
        hit = self.cache.lookup(job.keys)
        total = math.ceil((request.input_length + request.output_length) / page)
        need = total - len(hit.pages)
        if total > self.allocator.n_pages:
            self.cache.release(hit.pages)  # streams through: nothing of it is kept
            pages: list[int] = []
        elif not self.allocator.can_alloc(need):
            self.cache.release(hit.pages)
            return None  # pinned by running decodes: wait for one to end
        else:
            pages = hit.pages + self.allocator.alloc(need)
            self._flush_evictions()
        self.queue.popleft()
        self._queued_expected -= job.expected_uncached
        job.pages, job.hit_pages = pages, len(hit.pages)
        job.cached_tokens = min(len(hit.pages) * page, request.input_length)
        job.uncached_tokens = request.input_length - job.cached_tokens
        job.prefill_start_s = now
        job.prefill_end_s = now + self.cost.prefill_s(job.uncached_tokens)
        self.computed_tokens += job.uncached_tokens
        self.prefilling = job
        return job

    def finish_prefill(self, job: Job) -> None:
        """The prefill of ``job`` (the running one) ended: record its new full pages."""
        if job is not self.prefilling:
            raise ValueError("finish_prefill for a job that is not prefilling")
        self.prefilling = None
        self.decoding += 1
        if job.pages:
            new_keys = job.keys[job.hit_pages :]
            self.cache.record(new_keys, job.pages[job.hit_pages : job.hit_pages + len(new_keys)])

    def finish_decode(self, job: Job) -> None:
        """``job`` produced its last token: its pages become evictable (or free)."""
        self.decoding -= 1
        if job.pages:
            self.cache.release(job.pages)
            job.pages = []

    # ---- what the router sees -------------------------------------------------------------

    def load(self, now: float) -> WorkerLoad:
        """This worker's exact load now, as an ideal heartbeat plus the coordinator's in-flight
        count would give it: ``running_requests`` prefilling or decoding, ``queued_tokens``
        the running prefill's remaining tokens, ``inflight_routes``/``inflight_tokens`` the
        queued jobs and their expected uncached tokens, and ``free_pages`` the pages holding
        nothing (cached pages are not free, as the real worker reports them)."""
        remaining = 0
        job = self.prefilling
        if job is not None:
            span = job.prefill_end_s - job.prefill_start_s
            if span > 0:
                left = max(0.0, job.prefill_end_s - now) / span
                remaining = math.ceil(job.uncached_tokens * left)
        return WorkerLoad(
            running_requests=self.decoding + (job is not None),
            queued_tokens=remaining,
            free_pages=self.allocator.free_count,
            total_pages=self.allocator.n_pages,
            inflight_routes=len(self.queue),
            inflight_tokens=self._queued_expected,
        )

    @property
    def cached_pages(self) -> int:
        """Pages holding a cached prefix (referenced or not)."""
        return len(self.cache)

    # ---- index mirror ---------------------------------------------------------------------

    def _stored(self, keys: list[bytes]) -> None:
        assert self._index is not None  # only installed with an index
        self._index.store(self.worker_id, keys)

    def _flush_evictions(self) -> None:
        if self._evicted:
            if self._index is not None:
                self._index.remove(self.worker_id, self._evicted)
            self._evicted.clear()
