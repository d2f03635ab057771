"""Routing policies and batch ordering: exact choices and exact costs.

Unless a test says otherwise the prompt is 70 tokens at page size 16: 4 indexed pages and a
6-token tail that every worker computes. Default weights: prefill 1.0, lower tier 0.25,
queued (prefill backlog) 1.0, running request 8.0, memory pressure 1.0 (per token of pages
short), duplicate 1.0 (per token the best holder caches beyond the worker).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Iterator, Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator.core.errors import Unavailable
from coordinator.core.fleet import Candidate, WorkerLoad
from coordinator.core.routing import (
    BatchGroup,
    Decision,
    KvAwareChooser,
    KvAwareWeights,
    NoEligibleWorker,
    RoutingRequest,
    execution_order,
    group_identical,
    kv_aware_cost,
    load_floor,
    make_chooser,
)
from coordinator.core.routing.choosers import CHOOSERS

REQUEST = RoutingRequest(prompt_pages=4, prompt_tokens=70, page_size=16)


def cand(worker_id: str, cached: int = 0, lower: int = 0, **load: int) -> Candidate:
    return Candidate(worker_id, cached, lower, WorkerLoad(**load))


def choose(name: str, candidates: Sequence[Candidate], **weights: float) -> Decision:
    policy = make_chooser(name, KvAwareWeights(**weights))
    return policy.choose(REQUEST, candidates, random.Random(0))


def test_kv_aware_prefers_the_longest_cached_prefix_when_loads_are_equal() -> None:
    # uncached tokens: 0*16+6, 2*16+6, 4*16+6
    candidates = [cand("b", cached=2), cand("a", cached=4), cand("c")]
    assert [kv_aware_cost(REQUEST, c, KvAwareWeights()) for c in candidates] == [38.0, 6.0, 70.0]
    assert choose("kv_aware", candidates) == Decision("a", 6.0, 4)


def test_kv_aware_prices_what_the_computed_tokens_attend_over() -> None:
    # Engines whose token at position 70 costs two at position 0. a holds 4 pages: it computes
    # tokens 64-69, 6 + (70^2 - 64^2) / 2 / 70 = 11.74; b holds 2: tokens 32-69 attend over
    # more, 38 + (70^2 - 32^2) / 2 / 70 = 65.69, and it copies a's 2 other pages (32).
    # With 75 tokens of backlog on a, the flat count sends the prompt to b (81 > 70); priced
    # with attention it stays on a (86.74 < 97.69).
    busy, other = cand("a", cached=4, prefill_backlog_tokens=75), cand("b", cached=2)
    assert choose("kv_aware", [busy, other]) == Decision("b", 70.0, 2)
    busy, other = (cand("a", cached=4, prefill_backlog_tokens=75, attention_tokens=70),
                   cand("b", cached=2, attention_tokens=70))
    assert kv_aware_cost(REQUEST, busy, KvAwareWeights()) == pytest.approx(6 + 402 / 70 + 75)
    assert kv_aware_cost(REQUEST, other, KvAwareWeights(), 4) == pytest.approx(
        38 + 1_938 / 70 + 32)
    decision = choose("kv_aware", [busy, other])
    assert (decision.worker_id, decision.cached_pages) == ("a", 4)


def test_kv_aware_prefers_a_less_loaded_worker_when_its_backlog_outweighs_the_cache() -> None:
    # b computes 38 and copies the 2 pages only a holds (32): 70. a has 100 tokens of prefill
    # backlog: 6 + 100 = 106 > 70.
    busy, idle = cand("a", cached=4, prefill_backlog_tokens=100), cand("b", cached=2)
    assert choose("kv_aware", [busy, idle]) == Decision("b", 70.0, 2)
    # With 60 the prefix stays where it is: 6 + 60 = 66 < 70.
    assert choose("kv_aware", [cand("a", cached=4, prefill_backlog_tokens=60), idle]) == (
        Decision("a", 66.0, 4)
    )


def test_kv_aware_keeps_a_prefix_on_its_holder_where_one_requests_ttft_alone_would_move_it(
) -> None:
    # a: 6 + 80 backlog = 86. b caches nothing: 70, plus the 64-token copy of a's prefix = 134.
    # Priced as one request's TTFT alone (no copy charge) b would win at 70.
    holder, cold = cand("a", cached=4, prefill_backlog_tokens=80), cand("b")
    assert choose("kv_aware", [holder, cold]) == Decision("a", 86.0, 4)
    assert choose("kv_aware", [holder, cold], duplicate_token=0.0) == Decision("b", 70.0, 0)


def test_kv_aware_charges_the_tokens_that_overflow_what_routes_in_flight_pin() -> None:
    # 100 pages of 16 = 1,600 tokens; routes in flight pin 1,560 there: the 70-token prompt
    # overflows by 30, which preempts a running sequence to recompute: 6 + 30 = 36, still
    # below b's 22 + 16 copied = 38. With all 1,600 pinned: 6 + 70 = 76 > 38.
    crowded = cand("a", cached=4, active_tokens=1560, total_pages=100, free_pages=100)
    assert kv_aware_cost(REQUEST, crowded, KvAwareWeights()) == 36.0
    spare = cand("b", cached=3, total_pages=100, free_pages=100)
    assert choose("kv_aware", [crowded, spare]) == Decision("a", 36.0, 4)
    full = cand("a", cached=4, active_tokens=1600, total_pages=100, free_pages=100)
    assert choose("kv_aware", [full, spare]) == Decision("b", 38.0, 3)
    # With 1,530 pinned it fits exactly: nothing charged.
    roomy = cand("a", cached=4, active_tokens=1530, total_pages=100, free_pages=100)
    assert choose("kv_aware", [roomy, spare]) == Decision("a", 6.0, 4)
    # A worker whose capacity is unknown (no heartbeat yet) is never charged for it.
    assert kv_aware_cost(REQUEST, cand("c", cached=4, active_tokens=10**6), KvAwareWeights()) == 6


def test_kv_aware_waits_behind_the_prefill_backlog_not_the_heartbeats_queue() -> None:
    # Heartbeat and in-flight token counts (prompt + output, cached or not) are not a wait: the
    # backlog is. a: 6 + 0; b: 22 + 16 copied = 38.
    reported = cand("a", cached=4, queued_tokens=1000, inflight_tokens=1000)
    assert choose("kv_aware", [reported, cand("b", cached=3)]) == Decision("a", 6.0, 4)
    # Running and in-flight requests cost 8 each: 6 + 8 * 6 = 54 > 38.
    busy = cand("a", cached=4, running_requests=5, inflight_routes=1)
    assert choose("kv_aware", [busy, cand("b", cached=3)]) == Decision("b", 38.0, 3)


def test_lower_tier_pages_cost_less_than_recompute_but_more_than_gpu_pages() -> None:
    gpu, cpu, none = cand("gpu", cached=4), cand("cpu", cached=4, lower=4), cand("none")
    w = KvAwareWeights(lower_tier_token=0.25)
    # cpu: 6 uncached + 0.25 * 64 moved up = 22.
    assert [kv_aware_cost(REQUEST, c, w) for c in (gpu, cpu, none)] == [6.0, 22.0, 70.0]
    assert choose("kv_aware", [none, cpu, gpu]).worker_id == "gpu"
    # The default weight is the copy back's time (tier_costs): 0.0786432 prefill tokens each.
    assert choose("kv_aware", [none, cpu]) == Decision("cpu", 6 + 0.0786432 * 64, 4)


def test_memory_pressure_charges_pages_needed_beyond_free_pages() -> None:
    # Needs 4 pages + 1 tail page; 2 free -> 3 pages short -> 48 tokens: 70 + 48 = 118.
    tight = cand("tight", free_pages=2, total_pages=100)
    roomy = cand("roomy", free_pages=10, total_pages=100)
    assert kv_aware_cost(REQUEST, tight, KvAwareWeights()) == 118.0
    assert choose("kv_aware", [tight, roomy]) == Decision("roomy", 70.0, 0)
    # Lower-tier pages must come back into GPU pages: needs 4 + 1, 1 free -> 64; 6 + 16 + 64.
    cold_tight = cand("x", cached=4, lower=4, free_pages=1, total_pages=10)
    assert kv_aware_cost(REQUEST, cold_tight, KvAwareWeights(lower_tier_token=0.25)) == 86.0
    # Unknown capacity (no heartbeat yet) is not charged as full.
    assert kv_aware_cost(REQUEST, cand("new"), KvAwareWeights()) == 70.0


def test_copies_share_the_indexed_pages_and_each_compute_their_tail() -> None:
    group = RoutingRequest(prompt_pages=4, prompt_tokens=70, page_size=16, copies=8)
    w = KvAwareWeights()
    assert kv_aware_cost(group, cand("warm", cached=4), w) == 48.0  # 8 tails of 6
    assert kv_aware_cost(group, cand("cold"), w) == 112.0  # 64 once + 48
    # Needs 4 + 8 tail pages, 5 free: 7 pages short -> 112 more.
    assert kv_aware_cost(group, cand("cold", free_pages=5, total_pages=100), w) == 224.0


def test_weights_are_exchange_rates_the_caller_can_change() -> None:
    busy, idle = cand("a", cached=4, prefill_backlog_tokens=100), cand("b", cached=2)
    assert choose("kv_aware", [busy, idle], queued_token=0.0) == Decision("a", 6.0, 4)
    assert choose("kv_aware", [busy, idle], queued_token=0.25) == Decision("a", 31.0, 4)
    # b: 38 + 0.5 * 32 copied = 54 < 106.
    assert choose("kv_aware", [busy, idle], duplicate_token=0.5) == Decision("b", 54.0, 2)


def test_kv_aware_breaks_exact_ties_at_random_and_never_picks_a_costlier_worker() -> None:
    policy, rng = make_chooser("kv_aware"), random.Random(7)
    candidates = [cand("a", cached=2), cand("b", cached=1), cand("c", cached=2)]
    chosen = [policy.choose(REQUEST, candidates, rng).worker_id for _ in range(200)]
    assert set(chosen) == {"a", "c"}
    assert 60 < chosen.count("a") < 140


def test_a_unique_best_worker_draws_nothing_from_the_rng() -> None:
    rng = random.Random(3)
    before = rng.getstate()
    make_chooser("kv_aware").choose(REQUEST, [cand("a", cached=4), cand("b")], rng)
    assert rng.getstate() == before


def test_round_robin_cycles_in_worker_id_order_and_survives_membership_changes() -> None:
    policy, rng = make_chooser("round_robin"), random.Random(0)
    steps = [
        ("w3 w1 w2", "w1"),
        ("w3 w1 w2", "w2"),
        ("w3 w1 w2", "w3"),
        ("w3 w1 w2", "w1"),
        ("w1 w3", "w3"),  # w2 left: the next id after w1 is w3
        ("w2 w0 w3 w1", "w0"),  # w0 and w2 joined: nothing after w3, wrap to w0
        ("w2 w0 w3 w1", "w1"),
        ("w0 w3", "w3"),  # w1's successor w2 left
        ("w0 w3", "w0"),
    ]
    chosen = [
        policy.choose(REQUEST, [cand(w) for w in ids.split()], rng).worker_id for ids, _ in steps
    ]
    assert chosen == [expected for _, expected in steps]
    # A fresh policy starts from the smallest id again: the cursor is per instance.
    assert make_chooser("round_robin").choose(REQUEST, [cand("w2"), cand("w1")], rng).worker_id == (
        "w1"
    )


def test_least_loaded_takes_fewest_requests_then_fewest_tokens_and_ignores_the_cache() -> None:
    candidates = [
        cand("a", running_requests=2, queued_tokens=30),  # (2, 30)
        cand("b", running_requests=1, inflight_routes=1, queued_tokens=10, inflight_tokens=10),
        cand("c", running_requests=3),  # (3, 0)
        cand("d", cached=4, running_requests=5),  # warm but busy
    ]
    # Its cost is still reported on the kv_aware scale: 70 + 8 * 2 requests + 64 tokens of d's
    # prefix copied.
    assert choose("least_loaded", candidates) == Decision("b", 150.0, 0)


def test_least_loaded_breaks_ties_at_random() -> None:
    policy, rng = make_chooser("least_loaded"), random.Random(11)
    candidates = [
        cand("a", queued_tokens=5),
        cand("b", queued_tokens=5),
        cand("c", queued_tokens=6),
    ]
    chosen = {policy.choose(REQUEST, candidates, rng).worker_id for _ in range(100)}
    assert chosen == {"a", "b"}


@pytest.mark.parametrize("name", sorted(CHOOSERS))
def test_no_candidates_raises_no_eligible_worker(name: str) -> None:
    with pytest.raises(NoEligibleWorker) as raised:
        make_chooser(name).choose(REQUEST, [], random.Random(0))
    assert isinstance(raised.value, Unavailable)  # the interceptor answers UNAVAILABLE


@pytest.mark.parametrize("name", sorted(CHOOSERS))
def test_a_candidate_caching_more_pages_than_the_prompt_has_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="more pages than the prompt"):
        make_chooser(name).choose(REQUEST, [cand("a", cached=5)], random.Random(0))


def test_registry_names_every_policy_and_cannot_be_changed() -> None:
    assert sorted(CHOOSERS) == ["kv_aware", "least_loaded", "round_robin"]
    assert all(make_chooser(name).name == name for name in CHOOSERS)
    with pytest.raises(TypeError):
        CHOOSERS["mine"] = CHOOSERS["kv_aware"]  # type: ignore[index]


def test_unknown_policy_name_is_refused_with_the_known_names() -> None:
    with pytest.raises(ValueError, match="'fastest'; known: kv_aware, least_loaded, round_robin"):
        make_chooser("fastest")


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(KvAwareWeights)])
@pytest.mark.parametrize("bad", [-0.5, math.nan, math.inf])
def test_weights_must_be_finite_and_non_negative(field: str, bad: float) -> None:
    with pytest.raises(ValueError, match=f"KvAwareWeights.{field} must be >= 0"):
        KvAwareWeights(**{field: bad})
    assert getattr(KvAwareWeights(**{field: 0.0}), field) == 0.0


@pytest.mark.parametrize(
    "build",
    [
        lambda: WorkerLoad(queued_tokens=-1),
        lambda: Candidate("a", 2, 3, WorkerLoad()),
        lambda: Candidate("a", -1, 0, WorkerLoad()),
        lambda: RoutingRequest(prompt_pages=5, prompt_tokens=70, page_size=16),
        lambda: RoutingRequest(prompt_pages=0, prompt_tokens=70, page_size=0),
        lambda: RoutingRequest(prompt_pages=4, prompt_tokens=70, page_size=16, copies=0),
    ],
)
def test_inconsistent_inputs_are_refused(build: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        build()


def k(n: int) -> bytes:
    return bytes([n]) * 16


A, B, C, D, E = k(1), k(2), k(3), k(4), k(5)
# 0, 2 and 7 are siblings; 1 shares their first two pages only; 4 has their pages but a longer
# tail; 3 and 5 have no full page; 6 is a prefix of 0; 8 shares nothing.
BATCH_KEYS = [[A, B, C], [A, B, D], [A, B, C], [], [A, B, C], [], [A, B], [A, B, C], [E]]
BATCH_TOKENS: list[Sequence[int] | int] = [50, 50, 50, 5, list(range(55)), 5, 40, 50, 20]


def test_group_identical_groups_same_keys_and_length_in_first_seen_order() -> None:
    assert group_identical(BATCH_KEYS, BATCH_TOKENS) == [
        BatchGroup((0, 2, 7)),
        BatchGroup((1,)),
        BatchGroup((3,)),
        BatchGroup((4,)),
        BatchGroup((5,)),
        BatchGroup((6,)),
        BatchGroup((8,)),
    ]
    with pytest.raises(ValueError):
        group_identical(BATCH_KEYS, BATCH_TOKENS[:-1])


def test_execution_order_walks_the_prefix_trie_with_siblings_adjacent() -> None:
    assigned = ["w1", "w2", "w1", "w2", "w1", "w1", "w2", "w1", "w2"]
    # Empty keys first (5 before 3: by worker), then [A,B], its extensions, then [E].
    assert execution_order(BATCH_KEYS, assigned) == [5, 3, 6, 0, 2, 4, 7, 1, 8]
    # Identical prompts split over workers stay together per worker, each in input order.
    assert execution_order([[A]] * 4, ["w2", "w1", "w2", "w1"]) == [1, 3, 0, 2]
    with pytest.raises(ValueError):
        execution_order(BATCH_KEYS, assigned[:-1])


def common_prefix(x: Sequence[bytes], y: Sequence[bytes]) -> int:
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return n


@given(
    st.lists(
        st.tuples(st.lists(st.sampled_from([A, B, C]), max_size=4), st.sampled_from(["w1", "w2"])),
        max_size=12,
    )
)
def test_execution_order_keeps_every_shared_prefix_contiguous(
    prompts: list[tuple[list[bytes], str]],
) -> None:
    keys = [p[0] for p in prompts]
    order = execution_order(keys, [p[1] for p in prompts])
    assert sorted(order) == list(range(len(prompts)))
    walked = [keys[i] for i in order]
    for p in range(len(walked)):
        for q in range(p + 1, len(walked)):
            shared = common_prefix(walked[p], walked[q])
            assert all(common_prefix(walked[p], walked[r]) >= shared for r in range(p, q))


def test_kv_aware_reads_idle_workers_only_until_none_can_win() -> None:
    weights = KvAwareWeights()
    request = RoutingRequest(prompt_pages=4, prompt_tokens=70, page_size=16)
    idle = sorted(
        [cand(f"i{n}", prefill_backlog_tokens=10 * n, total_pages=100, free_pages=100)
         for n in range(50)],
        key=lambda c: load_floor(c.load, weights),
    )
    seen: list[str] = []

    def stream() -> Iterator[Candidate]:
        for c in idle:
            seen.append(c.worker_id)
            yield c

    holder = cand("h", cached=2, prefill_backlog_tokens=80, total_pages=100, free_pages=100)
    decision = make_chooser("kv_aware").choose(request, [holder], random.Random(0), idle=stream())
    # h: 38 uncached + 80 backlog = 118; i0: 70 + 32 copied + 0 = 102 wins; i1's floor
    # 102 + 10 > 102: stop.
    assert (decision.worker_id, decision.cost) == ("i0", 102.0)
    assert seen == ["i0", "i1"]
    seen.clear()
    holder = cand("h", cached=2, prefill_backlog_tokens=25, total_pages=100, free_pages=100)
    decision = make_chooser("kv_aware").choose(request, [holder], random.Random(0), idle=stream())
    # h: 38 + 25 = 63 beats even i0's floor (102): i0 is read, not costed; nothing after it.
    assert (decision.worker_id, decision.cost) == ("h", 63.0)
    assert seen == ["i0"]


loads = st.builds(
    WorkerLoad,
    running_requests=st.integers(0, 4), queued_tokens=st.integers(0, 200),
    free_pages=st.integers(0, 20), total_pages=st.sampled_from([0, 20]),
    inflight_routes=st.integers(0, 3), inflight_tokens=st.integers(0, 100),
    prefill_backlog_tokens=st.integers(0, 200).map(float),
)


@given(
    holders=st.lists(st.tuples(st.integers(1, 6), loads), max_size=4),
    idle_loads=st.lists(loads, max_size=12),
)
def test_kv_aware_with_idle_in_floor_order_costs_the_same_as_reading_everyone(
    holders: list[tuple[int, WorkerLoad]], idle_loads: list[WorkerLoad]
) -> None:
    weights = KvAwareWeights()
    request = RoutingRequest(prompt_pages=6, prompt_tokens=100, page_size=16)
    held = [Candidate(f"h{i}", cached, 0, load) for i, (cached, load) in enumerate(holders)]
    idle = sorted(
        (Candidate(f"i{i}", 0, 0, load) for i, load in enumerate(idle_loads)),
        key=lambda c: load_floor(c.load, weights),
    )
    if not held and not idle:
        return
    policy = KvAwareChooser(weights)
    everyone = policy.choose(request, [*held, *idle], random.Random(1))
    pruned = policy.choose(request, held, random.Random(1), idle=iter(idle))
    assert pruned.cost == everyone.cost
    longest = max((c.cached_pages for c in held), default=0)
    best = {c.worker_id for c in [*held, *idle]
            if kv_aware_cost(request, c, weights, longest) == everyone.cost}
    assert pruned.worker_id in best
