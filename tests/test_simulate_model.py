"""`kvcoord simulate`'s world: decode slows prefill, each router sees load as its real system
does (late), seeds jitter arrivals, and a difference counts only where ranges do not overlap.
Numbers are worked by hand in the comments."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.core.hashing import HashConfig, Namespace, PageHasher
from coordinator.core.index import PageEvent, PagesStored
from coordinator.core.tier_costs import TierCosts
from kvcoord.simulate import engine, views
from kvcoord.simulate.arrivals import ARRIVAL_JITTER_MS, jittered_arrivals
from kvcoord.simulate.cost_model import CostModel
from kvcoord.simulate.runner import DEFAULT_SEEDS, simulate
from kvcoord.simulate.simworker import Job, SimWorker
from kvcoord.simulate.summary import Spread, verdict
from kvcoord.simulate.trace import TraceRequest, load_trace
from worker.sync import sync_client

TRACE = Path(__file__).parent / "data" / "mooncake_300.jsonl"


def request(index: int, input_length: int, output_length: int) -> TraceRequest:
    return TraceRequest(index, 0.0, input_length, output_length, ())


def page_keys(name: str, n: int) -> list[bytes]:
    return [f"{name}{i:015d}".encode() for i in range(n)]


# ---- the cost model -----------------------------------------------------------------------

def test_prefill_slows_with_the_decode_tokens_batched_beside_it() -> None:
    cost = CostModel()
    assert cost.prefill_rate(0, 0) == 15_000.0  # nothing decoding: the full rate
    # Two sequences of 17,000 context tokens in total decode: each step of 8,192 prefill
    # tokens also carries 2 decode tokens costing 2 x 1 + 17,000 / 1,700 = 12 prefill tokens,
    # so prefill gets 8,192 / 8,204 of the GPU: 15,000 x 8,192 / 8,204 = 14,978.06 tokens/s.
    assert cost.prefill_rate(2, 17_000) == pytest.approx(14_978.06, abs=0.01)
    # 100 decodes of 15k-token contexts (the trace's mean prompt): 100 x (1 + 15,000 / 1,700)
    # = 982.35 -> 15,000 x 8,192 / 9,174.35 = 13,393.8 tokens/s, 11% slower.
    assert cost.prefill_rate(100, 1_500_000) == pytest.approx(13_393.8, abs=0.1)
    assert cost.decode_context(1000, 101) == 1050  # prompt + half the output


def test_a_decode_ending_mid_prefill_speeds_up_the_rest_of_it() -> None:
    # Round numbers: 100 prefill tokens/s, steps of 2 prefill tokens, and a decode context of
    # 41 tokens costing 1 + 41 / 41 = 2 prefill tokens: one decode halves the prefill rate.
    cost = CostModel(prefill_tokens_per_s=100, decode_s_per_token=0.2, step_prefill_tokens=2,
                     kv_read_tokens=41)
    ns = Namespace(model="t", page_size=16)
    events: list[tuple[str, PageEvent]] = []
    worker = SimWorker("w0", 100, hasher=PageHasher(HashConfig(b"k" * 32, page_size=16)),
                       namespace=ns, cost=cost, publish=lambda w, e: events.append((w, e)))
    a = Job(request(0, 40, 2), page_keys("a", 2), 0.0)  # context 40 + 2 // 2 = 41
    worker.enqueue(a)
    assert worker.start_next(0.0) is a
    assert a.prefill_end_s == pytest.approx(0.4)  # 40 tokens at 100/s, nothing decoding
    worker.finish_prefill(a)
    assert events == [("w0", PagesStored(page_keys("a", 2)))]  # Stored, for the index
    b = Job(request(1, 60, 1), page_keys("b", 3), 0.4)
    worker.enqueue(b)
    assert worker.start_next(0.4) is b
    # a decodes beside b: 100 x 2 / (2 + 2) = 50 tokens/s -> b would end at 0.4 + 60/50 = 1.6.
    assert b.prefill_end_s == pytest.approx(1.6)
    generation = b.prefill_gen
    # a's 2 tokens take 0.4 s: it ends at 0.8, when b has done 0.4 x 50 = 20 tokens. The 40
    # left run at the full 100/s: b now ends at 0.8 + 0.4 = 1.2, under a new generation.
    assert worker.finish_decode(a, 0.8) is b
    assert b.prefill_end_s == pytest.approx(1.2)
    assert b.prefill_gen == generation + 1
    assert worker.heartbeat()[1] == 1  # one completion to report


# ---- what the routers see, and when -------------------------------------------------------

def test_heartbeats_come_every_period_or_just_after_the_first_completion() -> None:
    clock = views.HeartbeatClock(1)
    assert clock.sent(0, 0.0) == pytest.approx(2.02)  # 2 s period, then the 20 ms pause
    assert clock.completed(0, 0.5) == pytest.approx(0.52)  # a completion brings it forward
    assert clock.completed(0, 0.51) is None  # later ones ride on the same beat
    assert clock.sent(0, 0.52) == pytest.approx(2.54)
    assert clock.completed(0, 2.53) is None  # the period's beat (2.54) comes first anyway


def test_the_simulator_uses_the_production_defaults() -> None:
    config = CoordinatorConfig()
    assert config.heartbeat_ms == views.HEARTBEAT_S * 1000
    assert config.pending_ttl_ms == engine.PENDING_TTL_S * 1000
    assert config.max_inflight_per_worker == views.MAX_INFLIGHT
    assert views.COMPLETION_COALESCE_S == sync_client.BEAT_COALESCE_S


def write_trace(path: Path, rows: list[tuple[float, int, int, list[int]]]) -> Path:
    path.write_text("".join(
        json.dumps({"timestamp": t, "input_length": n, "output_length": out, "hash_ids": ids})
        + "\n" for t, n, out, ids in rows
    ))
    return path


@pytest.mark.parametrize("second_at_ms", [40.0, 100.0, 150.0])
def test_kv_aware_sends_a_repeat_to_its_holder_by_its_backlog_not_by_heartbeats(
    tmp_path: Path, second_at_ms: float
) -> None:
    # Two workers, one 1024-token prompt (2 pages of 512) asked twice, no jitter.
    # The first prefills in 1024 / 15,000 s = 68.3 ms on worker X, decodes 1 token (20 ms) and
    # finishes at 88.3 ms; X's heartbeat saying so reaches the coordinator at 118.3 ms.
    # At 40 ms X's backlog is 1024 - 0.04 * 15,000 = 424 tokens and its 2 pages are pending:
    # cost 424 + 8 (the route in flight) = 432 against 1024 + 1024 copied on the idle worker.
    # At 100 ms, before any heartbeat, the backlog has drained: 8 against 2048. At 150 ms the
    # heartbeat came: 0 against 2048. Every time the repeat waits for or finds X's pages.
    trace = write_trace(tmp_path / "t.jsonl", [(0, 1024, 1, [1, 2]),
                                               (second_at_ms, 1024, 1, [1, 2])])
    report = simulate(trace, workers=2, policies=["kv_aware"], seeds=1, arrival_jitter_ms=0)
    run = report.runs["kv_aware"][0]
    assert run.cached_tokens == (0, 1024)
    assert run.worker_prefill_tokens in ((1024, 0), (0, 1024))


def test_kv_aware_sends_an_unrelated_prompt_away_from_a_backlog(tmp_path: Path) -> None:
    # A 6,144-token prompt starts on X at 0 and prefills until 409.6 ms. An unrelated 1,024-token
    # prompt at 100 ms finds X with 6,144 - 1,500 = 4,644 tokens of backlog (+ 8 in flight)
    # and Y with none: it goes to Y, and both prefill at once.
    trace = write_trace(tmp_path / "t.jsonl", [(0, 6144, 1, list(range(12))),
                                               (100, 1024, 1, [100, 101])])
    report = simulate(trace, workers=2, policies=["kv_aware"], seeds=1, arrival_jitter_ms=0)
    run = report.runs["kv_aware"][0]
    assert sorted(run.worker_prefill_tokens) == [1024, 6144]
    assert run.ttft_s[1] == pytest.approx(1024 / 15_000)


def test_dynamo_like_sees_stored_pages_only_after_the_sync_delay(tmp_path: Path) -> None:
    # One 1024-token prompt prefilled on worker X by 68.3 ms, decoding for 2 s after. Its
    # Stored event reaches the indexer at 78.3 ms. A repeat then scores X: prefill 0 blocks +
    # decode 2 = 2 against 2 + 2 = 4: X, a cache hit, under every seed. At 73 ms X's pages are
    # not indexed yet: both score 4, the indexer's trees tie (empty), and the seed decides.
    def hits(second_at_ms: float) -> list[int]:
        trace = write_trace(tmp_path / f"{second_at_ms}.jsonl", [
            (0, 1024, 100, [1, 2]), (second_at_ms, 1024, 1, [1, 2])])
        report = simulate(trace, workers=2, policies=["dynamo_like"], seeds=8,
                          arrival_jitter_ms=0)
        return [run.cached_tokens[1] for run in report.runs["dynamo_like"]]

    assert hits(90.0) == [1024] * 8
    early = hits(73.0)
    assert 0 in early and 1024 in early


# ---- seeds --------------------------------------------------------------------------------

def test_a_seed_jitters_every_arrival_by_at_most_the_jitter() -> None:
    requests = load_trace(TRACE)
    first = jittered_arrivals(requests, seed=0)
    assert first == jittered_arrivals(requests, seed=0)  # deterministic
    assert first != jittered_arrivals(requests, seed=1)
    assert sorted(i for _, i in first) == list(range(len(requests)))
    assert [t for t, _ in first] == sorted(t for t, _ in first)  # in arrival order
    for arrival_s, i in first:
        delay_ms = arrival_s * 1000 - requests[i].timestamp_ms
        assert 0 <= delay_ms < ARRIVAL_JITTER_MS
    # Jitter 0: the trace's own times and order.
    assert jittered_arrivals(requests, seed=5, jitter_ms=0) == [
        (r.timestamp_ms / 1000, r.index) for r in requests]


def test_seeds_change_the_outcome_not_only_the_tie_breaks() -> None:
    report = simulate(TRACE, workers=4, capacity_tokens=200_000, policies=["round_robin"],
                      seeds=2, limit=150)
    first, second = report.runs["round_robin"]
    # round_robin breaks no ties: only the arrivals differ between the seeds.
    assert (first.seed, second.seed) == (0, 1)
    assert first.ttft_s != second.ttft_s


def test_a_difference_counts_only_where_the_ranges_do_not_overlap() -> None:
    low, high = Spread(2.0, 1.0, 3.0), Spread(5.0, 4.0, 6.0)
    touching = Spread(4.0, 3.0, 5.0)  # shares the value 3.0 with `low`
    assert verdict("ttft_p99_ms", low, high) == "better"  # lower latency
    assert verdict("ttft_p99_ms", high, low) == "worse"
    assert verdict("hit_ratio", high, low) == "better"  # higher hit ratio
    assert verdict("hit_ratio", low, high) == "worse"
    assert verdict("ttft_p99_ms", low, touching) == "no difference"
    assert verdict("hit_ratio", touching, low) == "no difference"


def test_the_cli_defaults_are_the_documented_ones() -> None:
    import argparse

    from kvcoord.simulate.cli import add_simulate_parser

    parser = argparse.ArgumentParser()
    add_simulate_parser(parser.add_subparsers())
    args = parser.parse_args(["simulate", "--trace", "t", "--workers", "2"])
    assert (args.seeds, args.jitter_ms, args.seed) == (DEFAULT_SEEDS, ARRIVAL_JITTER_MS, 0)
    assert args.host_capacity_tokens == "0"  # no host tier unless asked (parsed by the command)
    defaults = {f.name: f.default for f in dataclasses.fields(CostModel) if f.name != "tiers"}
    assert defaults == {"prefill_tokens_per_s": 15_000.0, "decode_s_per_token": 0.02,
                        "step_prefill_tokens": 8192, "kv_read_tokens": 1700,
                        "request_overhead_s": 0.0, "attention_tokens": math.inf}
    # The copy back costs what the router's constants say, and its prefill rate is ours.
    assert CostModel().tiers == TierCosts()
    assert TierCosts().prefill_tokens_per_s == CostModel().prefill_tokens_per_s
