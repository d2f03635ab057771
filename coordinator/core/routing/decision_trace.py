"""Why a route went where it went: each term of the ``kv_aware`` cost of the chosen worker and
of the prompt's best holder, as the router saw them when it chose.

``cost_terms`` takes ``own_cost`` + ``duplicate_cost`` (choosers, shortlists) apart term by
term; its ``total`` is that cost (tests/test_decision_trace.py holds them equal). A
``DecisionTrace`` pairs the chosen worker's terms with the best holder's (the candidate caching
the most of the prompt; None when no worker caches any): when the two differ, the terms say
which load or memory signal outweighed the hit. The router builds one per decision only when
asked (``Router(decision_sink=...)``: ``--decision-log``), since it reads every idle candidate.

Pure core: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from coordinator.core.fleet import Candidate
from coordinator.core.routing.choosers import overflow_tokens, prefill_cost
from coordinator.core.routing.route_types import RouteResult
from coordinator.core.routing.routing_values import KvAwareWeights, RoutingRequest
from coordinator.core.routing.shortlists import duplicate_cost


@dataclass(frozen=True, slots=True)
class CostTerms:
    """One candidate's ``kv_aware`` cost, term by term (prefill-token equivalents), and the
    signals behind them: what it caches of the prompt and its load as the router booked it."""

    worker_id: str
    cached_pages: int
    lower_tier_pages: int
    prefill: float
    lower_tier: float
    queued: float
    running: float
    memory: float
    overflow: float
    duplicate: float
    backlog_tokens: float
    running_requests: int
    inflight_routes: int
    free_pages: int
    total_pages: int
    attention_tokens: float

    @property
    def total(self) -> float:
        return (self.prefill + self.lower_tier + self.queued + self.running + self.memory
                + self.overflow + self.duplicate)

    def as_json(self) -> dict[str, Any]:
        fields = asdict(self)
        if math.isinf(self.attention_tokens):
            fields["attention_tokens"] = None  # none learned (JSON has no infinity)
        return {**fields, "total": self.total}


def cost_terms(request: RoutingRequest, candidate: Candidate, weights: KvAwareWeights,
               best_cached_pages: int) -> CostTerms:
    """``candidate``'s cost for ``request`` taken apart; ``total`` equals ``kv_aware_cost``."""
    page, load = request.page_size, candidate.load
    memory = overflow = 0.0
    if load.total_pages > 0:
        tail_tokens = request.prompt_tokens - request.prompt_pages * page
        needed = (request.prompt_pages - candidate.cached_pages + candidate.lower_tier_pages
                  + request.copies * math.ceil(tail_tokens / page))
        memory = weights.memory_pressure * max(0, needed - load.free_pages) * page
        overflow = weights.memory_pressure * overflow_tokens(request, load)
    return CostTerms(
        worker_id=candidate.worker_id, cached_pages=candidate.cached_pages,
        lower_tier_pages=candidate.lower_tier_pages,
        prefill=weights.prefill_token * prefill_cost(request, candidate.cached_pages, load),
        lower_tier=weights.lower_tier_token * candidate.lower_tier_pages * page,
        queued=weights.queued_token * load.prefill_backlog_tokens,
        running=weights.running_request * (load.running_requests + load.inflight_routes),
        memory=memory, overflow=overflow,
        duplicate=duplicate_cost(weights, page, best_cached_pages, candidate.cached_pages),
        backlog_tokens=load.prefill_backlog_tokens, running_requests=load.running_requests,
        inflight_routes=load.inflight_routes, free_pages=load.free_pages,
        total_pages=load.total_pages, attention_tokens=load.attention_tokens)


@dataclass(frozen=True, slots=True)
class DecisionTrace:
    """One route's decision: the prompt, the chosen worker's terms and the best holder's
    (None: nobody cached any of it), and how many candidates there were."""

    prompt_pages: int
    prompt_tokens: int
    chosen: CostTerms
    holder: CostTerms | None
    candidates: int

    @property
    def left_holder(self) -> bool:
        """The route went elsewhere than the best holder (which cached more than the chosen)."""
        return self.holder is not None and self.holder.cached_pages > self.chosen.cached_pages

    def as_json(self) -> dict[str, Any]:
        return {"prompt_pages": self.prompt_pages, "prompt_tokens": self.prompt_tokens,
                "candidates": self.candidates, "left_holder": self.left_holder,
                "chosen": self.chosen.as_json(),
                "holder": None if self.holder is None else self.holder.as_json()}


def trace_decision(request: RoutingRequest, candidates: Iterable[Candidate], chosen_id: str,
                   weights: KvAwareWeights) -> DecisionTrace:
    """The trace of choosing ``chosen_id`` among ``candidates`` (holders and idle workers).
    The best holder is the one caching the most pages (the cheaper of equals). ValueError
    when ``chosen_id`` is not a candidate."""
    everyone = list(candidates)
    best = max((c.cached_pages for c in everyone), default=0)
    terms = {c.worker_id: cost_terms(request, c, weights, best) for c in everyone}
    if chosen_id not in terms:
        raise ValueError(f"worker {chosen_id!r} is not among the candidates")
    chosen = terms[chosen_id]
    holders = [terms[c.worker_id] for c in everyone if c.cached_pages == best and best > 0]
    # The chosen one when it is a best holder itself, else the cheapest of them.
    holder = chosen if chosen in holders else min(
        holders, key=lambda t: (t.total, t.worker_id), default=None)
    return DecisionTrace(request.prompt_pages, request.prompt_tokens, chosen, holder,
                         len(everyone))


class DecisionSink(Protocol):
    """Hears of every route the router decides (with its trace) and of every awaited route
    ended by id (with the worker it went to), in the order they happen."""

    def decided(self, trace: DecisionTrace, route: RouteResult) -> None: ...

    def ended(self, route_id: str, worker_id: str) -> None: ...
