"""What the fleet tells a router of one worker: its load as the coordinator books it
(``WorkerLoad``) and, for one prompt, what it holds (``Candidate``).

Pure core: no I/O. They live beside the fleet, which builds them, so that routing reads the
fleet and never the other way round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's load as the router sees it: its last heartbeat plus the coordinator's count
    of routes issued since (so a burst between heartbeats does not pile onto one worker).

    ``running_requests``, ``queued_tokens`` (prefill + decode tokens queued), ``free_pages`` and
    ``total_pages`` come from the heartbeat; ``inflight_routes`` and ``inflight_tokens`` (their
    uncached prefill tokens) are routes issued and not yet reported finished.
    ``prefill_backlog_tokens`` is the coordinator's estimate of the prefill work queued at the
    worker when the route is chosen: the routes it issued there, drained at the worker's
    prefill rate (``RegisteredWorker.prefill_backlog``). ``active_tokens`` are the prompt
    tokens of the routes in flight there: KV they pin until they finish. All >= 0.
    ``attention_tokens`` (> 0) is the position at which a prompt token costs two at position 0,
    as the workers of its model learned it (``PrefillBacklog.model_attention_tokens``;
    infinite: attention not counted). ``total_pages == 0`` means the capacity is unknown (no
    heartbeat yet): no memory pressure is charged then, rather than treating the worker as
    full.
    """

    running_requests: int = 0
    queued_tokens: int = 0
    free_pages: int = 0
    total_pages: int = 0
    inflight_routes: int = 0
    inflight_tokens: int = 0
    prefill_backlog_tokens: float = 0.0
    active_tokens: int = 0
    attention_tokens: float = math.inf

    def __post_init__(self) -> None:
        # Built for every eligible worker on every route: explicit comparisons, not the
        # generic field walk (which cost more than the routing decision itself).
        if min(self.running_requests, self.queued_tokens, self.free_pages, self.total_pages,
               self.inflight_routes, self.inflight_tokens, self.prefill_backlog_tokens,
               self.active_tokens) < 0 or not self.attention_tokens > 0:
            raise ValueError(f"WorkerLoad fields must be >= 0 (attention_tokens > 0), got "
                             f"{self!r}")


@dataclass(frozen=True, slots=True)
class Candidate:
    """An eligible worker and what it holds of the prompt: ``cached_pages`` leading pages
    (confirmed + pending), of which ``lower_tier_pages`` sit in CPU/disk. Worker ids are unique
    among the candidates of one call. ValueError unless 0 <= lower_tier <= cached."""

    worker_id: str
    cached_pages: int
    lower_tier_pages: int
    load: WorkerLoad

    def __post_init__(self) -> None:
        if self.cached_pages < 0 or self.lower_tier_pages < 0:
            raise ValueError(f"Candidate page counts must be >= 0, got {self!r}")
        if self.lower_tier_pages > self.cached_pages:
            raise ValueError("Candidate.lower_tier_pages exceeds cached_pages")
