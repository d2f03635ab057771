"""A simulated worker: the real page allocator and prefix cache, a FIFO prefill queue, no GPU.

Memory is the production :class:`worker.kv.allocator.PageAllocator` (LRU of unreferenced cached
pages, tail pages evicted first) under the production :class:`worker.kv.prefix_cache.PrefixCache`,
whose Stored/Removed/Moved callbacks become the coordinator's own typed page events
(``coordinator.core.index.PageEvent``), handed to ``publish(worker_id, event)`` as a real
worker's Sync events would be (consecutive events of one kind and tier are merged, in
their order, so one allocation's evictions make one event); the engine delivers them to the
index after the event delay (``views``).

**Host tier** (``host_pages`` > 0): a second ``PageAllocator`` given to the ``PrefixCache`` as
its host pool, bookkeeping only (no mover). A cached page the device pool evicts moves there
(a Moved-to-``Tier.CPU`` event; the index then holds it in CPU for this worker); when the host
pool is full its own LRU page is dropped (Removed). A request takes its pages with
``PrefixCache.acquire``, which reuses the longest prefix cached in either tier and copies host
hits back (Moved to ``Tier.GPU``). The copy back costs time (``CostModel.copy_back_s``, from the
router's own ``TierCosts``): it runs first, then the uncached tokens are computed; the worker's
prefill server is busy for both, so the copy is never overlapped with another prefill.

Lifecycle of a :class:`Job` (times come from the cost model, see ``cost_model``):

1. ``enqueue``: joins the FIFO queue.
2. ``start_next``: at the head, when no prefill runs, the job acquires its pages: its leading
   cached pages (device or host tier) and new pages for the rest of its prompt plus its output.
   If they do not fit because running decodes pin too many pages, it waits (head-of-line) until
   a decode ends. A job needing more pages than the whole device pool has streams through
   uncached: it reads its device hits (host hits would need device pages to land in), computes
   the rest and stores nothing. Its host hits are copied back before it computes.
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
from typing import cast

from coordinator.core.fleet import WorkerLoad
from coordinator.core.hashing import Namespace, PageHasher
from coordinator.core.index import PageEvent, PagesRemoved, PagesStored, Tier
from kvcoord.simulate.cost_model import CostModel
from kvcoord.simulate.trace import TraceRequest
from worker.kv import OutOfPages, PageAllocator, PrefixCache


@dataclass(slots=True)
class Job:
    """One request in flight on a simulated worker. The fields after ``arrival_s`` are
    filled in when its prefill starts, and re-timed while it runs (``prefill_gen`` counts the
    re-timings, so an end event carrying an older one is stale)."""

    request: TraceRequest
    keys: list[bytes]
    arrival_s: float
    cached_tokens: int = 0  # in either tier
    host_tokens: int = 0  # of cached_tokens, those copied back from the host tier
    uncached_tokens: int = 0
    prefill_start_s: float = 0.0
    prefill_end_s: float = 0.0
    pages: list[int] = field(default_factory=list)  # pinned: hit pages first, then new ones
    hit_pages: int = 0
    prefill_gen: int = 0
    copy_end_s: float = 0.0  # when its host hits are back on the device; compute starts then
    remaining_tokens: float = 0.0  # prefill tokens left at ``progress_s``
    progress_s: float = 0.0  # never before ``copy_end_s``
    rate: float = 0.0  # prefill tokens per second since ``progress_s``


class SimWorker:
    """One worker of ``n_pages`` device pages and ``host_pages`` host pages (0: no host tier)
    of ``page_size`` tokens. Not thread-safe."""

    def __init__(
        self,
        worker_id: str,
        n_pages: int,
        *,
        hasher: PageHasher,
        namespace: Namespace,
        cost: CostModel,
        publish: Callable[[str, PageEvent], None] | None = None,
        host_pages: int = 0,
    ) -> None:
        if host_pages < 0:
            raise ValueError(f"host_pages must be >= 0, got {host_pages}")
        self.worker_id = worker_id
        self.page_size = namespace.page_size
        self.cost = cost
        self.allocator = PageAllocator(n_pages)
        self.host_allocator = PageAllocator(host_pages) if host_pages else None
        self._publish = publish
        self._outbox: list[PageEvent] = []  # events of the current operation, in order
        tell = publish is not None
        self.cache = PrefixCache(
            self.allocator, hasher, namespace,
            on_stored=self._stored if tell else None,
            on_removed=self._removed if tell else None,
            host=self.host_allocator,
            on_moved=self._moved if tell else None,
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
        total = math.ceil((request.input_length + request.output_length) / page)
        if total > self.allocator.n_pages:
            hit = self.cache.lookup(job.keys)
            self.cache.release(hit.pages)  # streams through: nothing of it is kept
            pages: list[int] = []
            device_hits, host_hits = len(hit.pages), 0
        else:
            try:
                got = self.cache.acquire(job.keys, total)
            except OutOfPages:
                return None  # pinned by running decodes: wait for one to end
            pages, device_hits, host_hits = got.pages, got.device_hits, got.host_hits
            self._flush()
        self.queue.popleft()
        self._queued_tokens -= request.input_length + request.output_length
        job.pages, job.hit_pages = pages, device_hits + host_hits
        job.cached_tokens = min(job.hit_pages * page, request.input_length)
        job.host_tokens = job.cached_tokens - min(device_hits * page, request.input_length)
        job.uncached_tokens = request.input_length - job.cached_tokens
        job.prefill_start_s = now
        job.copy_end_s = now + self.cost.copy_back_s(job.host_tokens)
        job.remaining_tokens = (self.cost.prefill_work(job.cached_tokens, request.input_length)
                                + self.cost.overhead_tokens())
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
            self._flush()

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
        done = running.rate * max(0.0, now - running.progress_s)  # nothing while copying
        running.remaining_tokens = max(0.0, running.remaining_tokens - done)
        self._time_prefill(running, now)
        return running

    def _time_prefill(self, job: Job, now: float) -> None:
        """From ``now`` (or the end of its copy back, if later) ``job`` computes at the rate
        the decodes beside it leave: its end is re-timed (a new generation)."""
        job.rate = self.cost.prefill_rate(self.decoding, self.decoding_context_tokens)
        job.progress_s = max(now, job.copy_end_s)
        job.prefill_end_s = job.progress_s + job.remaining_tokens / job.rate
        job.prefill_gen += 1

    def _context(self, job: Job) -> int:
        return self.cost.decode_context(job.request.input_length, job.request.output_length)

    # ---- what the coordinator hears ------------------------------------------------------

    def heartbeat(self) -> tuple[WorkerLoad, int]:
        """The heartbeat the reference worker would send now, and the jobs finished since the
        last one (counted from here on afresh): ``running_requests`` prefilling or decoding,
        ``queued_tokens`` the waiting jobs' prompt + output tokens (``worker.runtime.runtime``'s
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
        self._emit(True, keys, Tier.GPU)

    def _removed(self, keys: list[bytes]) -> None:
        self._emit(False, keys, Tier.GPU)

    def _moved(self, keys: list[bytes], tier: Tier) -> None:
        self._emit(True, keys, tier)

    def _emit(self, stored: bool, keys: list[bytes], tier: Tier) -> None:
        """Queue an event, merged into the previous one when of the same kind and tier (the
        order between kinds is kept: a key moved down and then dropped ends up dropped)."""
        box = self._outbox
        last = box[-1] if box else None
        if (type(last) is PagesStored and stored and last.tier == tier) or (
                type(last) is PagesRemoved and not stored):
            # NOTE: the event's keys are the list made below, ours until published: extend it.
            cast(list[bytes], last.keys).extend(keys)
        else:
            box.append(PagesStored(list(keys), tier) if stored else PagesRemoved(list(keys)))

    def _flush(self) -> None:
        if self._outbox and self._publish is not None:
            for event in self._outbox:
                self._publish(self.worker_id, event)
        self._outbox.clear()
