"""Hit-ratio bounds for a trace (hit ratio = cached prompt tokens / all prompt tokens, page
granularity), computed over the trace's own order (no jitter, no routing):

- ``infinite``: every page ever computed stays cached somewhere reachable.
- ``pooled``: one LRU cache of ``workers x capacity`` pages serving every request in arrival
  order, i.e. what perfect routing over the fleet's pooled memory could reach.
- ``pooled_host`` (computed by ``runner`` with :func:`pooled_bound` too): one LRU cache of
  ``workers x (capacity + host capacity)`` pages. An exclusive two-level LRU (a page evicted
  from the device moves to the host tier's LRU, a hit there moves it back) holds exactly the
  most recently used pages of that combined size, so this is what perfect routing over the
  fleet's device and host memory could reach; with no host tier it equals ``pooled``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from coordinator.core.hashing import Namespace, PageHasher
from kvcoord.simulate.cost_model import CostModel
from kvcoord.simulate.simworker import SimWorker
from kvcoord.simulate.trace import TraceRequest


def infinite_bound(requests: Sequence[TraceRequest], keys: Sequence[list[bytes]],
                   page_size: int) -> float:
    """Hit ratio if every computed page stayed cached forever (an upper bound for any fleet)."""
    seen: set[bytes] = set()
    hit = total = 0
    for request, prompt_keys in zip(requests, keys, strict=True):
        depth = 0
        for key in prompt_keys:
            if key not in seen:
                break
            depth += 1
        hit += min(depth * page_size, request.input_length)
        total += request.input_length
        seen.update(prompt_keys)
    return hit / total if total else 0.0


def pooled_bound(requests: Sequence[TraceRequest], keys: Sequence[list[bytes]], pages: int,
                 hasher: PageHasher, namespace: Namespace) -> float:
    """Hit ratio of one LRU cache of ``pages`` pages (the whole fleet's), requests served one at
    a time in trace order by the production allocator and prefix cache. A prompt larger than
    the pool streams through uncached."""
    page = namespace.page_size
    pool = SimWorker("pooled", pages, hasher=hasher, namespace=namespace, cost=CostModel())
    cache, allocator = pool.cache, pool.allocator
    hit = total = 0
    for request, prompt_keys in zip(requests, keys, strict=True):
        found = cache.lookup(prompt_keys)
        hit += min(len(found.pages) * page, request.input_length)
        total += request.input_length
        need = math.ceil(request.input_length / page) - len(found.pages)
        if len(found.pages) + need > allocator.n_pages:
            cache.release(found.pages)
            continue
        pages_now = found.pages + allocator.alloc(need)
        new_keys = prompt_keys[len(found.pages):]
        cache.record(new_keys, pages_now[len(found.pages): len(found.pages) + len(new_keys)])
        cache.release(pages_now)
    return hit / total if total else 0.0
