"""The values a routing decision reads and returns besides the fleet's (``WorkerLoad`` and
``Candidate`` are ``coordinator.core.fleet``'s): the request, the cost weights, the decision.

Pure core: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from coordinator.core.tier_costs import TierCosts

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


def _require_non_negative(value: DataclassInstance) -> None:
    """Raise ValueError unless every numeric field of ``value`` is finite and >= 0."""
    for field in fields(value):
        v = getattr(value, field.name)
        # NaN or inf would make cost comparisons meaningless.
        if isinstance(v, int | float) and not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{type(value).__name__}.{field.name} must be >= 0, got {v!r}")


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    """What is being routed: ``prompt_tokens`` tokens of which the first ``prompt_pages`` full
    pages are indexed (the partial last page is always computed), times ``copies`` identical
    prompts routed together (a RouteBatch group of GRPO siblings). ValueError unless
    page_size >= 1, copies >= 1 and prompt_pages <= prompt_tokens // page_size."""

    prompt_pages: int
    prompt_tokens: int
    page_size: int
    copies: int = 1

    def __post_init__(self) -> None:
        if self.prompt_pages < 0 or self.prompt_tokens < 0:
            raise ValueError(f"RoutingRequest counts must be >= 0, got {self!r}")
        if self.page_size < 1 or self.copies < 1:
            raise ValueError("RoutingRequest.page_size and copies must be >= 1")
        if self.prompt_pages > self.prompt_tokens // self.page_size:
            raise ValueError("RoutingRequest.prompt_pages exceeds the prompt's full pages")


@dataclass(frozen=True, slots=True)
class KvAwareWeights:
    """Exchange rates into prefill-token equivalents (config; all finite and >= 0, else
    ValueError). With the defaults, a worker's cost is its time to first token for the prompt
    plus what the route costs the fleet's cache afterwards, both in prefill tokens:

    - ``prefill_token``: per prompt token the worker must compute (not cached).
    - ``lower_tier_token``: per cached token that must first move up from CPU/disk: derived,
      not tuned: the copy back's time in prefill tokens (``TierCosts.lower_tier_token``; the
      coordinator derives it from its config, ``CoordinatorConfig.kv_weights``).
    - ``queued_token``: per token of prefill backlog the prompt would wait behind
      (``WorkerLoad.prefill_backlog_tokens``).
    - ``running_request``: per request decoding there or routed and in flight.
    - ``memory_pressure``: per token of pages the prompt needs beyond the worker's free pages,
      and per token its copies overflow the pages its routes in flight pin.
    - ``duplicate_token``: per token of the prompt that its best holder caches and this worker
      does not: the copy a move would make.
    """

    prefill_token: float = 1.0
    # A transfer over PCIe is cheaper than recomputing the page, not free: 0.079 by default.
    lower_tier_token: float = TierCosts().lower_tier_token
    # The backlog delays the prompt's first token by exactly its own prefill time, so 1.0 makes
    # the cost a TTFT estimate (Dynamo weighs overlap and load 1:1 by default too).
    queued_token: float = 1.0
    # A running request with a ~2k-token context adds one KV read (2k x 128 KiB = 256 MB, about
    # 0.08 ms on an H100) to every engine step: about one prefill token's time (~15k tok/s).
    # A prefill spans a few chunked steps and its decode competes afterwards, so ~8 tokens:
    # enough to split workers with equal queues, far below one cached page's saving.
    running_request: float = 8.0
    # A page short forces evicting a cached page; charging its tokens as if they will be
    # recomputed once is the upper bound (LRU evicts the coldest page). A token beyond what the
    # running sequences leave preempts one of them, recomputed later: the same price.
    memory_pressure: float = 1.0
    # Locality's future value. Sending a prompt away from the worker holding its prefix
    # recomputes the prefix now (prefill_token) and leaves the fleet holding it twice: the
    # copy displaces as many tokens of other prefixes from the fleet's memory as it holds, the
    # same loss memory_pressure prices for one worker's eviction, charged the same way (as
    # recomputed once). Without it the cost is one request's TTFT alone, which moves a
    # prefix whenever its holder is a little busier and halves what the fleet can hold.
    duplicate_token: float = 1.0

    def __post_init__(self) -> None:
        _require_non_negative(self)


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen worker, its ``kv_aware`` cost under the chooser's weights (whatever the
    routing rule, so the rules compare on one scale) and its cached pages of the prompt."""

    worker_id: str
    cost: float
    cached_pages: int
