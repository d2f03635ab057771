"""How the simulator asks a policy where a request goes, and the production policies' adapter.

:class:`ProductionRouter` runs ``kv_aware``, ``round_robin`` and ``least_loaded`` through the
very code the coordinator's ``Router`` runs:
``coordinator.core.routing.choosers.make_chooser(name)``
choosing among :class:`Candidate` objects built from the production
``PrefixIndex.match_detail(keys, include_pending=True)`` (holders) plus every other worker as
an idle candidate in ascending ``load_floor`` order, then ``add_pending`` for the chosen
worker's unconfirmed pages, ``hold_inflight`` and ``queue_prefill`` (``booked_work``) in the
coordinator's books.
The loads it reads are the coordinator's (``views.CoordinatorLoads``: heartbeat-delayed, plus
in-flight, plus the prefill backlog).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from coordinator.core.fleet import Candidate
from coordinator.core.index import MatchDetail, PrefixIndex
from coordinator.core.routing import (
    KvAwareWeights,
    RoutingRequest,
    booked_work,
    load_floor,
    make_chooser,
)
from kvcoord.simulate.simworker import Job
from kvcoord.simulate.views import CoordinatorLoads


@dataclass(frozen=True, slots=True)
class RouterContext:
    """What a simulated router may read (never a worker's exact state; see ``views``): the
    workers' ids (index = position), the production index (fed by the workers' Stored/Removed
    events after the Sync delay), the page size, the seeded ``rng`` (the only randomness
    allowed), the production router's weights, and the production coordinator's load books
    (read by the production policies only)."""

    worker_ids: Sequence[str]
    index: PrefixIndex
    page_size: int
    rng: random.Random
    weights: KvAwareWeights
    coordinator: CoordinatorLoads


class SimRouter(Protocol):
    """A routing policy under simulation. ``route`` gets the job and the index's view of it
    (``details``: the production ``match_detail`` with pending entries, taken just before) and
    returns a worker position; the two hooks tell it when a job's prefill ended and when the
    job finished, for policies that keep their own load books."""

    name: str

    def route(self, job: Job, details: Mapping[str, MatchDetail], now: float) -> int: ...

    def on_prefill_done(self, worker: int, job: Job) -> None: ...

    def on_finished(self, worker: int, job: Job) -> None: ...


class ProductionRouter:
    """A production policy (``make_chooser(name, weights)``), fed as the Router feeds it."""

    def __init__(self, name: str, ctx: RouterContext) -> None:
        self.name = name
        self._policy = make_chooser(name, ctx.weights)
        self._ctx = ctx
        self._position = {worker_id: i for i, worker_id in enumerate(ctx.worker_ids)}

    def route(self, job: Job, details: Mapping[str, MatchDetail], now: float) -> int:
        ctx = self._ctx
        keys, request = job.keys, job.request
        loads = [ctx.coordinator.load(i, now) for i in range(len(ctx.worker_ids))]
        holders = [
            Candidate(worker_id, d.pages, d.lower_tier_pages, loads[self._position[worker_id]])
            for worker_id, d in details.items()
        ]
        # The fleet hands idle workers over cheapest load floor first (ties: fleet order).
        idle_order = sorted(
            (i for i, worker_id in enumerate(ctx.worker_ids) if worker_id not in details),
            key=lambda i: load_floor(loads[i], ctx.weights),
        )
        idle = (Candidate(ctx.worker_ids[i], 0, 0, loads[i]) for i in idle_order)
        routing_request = RoutingRequest(
            prompt_pages=len(keys), prompt_tokens=request.input_length,
            page_size=ctx.page_size,
        )
        decision = self._policy.choose(routing_request, holders, ctx.rng, idle=idle)
        detail = details.get(decision.worker_id)
        confirmed = detail.confirmed_pages if detail is not None else 0
        if confirmed < len(keys):
            ctx.index.add_pending(decision.worker_id, keys[confirmed:])
        position = self._position[decision.worker_id]
        cached_tokens = min(confirmed * ctx.page_size, request.input_length)
        ctx.coordinator.routed(position, request.input_length, cached_tokens,
                               booked_work(routing_request, decision.cached_pages,
                                           detail.lower_tier_pages if detail else 0,
                                           ctx.weights), now,
                               keys[confirmed:])
        return position

    def on_prefill_done(self, worker: int, job: Job) -> None:
        """Nothing: the coordinator learns of it from the worker's heartbeats."""

    def on_finished(self, worker: int, job: Job) -> None:
        """Nothing, as ``on_prefill_done``."""
