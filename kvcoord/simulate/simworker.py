"""A simulated worker: the real page allocator and prefix cache, a FIFO prefill queue, no GPU.

Memory is the production :class:`worker.allocator.PageAllocator` (LRU of unreferenced cached
pages, tail pages evicted first) under the production :class:`worker.prefix_cache.PrefixCache`,
whose Stored/Removed callbacks become :class:`PageEvent` objects handed to ``publish``, as a
real worker's Sync events would be (evictions are batched into one event per allocation); the
engine delivers them to the index after the event delay (``views``).

Lifecycle of a :class:`Job` (times come from the cost model, see ``cost_model``):

1. ``enqueue``: joins the FIFO queue.
2. ``start_next``: at the head, when no prefill runs, the job looks up its leading cached pages
   (taking references) and allocates pages for the rest of its prompt plus its output. If they
   do not fit because running decodes pin too many pages, it waits (head-of-line) until a
   decode ends. A job needing more pages than the whole worker has streams through uncached:
   it reads its hits, computes the rest and stores nothing.
   Its prefill advances at the cost model's rate for the decodes beside it; when a decode
   ends mid-prefill, ``finish_decode`` re-times the running prefill (a new ``prefill_end_s``
   and ``prefill_gen``: an end scheduled before is stale).
3. ``finish_prefill``: the computed full pages are recorded (Stored event); the job decodes.
4. ``finish_decode``: every page is released; cached ones become evictable (LRU).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from coordinator.core.hash_config import Namespace
from coordinator.core.hashing import PageHasher
from coordinator.core.routing import WorkerLoad
from kvcoord.simulate.cost_model import CostModel
from kvcoord.simulate.trace import TraceRequest
from worker.allocator import PageAllocator
from worker.prefix_cache import PrefixCache


class PageEvent(NamedTuple):
    """A worker's Stored (``stored``) or Removed page keys, as its Sync stream would carry."""

    worker_id: str
    stored: bool
    keys: list[bytes]


@dataclass(slots=True)
class Job:
    """One request in flight on a simulated worker. The fields after ``arrival_s`` are
    filled in when its prefill starts, and re-timed while it runs (``prefill_gen`` counts the
    re-timings, so an end event carrying an older one is stale)."""

    request: TraceRequest
    keys: list[bytes]
    arrival_s: float
    cached_tokens: int = 0
    uncached_tokens: int = 0
    prefill_start_s: float = 0.0
    prefill_end_s: float = 0.0
    pages: list[int] = field(default_factory=list)  # pinned: hit pages first, then new ones
    hit_pages: int = 0
    prefill_gen: int = 0
    remaining_tokens: float = 0.0  # prefill tokens left at ``progress_s``
    progress_s: float = 0.0
    rate: float = 0.0  # prefill tokens per second since ``progress_s``


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
        publish: Callable[[PageEvent], None] | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.page_size = namespace.page_size
        self.cost = cost
        self.allocator = PageAllocator(n_pages)
        self._publish = publish
        self._evicted: list[bytes] = []
        self.cache = PrefixCache(
            self.allocator, hasher, namespace,
            on_stored=self._stored if publish is not None else None,
            on_removed=self._evicted.extend,
        )
        self.queue: deque[Job] = deque()
        self.prefilling: Job | None = None
        self.decoding = 0
        self.decoding_context_tokens = 0  # sum of the decoding jobs' charged contexts
        self.computed_tokens = 0  # prompt tokens this worker prefilled (not served from cache)
        self.completed_since_beat = 0  # jobs finished since the last heartbeat()
        self._queued_tokens = 0  # the queue's prompt + output tokens (the heartbeat's figure)

    # ---- lifecycle ------------------------------------------------------------------------

    def enqueue(self, job: Job) -> None:
        self.queue.append(job)
        self._queued_tokens += job.request.input_length + job.request.output_length

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
        self._queued_tokens -= request.input_length + request.output_length
        job.pages, job.hit_pages = pages, len(hit.pages)
        job.cached_tokens = min(len(hit.pages) * page, request.input_length)
        job.uncached_tokens = request.input_length - job.cached_tokens
        job.prefill_start_s = now
        job.remaining_tokens = float(job.uncached_tokens)
        self._time_prefill(job, now)
        self.computed_tokens += job.uncached_tokens
        self.prefilling = job
        return job

    def finish_prefill(self, job: Job) -> None:
        """The prefill of ``job`` (the running one) ended: record its new full pages; it now
        decodes (and slows the next prefills, see ``cost_model``)."""
        if job is not self.prefilling:
            raise ValueError("finish_prefill for a job that is not prefilling")
        self.prefilling = None
        self.decoding += 1
        self.decoding_context_tokens += self._context(job)
        if job.pages:
            new_keys = job.keys[job.hit_pages :]
            self.cache.record(new_keys, job.pages[job.hit_pages : job.hit_pages + len(new_keys)])

    def finish_decode(self, job: Job, now: float) -> Job | None:
        """``job`` produced its last token: its pages become evictable (or free). Returns the
        running prefill, re-timed to the faster rate (a new ``prefill_end_s`` to schedule), or
        None when no prefill runs."""
        self.decoding -= 1
        self.decoding_context_tokens -= self._context(job)
        self.completed_since_beat += 1
        if job.pages:
            self.cache.release(job.pages)
            job.pages = []
        running = self.prefilling
        if running is None:
            return None
        done = running.rate * (now - running.progress_s)
        running.remaining_tokens = max(0.0, running.remaining_tokens - done)
        self._time_prefill(running, now)
        return running

    def _time_prefill(self, job: Job, now: float) -> None:
        job.rate = self.cost.prefill_rate(self.decoding, self.decoding_context_tokens)
        job.progress_s = now
        job.prefill_end_s = now + job.remaining_tokens / job.rate
        job.prefill_gen += 1

    def _context(self, job: Job) -> int:
        return self.cost.decode_context(job.request.input_length, job.request.output_length)

    # ---- what the coordinator hears ------------------------------------------------------

    def heartbeat(self) -> tuple[WorkerLoad, int]:
        """The heartbeat the reference worker would send now, and the jobs finished since the
        last one (counted from here on afresh): ``running_requests`` prefilling or decoding,
        ``queued_tokens`` the waiting jobs' prompt + output tokens (``worker.runtime``'s
        figure), ``free_pages`` the pages holding nothing (cached pages are not free)."""
        completed, self.completed_since_beat = self.completed_since_beat, 0
        load = WorkerLoad(
            running_requests=self.decoding + (self.prefilling is not None),
            queued_tokens=self._queued_tokens,
            free_pages=self.allocator.free_count,
            total_pages=self.allocator.n_pages,
        )
        return load, completed

    # ---- page events ----------------------------------------------------------------------

    def _stored(self, keys: list[bytes]) -> None:
        if self._publish is not None:
            self._publish(PageEvent(self.worker_id, True, list(keys)))

    def _flush_evictions(self) -> None:
        if self._evicted:
            if self._publish is not None:
                self._publish(PageEvent(self.worker_id, False, list(self._evicted)))
            self._evicted.clear()
