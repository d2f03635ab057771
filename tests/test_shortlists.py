"""Shortlists: the decision over several shards' shortlists is the one a single chooser makes
over all their candidates, for every routing rule: same worker, same cost, same draws."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.fleet import Candidate, WorkerLoad
from coordinator.core.routing import (
    CHOOSERS,
    KvAwareWeights,
    NoEligibleWorker,
    RoutingRequest,
    kv_aware_cost,
    load_floor,
    make_chooser,
)

REQUEST = RoutingRequest(prompt_pages=4, prompt_tokens=70, page_size=16)
WEIGHTS = KvAwareWeights()


@st.composite
def fleets(draw: st.DrawFn) -> tuple[list[Candidate], list[Candidate], list[int]]:
    """Holders, idle workers (ascending load floor, as the router gives them) and a shard for
    each worker; loads from a small range, so ties are common."""
    n = draw(st.integers(1, 12))
    ids = [f"w{i:02d}" for i in draw(st.permutations(range(n)))]
    holders, idle = [], []
    for worker_id in ids:
        load = WorkerLoad(
            running_requests=draw(st.integers(0, 2)),
            queued_tokens=draw(st.sampled_from([0, 16])),
            free_pages=draw(st.sampled_from([0, 4, 64])),
            total_pages=draw(st.sampled_from([0, 64])),
            inflight_routes=draw(st.integers(0, 1)),
            attention_tokens=draw(st.sampled_from([math.inf, 64.0, 500.0])),
        )
        cached = draw(st.integers(0, REQUEST.prompt_pages))
        if cached:
            holders.append(Candidate(worker_id, cached, draw(st.integers(0, cached)), load))
        else:
            idle.append(Candidate(worker_id, 0, 0, load))
    idle.sort(key=lambda c: load_floor(c.load, WEIGHTS))
    shards = [draw(st.integers(0, 2)) for _ in range(n)]
    return holders, idle, shards


def _split(candidates: list[Candidate], shard_of: dict[str, int], shard: int) -> list[Candidate]:
    return [c for c in candidates if shard_of[c.worker_id] == shard]


@settings(max_examples=300, deadline=None)
@given(fleet=fleets(), rule=st.sampled_from(sorted(CHOOSERS)), seed=st.integers(0, 2**16),
       rounds=st.integers(1, 3))
def test_deciding_over_shards_shortlists_equals_one_chooser_over_everyone(
        fleet: tuple[list[Candidate], list[Candidate], list[int]], rule: str, seed: int,
        rounds: int) -> None:
    holders, idle, shards = fleet
    shard_of = {c.worker_id: s for c, s in zip([*holders, *idle], shards, strict=True)}
    one, merged = make_chooser(rule, WEIGHTS), make_chooser(rule, WEIGHTS)
    one_rng, merged_rng = random.Random(seed), random.Random(seed)
    for _ in range(rounds):  # round robin's cursor moves alike in both
        expected = one.choose(REQUEST, holders, one_rng, idle=iter(idle))
        shortlists = [
            merged.shortlist(REQUEST, _split(holders, shard_of, s), iter(_split(idle, shard_of, s)),
                             after=merged.cursor)
            for s in range(3)
        ]
        assert merged.decide(REQUEST, shortlists, merged_rng) == expected
        best = max((c.cached_pages for c in holders), default=0)
        chosen = next(c for c in [*holders, *idle] if c.worker_id == expected.worker_id)
        assert expected.cost == kv_aware_cost(REQUEST, chosen, WEIGHTS, best)


def test_kv_aware_charges_every_shard_the_copy_of_the_longest_prefix_anywhere() -> None:
    # Shard 0's only holder caches 4 pages; shard 1's caches 1 and is idle otherwise. Shard 1
    # alone would price its holder without the copy of the 3 pages it lacks; the decision
    # over both charges it (3 x 16 duplicate tokens) and the full holder wins.
    busy_full = Candidate("a", 4, 0, WorkerLoad(running_requests=5))
    partial = Candidate("b", 1, 0, WorkerLoad())
    chooser = make_chooser("kv_aware", WEIGHTS)
    shortlists = [chooser.shortlist(REQUEST, [busy_full]), chooser.shortlist(REQUEST, [partial])]
    decision = chooser.decide(REQUEST, shortlists, random.Random(0))
    assert decision == chooser.choose(REQUEST, [busy_full, partial], random.Random(0))
    assert decision.worker_id == "a"
    assert decision.cost == kv_aware_cost(REQUEST, busy_full, WEIGHTS, 4)


def test_shards_without_a_candidate_leave_no_eligible_worker() -> None:
    chooser = make_chooser("kv_aware", WEIGHTS)
    empty = [chooser.shortlist(REQUEST, []), chooser.shortlist(REQUEST, [])]
    with pytest.raises(NoEligibleWorker):
        chooser.decide(REQUEST, empty, random.Random(0))
