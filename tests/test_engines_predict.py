"""The simulator calibrated on the engines bench's own measures (bench/engines_predict.py): a
fixed cost per request in the cost model, the calibration's arithmetic, and a prediction over a
real stream that says, per router, what it predicted beside what was measured."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench.bench_engines import QUICK_TRACE
from bench.engines_model import ModelShape, write_model
from bench.engines_predict import (
    calibrated_cost,
    predict,
    prediction_table,
    prefill_costs,
    sim_requests,
)
from bench.engines_stream import StreamShape, build_stream
from coordinator.core.hashing import HashConfig, Namespace, PageHasher
from kvcoord.simulate.cost_model import CostModel
from kvcoord.simulate.simworker import Job, SimWorker
from kvcoord.simulate.trace import TraceRequest

PREFILL = {"prompt_tokens": 2048, "cold_ms": 652.0, "cached_ms": 43.0}


def _router(ttft_p50: float, ttft_p99: float, latency_p50: float) -> dict[str, dict[str, float]]:
    return {"ttft_p50_ms": {"mean": ttft_p50}, "ttft_p99_ms": {"mean": ttft_p99},
            "latency_p50_ms": {"mean": latency_p50}, "cached_share": {"mean": 0.6}}


ROUTERS = {"kv_aware": _router(76, 2854, 159), "smg_cache_aware": _router(63, 2552, 140),
           "smg_round_robin": _router(471, 3568, 560)}


def started_alone(cost: CostModel, prompt_tokens: int) -> Job:
    """A prompt of ``prompt_tokens`` uncached tokens started at 0 on an idle simulated worker
    with room for it (16-token pages)."""
    pages = -(-prompt_tokens // 16)
    worker = SimWorker("w0", pages + 8, hasher=PageHasher(HashConfig(b"k" * 32, page_size=16)),
                       namespace=Namespace(model="t", page_size=16), cost=cost,
                       publish=lambda w, e: None)
    job = Job(TraceRequest(0, 0.0, prompt_tokens, 1, ()),
              [b"%015d" % i for i in range(pages)], 0.0)
    worker.enqueue(job)
    assert worker.start_next(0.0) is job
    return job


def test_a_fixed_cost_per_request_is_paid_even_with_nothing_to_compute() -> None:
    cost = CostModel(prefill_tokens_per_s=1000, request_overhead_s=0.04)
    assert cost.overhead_tokens() == pytest.approx(40)
    job = started_alone(cost, 100)
    assert job.prefill_end_s == pytest.approx(0.04 + 100 / 1000)
    with pytest.raises(ValueError, match="request_overhead_s"):
        CostModel(request_overhead_s=-1)


def test_the_calibration_takes_each_constant_from_the_run() -> None:
    cost = calibrated_cost(PREFILL, ROUTERS, scale=8, engine_block=32, step_tokens=2048,
                           answer_tokens=8)
    # (2,048 - 32) tokens in (652 - 43) ms: 3,310 engine tokens/s, 8 simulated tokens each.
    assert cost.prefill_tokens_per_s == pytest.approx(8 * 2016 / 0.609)
    assert cost.request_overhead_s == pytest.approx(0.043)
    # The median of (latency - TTFT) at p50 over the routers (77, 83, 89 ms), over 7 tokens.
    assert cost.decode_s_per_token == pytest.approx(0.083 / 7)
    assert cost.step_prefill_tokens == 8 * 2048


def test_attention_makes_a_later_position_cost_more() -> None:
    flat = CostModel(prefill_tokens_per_s=1000)
    assert flat.prefill_work(0, 2048) == 2048 and flat.prefill_work(2016, 2048) == 32
    cost = CostModel(prefill_tokens_per_s=1000, attention_tokens=1024)
    # positions 0..2048: 2,048 tokens plus 2,048^2 / 2,048 = 2,048 of attention
    assert cost.prefill_work(0, 2048) == pytest.approx(4096)
    # the last block reads the whole prompt: 32 x (1 + ~2,032 / 1,024)
    assert cost.prefill_work(2016, 2048) == pytest.approx(32 + (2048**2 - 2016**2) / 2048)
    job = started_alone(cost, 2048)
    assert job.prefill_end_s == pytest.approx(4096 / 1000)
    with pytest.raises(ValueError, match="must be > 0"):
        CostModel(attention_tokens=0)


def test_two_cold_lengths_give_the_rate_the_attention_and_the_fixed_cost() -> None:
    # Engines made by the rule itself: rate 2,000 tokens/s, attention at 1,500, 30 ms fixed.
    truth = CostModel(prefill_tokens_per_s=2000, attention_tokens=1500)

    def ms(cached: int, prompt: int) -> float:
        return 1000 * (0.030 + truth.prefill_work(cached, prompt) / 2000)

    measured = {"prompt_tokens": 2048, "cold_ms": ms(0, 2048), "cached_ms": ms(2016, 2048),
                "short_prompt_tokens": 512, "short_cold_ms": ms(0, 512)}
    rate, attention, fixed = prefill_costs(measured, 32)
    assert (rate, attention, fixed) == pytest.approx((2000, 1500, 0.030))
    # Without the short measure (older results), or where it says attention is free or
    # negative (noise), the rule is as first made: linear, the cached time as the fixed cost.
    assert prefill_costs(PREFILL, 32) == pytest.approx((2016 / 0.609, math.inf, 0.043))
    linear = {**PREFILL, "short_prompt_tokens": 512, "short_cold_ms": 43 + 480 / 2016 * 609}
    assert prefill_costs(linear, 32)[1] == math.inf
    cost = calibrated_cost(measured, ROUTERS, scale=8, engine_block=32, step_tokens=2048,
                           answer_tokens=8)
    assert (cost.prefill_tokens_per_s, cost.attention_tokens) == pytest.approx((16000, 12000))


def test_a_prediction_over_a_real_stream_sets_each_router_beside_its_measure(
    tmp_path: Path,
) -> None:
    tokenizer = write_model(tmp_path / "model", ModelShape())
    stream = build_stream(QUICK_TRACE, StreamShape(requests=36), tokenizer, 4096).scaled(0.05)
    requests, scale = sim_requests(stream, 64)
    assert scale == 8 and len(requests) == 36
    assert all(r.input_length <= len(r.hash_ids) * 512 for r in requests)
    result = predict(stream, engines=2, kv_tokens=12_672, engine_block=32, block_tokens=64,
                     prefill=PREFILL, routers=ROUTERS, step_tokens=2048, answer_tokens=8)
    assert set(result["routers"]) == set(ROUTERS)
    kv, rr = result["routers"]["kv_aware"], result["routers"]["smg_round_robin"]
    assert kv["predicted"]["cached_share"] > rr["predicted"]["cached_share"]
    # No TTFT is below the fixed cost; each error is predicted / measured - 1.
    assert kv["predicted"]["ttft_p50_ms"] >= 43.0
    assert kv["error"]["ttft_p99_ms"] == pytest.approx(
        kv["predicted"]["ttft_p99_ms"] / 2854 - 1)
    rows = prediction_table(result)
    assert [r[:2] for r in rows] == [["kv_aware", "kv_aware"],
                                     ["smg_cache_aware", "sglang_like"],
                                     ["smg_round_robin", "round_robin"]]
    again = predict(stream, engines=2, kv_tokens=12_672, engine_block=32, block_tokens=64,
                    prefill=PREFILL, routers=ROUTERS, step_tokens=2048, answer_tokens=8)
    assert again == result  # deterministic: no clock, no jitter
