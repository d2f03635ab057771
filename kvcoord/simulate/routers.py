"""How the simulator asks a policy where a request goes, and the production policies' adapter.

:class:`ProductionRouter` runs ``kv_aware``, ``round_robin`` and ``least_loaded`` through the
very code the coordinator's ``Scheduler`` runs: ``coordinator.routing.make_policy(name)``
choosing among :class:`Candidate` objects built from the production
``PrefixIndex.match_detail(keys, include_pending=True)`` (holders) plus every other worker as
an idle candidate in ascending ``load_floor`` order, then ``add_pending`` for the chosen
worker's unconfirmed pages. Only the loads are simulated (``SimWorker.load``).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from coordinator.index import MatchDetail, PrefixIndex
from coordinator.routing import (
    Candidate,
    KvAwareWeights,
    RoutingRequest,
    load_floor,
    make_policy,
)
from kvcoord.simulate.simworker import Job, SimWorker


@dataclass(frozen=True, slots=True)
class RouterContext:
    """What every simulated router may read: the workers (index = position), the production
    index (kept current by the workers' Stored/Removed events), the page size, the seeded
    ``rng`` (the only randomness allowed) and the production router's weights."""

    workers: Sequence[SimWorker]
    index: PrefixIndex
    page_size: int
    rng: random.Random
    weights: KvAwareWeights


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
    """A production policy (``make_policy(name, weights)``), fed as the Scheduler feeds it."""

    def __init__(self, name: str, ctx: RouterContext) -> None:
        self.name = name
        self._policy = make_policy(name, ctx.weights)
        self._ctx = ctx
        self._position = {w.worker_id: i for i, w in enumerate(ctx.workers)}

    def route(self, job: Job, details: Mapping[str, MatchDetail], now: float) -> int:
        ctx = self._ctx
        keys, request = job.keys, job.request
        loads = [w.load(now) for w in ctx.workers]
        holders = [
            Candidate(worker_id, d.pages, d.lower_tier_pages, loads[self._position[worker_id]])
            for worker_id, d in details.items()
        ]
        # The fleet hands idle workers over cheapest load floor first (ties: fleet order).
        idle_order = sorted(
            (i for i, w in enumerate(ctx.workers) if w.worker_id not in details),
            key=lambda i: load_floor(loads[i], ctx.weights),
        )
        idle = (Candidate(ctx.workers[i].worker_id, 0, 0, loads[i]) for i in idle_order)
        routing_request = RoutingRequest(
            prompt_pages=len(keys), prompt_tokens=request.input_length,
            page_size=ctx.page_size,
        )
        decision = self._policy.choose(routing_request, holders, ctx.rng, idle=idle)
        detail = details.get(decision.worker_id)
        confirmed = detail.confirmed_pages if detail is not None else 0
        if confirmed < len(keys):
            ctx.index.add_pending(decision.worker_id, keys[confirmed:])
        return self._position[decision.worker_id]

    def on_prefill_done(self, worker: int, job: Job) -> None:
        """Nothing: the production router reads loads and the index, it keeps no books."""

    def on_finished(self, worker: int, job: Job) -> None:
        """Nothing, as ``on_prefill_done``."""
