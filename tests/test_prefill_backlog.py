"""The coordinator's prefill backlog per worker: the routes it issued, drained at the worker's
prefill rate (configured, then learned from the Stored events that end each prefill), and the
order in which the fleet hands idle workers to the router."""

from __future__ import annotations

import math

import pytest

from coordinator.core.fleet import Fleet, PrefillBacklog, RegisteredWorker, WorkerLoad
from coordinator.core.fleet.prefill_backlog import (
    END_KEYS,
    MIN_FIT,
    RATE_WINDOW,
    attention_positions,
    least_squares,
)
from coordinator.core.routing import KvAwareWeights, load_floor


def session(worker_id: str) -> RegisteredWorker:
    return RegisteredWorker(worker_id=worker_id, incarnation=1, address="", model="m",
                            policy_version=0, external=False, total_pages=100,
                            lease_deadline=math.inf, connected=True)


def fleet_of(*ids: str, rate: float = 1_000.0) -> Fleet:
    weights = KvAwareWeights()
    fleet = Fleet(lambda load: load_floor(load, weights), backlog_weight=weights.queued_token,
                  prefill_tokens_per_s=rate)
    for worker_id in ids:
        fleet.put(session(worker_id))
    return fleet


def test_routed_prefill_drains_at_the_stated_rate_first_in_first_out() -> None:
    fleet = fleet_of("a")
    a = fleet.get("a")
    assert a is not None
    a.queue_prefill(500, now=10.0)  # done at 10.5 s
    a.queue_prefill(300, now=10.2)  # queued behind it: done at 10.8 s
    assert a.prefill_backlog(10.2) == pytest.approx(600.0)
    assert a.prefill_backlog(10.7) == pytest.approx(100.0)
    assert a.prefill_backlog(11.0) == 0.0
    # An idle worker starts the next prompt when it arrives, not at the old busy end.
    a.queue_prefill(200, now=20.0)
    assert a.prefill_backlog(20.0) == pytest.approx(200.0)
    assert a.current_load(20.1).prefill_backlog_tokens == pytest.approx(100.0)
    assert a.current_load().prefill_backlog_tokens == 0.0  # no time given: no backlog


def test_the_fleet_hands_workers_over_by_their_floor_at_the_time_of_the_route() -> None:
    fleet = fleet_of("a", "b")
    a, b = fleet.get("a"), fleet.get("b")
    assert a is not None and b is not None
    b.report_load(WorkerLoad(running_requests=2, total_pages=100), completed_routes=0)
    a.queue_prefill(100, now=0.0)  # a: 100 backlog; b: 2 running = 16
    assert [s.worker_id for s in fleet.routable(0.0, version=0, min_version=None,
                                                model="m")] == ["b", "a"]
    assert a.floor_at(0.0) == pytest.approx(100.0)
    # 90 ms later a has 10 tokens left: cheaper than b's two running requests.
    assert [s.worker_id for s in fleet.routable(0.09, version=0, min_version=None,
                                                model="m")] == ["a", "b"]
    assert a.idle_candidate(0.09).load.prefill_backlog_tokens == pytest.approx(10.0)


@pytest.mark.parametrize("rate", [0.0, -1.0, math.inf, math.nan])
def test_a_prefill_rate_that_is_not_finite_and_positive_is_refused(rate: float) -> None:
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        fleet_of(rate=rate)


def test_prompt_tokens_of_routes_in_flight_count_as_pinned_until_a_heartbeat_settles_them(
) -> None:
    fleet = fleet_of("a")
    a = fleet.get("a")
    assert a is not None
    a.hold_inflight(100, 2, max_inflight=8, context_tokens=300)
    a.hold_inflight(50, 1, max_inflight=8, context_tokens=400)
    assert a.current_load().active_tokens == 1000
    a.report_load(WorkerLoad(total_pages=100), completed_routes=2)  # the oldest two
    assert (a.current_load().active_tokens, a.current_load().inflight_tokens) == (400, 50)
    a.hold_awaited(10, 3, context_tokens=20)
    assert a.current_load().active_tokens == 460
    a.release_awaited(10, 3, context_tokens=20)
    assert a.current_load().active_tokens == 400


# ---- the rate learned from Stored events (core.prefill_backlog) ------------------------------

def test_a_prefill_end_seen_in_a_stored_event_corrects_the_books_and_teaches_the_rate() -> None:
    backlog = PrefillBacklog(1_000.0)  # configured: 1,000 tokens/s
    backlog.book(500, now=0.0, end_keys=[b"a-last"])  # idle worker: starts at once
    backlog.book(300, now=0.1, end_keys=[b"b-last"])  # queued behind it
    # The worker is slower than configured: "a" ends at 1.0 s, not 0.5 s.
    backlog.observe_stored([b"a-first", b"a-last"], now=1.0)
    assert backlog.tokens_per_s == pytest.approx(500.0)  # 500 tokens in 1.0 s
    assert backlog.tokens(1.0) == pytest.approx(300.0)  # only "b" is left
    assert backlog.tokens(1.2) == pytest.approx(200.0)  # draining at the learned rate
    # "b" queued behind "a": its 300 tokens took from a's end to b's, 0.5 s.
    backlog.observe_stored([b"b-last"], now=1.5)
    assert backlog.tokens_per_s == pytest.approx(800 / 1.5)  # (500 + 300) over (1.0 + 0.5)
    assert backlog.tokens(1.5) == 0.0


def test_an_end_seen_late_also_ends_every_route_booked_before_it() -> None:
    backlog = PrefillBacklog(1_000.0)
    backlog.book(100, now=0.0, end_keys=[b"a"])
    backlog.book(100, now=0.0, end_keys=[b"b"])
    backlog.book(100, now=0.0, end_keys=[b"c"])
    backlog.observe_stored([b"b"], now=0.2)  # a's event was lost or merged: b ends both
    assert backlog.tokens(0.2) == pytest.approx(100.0)
    # With no earlier end seen, b's queue's start is unknown: its own 100 tokens over the 0.2 s
    # since it was routed, a rate on the low (safe) side.
    assert backlog.tokens_per_s == pytest.approx(500.0)
    backlog.observe_stored([b"a"], now=0.25)  # a's mark went with b's end: nothing happens
    assert backlog.tokens(0.25) == pytest.approx(75.0)
    # Keys nobody marked (a cached prompt, a page moved to the host tier) change nothing.
    backlog.observe_stored([b"z"], now=0.25)
    assert backlog.tokens(0.25) == pytest.approx(75.0)


def test_the_rate_follows_the_last_window_of_measured_prefills() -> None:
    backlog = PrefillBacklog(1_000.0)
    now = 0.0
    for i in range(RATE_WINDOW):  # slow at first: 100 tokens/s
        backlog.book(100, now, end_keys=[f"slow{i}".encode()])
        now += 1.0
        backlog.observe_stored([f"slow{i}".encode()], now)
    assert backlog.tokens_per_s == pytest.approx(100.0)
    for i in range(RATE_WINDOW):  # then 400 tokens/s: the old measures age out
        backlog.book(100, now, end_keys=[f"fast{i}".encode()])
        now += 0.25
        backlog.observe_stored([f"fast{i}".encode()], now)
    assert backlog.tokens_per_s == pytest.approx(400.0)


def test_an_end_is_seen_in_the_last_full_engine_block_when_the_last_page_is_never_stored(
) -> None:
    # A 32-token engine block holds two 16-token pages: a prompt of 7 pages has its seventh in
    # a block the engine never publishes. The route marks its last END_KEYS pending keys
    # (p3-p6); the engine's chunks store p0-p1, then p2-p5 when the prefill ends.
    assert END_KEYS == 4
    backlog = PrefillBacklog(1_000.0)
    pages = [f"p{i}".encode() for i in range(7)]
    backlog.book(112, now=0.0, end_keys=pages)
    backlog.observe_stored(pages[:2], now=0.05)  # a first chunk: not the end
    assert backlog.tokens_per_s == 1_000.0 and backlog.tokens(0.05) == pytest.approx(62.0)
    backlog.observe_stored(pages[2:6], now=0.14)  # the last full block is in this batch
    assert backlog.tokens_per_s == pytest.approx(800.0)
    assert backlog.tokens(0.14) == 0.0
    backlog.observe_stored(pages[6:], now=0.2)  # the route's other marks went with its end
    assert backlog.tokens_per_s == pytest.approx(800.0)


def test_a_fixed_cost_per_route_is_learned_beside_the_rate_from_prompts_of_several_sizes(
) -> None:
    # The engine takes 33 ms per request plus 1/2,800 s per token computed (a vLLM CPU
    # engine's figures); each prompt is routed to an idle worker and its end seen exactly.
    backlog = PrefillBacklog(15_000.0)
    now = 0.0
    for i in range(2 * MIN_FIT):
        work = 64 + 200 * (i % 5)
        backlog.book(work, now, end_keys=[f"k{i}".encode()])
        now += 0.033 + work / 2_800
        backlog.observe_stored([f"k{i}".encode()], now)
        now += 1.0  # idle between prompts
    assert backlog.per_route_s == pytest.approx(0.033)
    assert backlog.tokens_per_s == pytest.approx(2_800.0)
    # A prompt the worker holds whole still costs the fixed 33 ms: booked as 92.4 tokens of
    # work at the learned rate.
    backlog.book(0, now)
    assert backlog.seconds(now) == pytest.approx(0.033)
    assert backlog.tokens(now) == pytest.approx(0.033 * 2_800)


def test_prompts_of_one_size_cannot_tell_a_fixed_cost_from_the_rate() -> None:
    backlog = PrefillBacklog(1_000.0)
    now = 0.0
    for i in range(2 * MIN_FIT):
        backlog.book(100, now, end_keys=[f"k{i}".encode()])
        now += 0.5
        backlog.observe_stored([f"k{i}".encode()], now)
        now += 1.0
    assert (backlog.per_route_s, backlog.tokens_per_s) == (0.0, pytest.approx(200.0))


def _measure(backlog: PrefillBacklog, tokens_per_s: float, key: bytes) -> None:
    """One prefill of 100 tokens seen to end at ``tokens_per_s``, on an idle worker."""
    backlog.book(100, now=0.0, end_keys=[key])
    backlog.observe_stored([key], now=100 / tokens_per_s)


def test_a_worker_that_measured_nothing_costs_routes_at_its_measured_peers_median() -> None:
    fleet = fleet_of("a", "b", "c", rate=15_000.0)
    a, b, c = (fleet.get(w) for w in "abc")
    assert a is not None and b is not None and c is not None
    assert c.backlog.tokens_per_s == 15_000.0  # nobody measured: the configured rate
    _measure(a.backlog, 500.0, b"a0")
    assert c.backlog.tokens_per_s == pytest.approx(500.0) and not c.backlog.measured
    _measure(b.backlog, 1_500.0, b"b0")
    assert c.backlog.tokens_per_s == pytest.approx(1_000.0)  # the median of 500 and 1,500
    assert a.backlog.tokens_per_s == pytest.approx(500.0)  # its own, not the median
    _measure(c.backlog, 2_000.0, b"c0")
    assert c.backlog.measured and c.backlog.tokens_per_s == pytest.approx(2_000.0)
    # A worker that leaves takes its costs along; one that joins starts at the others'.
    fleet.remove("a")
    fleet.put(session("d"))
    d = fleet.get("d")
    assert d is not None and d.backlog.tokens_per_s == pytest.approx(1_750.0)
    # Another model's workers are not peers.
    other = RegisteredWorker(worker_id="e", incarnation=1, address="", model="other",
                             policy_version=0, external=False, total_pages=100,
                             lease_deadline=math.inf, connected=True)
    fleet.put(other)
    assert other.backlog.tokens_per_s == 15_000.0


def test_a_new_worker_beside_a_measured_one_shares_fresh_prompts_with_it() -> None:
    # "a" measured its engine at 1,000 tokens/s; "b" just joined. Prompts of 100 tokens arrive
    # every 20 ms, each to the worker with the least work left. Judged at the configured
    # 15,000 tokens/s, b would drain each prompt in 7 ms and look idle at every arrival, so it
    # would take all of them; at its peer's pace it takes its share.
    fleet = fleet_of("a", "b", rate=15_000.0)
    a, b = fleet.get("a"), fleet.get("b")
    assert a is not None and b is not None
    _measure(a.backlog, 1_000.0, b"a0")
    landed = []
    for i in range(6):
        now = 10.0 + 0.02 * i
        chosen = min((a, b), key=lambda s: (s.floor_at(now), s.worker_id))
        chosen.queue_prefill(100, now)
        landed.append(chosen.worker_id)
    assert landed.count("a") == landed.count("b") == 3, landed


def _engine_s(work: int, context: int) -> float:
    """A CPU engine's prefill of the last ``work`` tokens of a ``context``-token prompt: 33 ms a
    request, 2,800 tokens/s at position 0, a token at position 550 costing two."""
    return 0.033 + (work + attention_positions(work, context) / 550) / 2_800


def _learned(backlog: PrefillBacklog, prompts: list[tuple[int, int]]) -> float:
    """Each (work, context) routed to the idle worker and its end seen exactly; the time after."""
    now = 0.0
    for i, (work, context) in enumerate(prompts):
        backlog.book(work, now, end_keys=[f"k{i}".encode()], context_tokens=context)
        now += _engine_s(work, context)
        backlog.observe_stored([f"k{i}".encode()], now)
        now += 1.0
    return now


PROMPTS = [(64 + 200 * (i % 5), 64 + 200 * (i % 5) + 700 * (i % 3)) for i in range(2 * MIN_FIT)]


def test_attention_is_learned_beside_the_fixed_cost_and_the_rate() -> None:
    backlog = PrefillBacklog(15_000.0)
    now = _learned(backlog, PROMPTS)
    assert backlog.per_route_s == pytest.approx(0.033)
    assert backlog.tokens_per_s == pytest.approx(2_800.0)
    assert backlog.attention_tokens == pytest.approx(550.0)
    # The tail of a long prompt is booked at what it costs, not at its token count: 961
    # tokens after 2,162 cached take 2.0 s here, not the 0.38 s a flat rate says.
    backlog.book(961, now, context_tokens=3_123)
    assert backlog.seconds(now) == pytest.approx(_engine_s(961, 3_123))
    assert backlog.seconds(now) > 5 * (0.033 + 961 / 2_800)


def test_routes_of_one_length_from_the_start_leave_attention_out() -> None:
    # Every prompt computed from position 0 with the same work: attention is a fixed share of
    # each, so it cannot be told from the rate; the flat rate absorbs it.
    backlog = PrefillBacklog(1_000.0)
    _learned(backlog, [(500, 500)] * (2 * MIN_FIT))
    assert backlog.attention_tokens == math.inf and backlog.per_route_s == 0.0
    assert backlog.tokens_per_s == pytest.approx(500 / _engine_s(500, 500))


def test_a_worker_that_measured_nothing_takes_its_peers_attention() -> None:
    fleet = fleet_of("a", "b", rate=15_000.0)
    a, b = fleet.get("a"), fleet.get("b")
    assert a is not None and b is not None
    assert b.backlog.attention_tokens == math.inf
    _learned(a.backlog, PROMPTS)
    assert b.backlog.attention_tokens == pytest.approx(550.0)
    assert b.current_load(0.0).attention_tokens == pytest.approx(550.0)


def test_a_short_prompt_is_not_queued_behind_a_long_prompts_tail() -> None:
    # Both workers learned the engine. "a" was given the 961-token tail of a 3,123-token prompt;
    # half a second later a short prompt comes. Booked flat, a's tail looks done by then
    # (0.38 s) and the prompt would queue behind 1.5 s of real work; booked with attention it
    # goes to the idle "b".
    fleet = fleet_of("a", "b", rate=15_000.0)
    a, b = fleet.get("a"), fleet.get("b")
    assert a is not None and b is not None
    for worker in (a, b):
        _learned(worker.backlog, PROMPTS)
    a.queue_prefill(961, 100.0, context_tokens=3_123)
    now = 100.5
    assert a.prefill_backlog(now) > 3_000 and b.prefill_backlog(now) == 0.0
    chosen = min((a, b), key=lambda s: (s.floor_at(now), s.worker_id))
    assert chosen.worker_id == "b"


def test_least_squares_refuses_columns_it_cannot_tell_apart() -> None:
    assert least_squares([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0]], [1.0, 2.0, 3.0]) is None
    assert least_squares([[0.0, 0.0], [1.0, 2.0]], [1.0, 2.0]) is None
    fitted = least_squares([[1.0, 1.0, 1.0], [1.0, 2.0, 4.0]], [3.0, 5.0, 9.0])
    assert fitted == pytest.approx([1.0, 2.0])


def test_workers_of_one_model_price_a_prompt_at_their_median_attention() -> None:
    # Two engines of one model whose measures put attention at 450 and 650 tokens: each books
    # its own backlog at its own estimate, but a fresh prompt costs the same on both (the
    # median, 550), so neither estimate makes its worker take every fresh prompt.
    fleet = fleet_of("a", "b", rate=15_000.0)
    a, b = fleet.get("a"), fleet.get("b")
    assert a is not None and b is not None
    for worker, attention in ((a, 450), (b, 650)):
        now = 0.0
        for i, (work, context) in enumerate(PROMPTS):
            worker.backlog.book(work, now, end_keys=[f"k{i}".encode()], context_tokens=context)
            now += 0.033 + (work + attention_positions(work, context) / attention) / 2_800
            worker.backlog.observe_stored([f"k{i}".encode()], now)
            now += 1.0
    assert a.backlog.attention_tokens == pytest.approx(450.0)
    assert b.backlog.attention_tokens == pytest.approx(650.0)
    assert a.current_load(0.0).attention_tokens == b.current_load(0.0).attention_tokens == (
        pytest.approx(550.0))
