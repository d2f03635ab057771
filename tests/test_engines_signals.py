"""bench/engines_signals.py on Prometheus text as vLLM and the gateway write it: histograms
summed over series, a turn's difference, a quantile within its bucket, and a TTFT gap taken
apart into parts that add up."""

from __future__ import annotations

import pytest

from bench.engines_signals import Histogram, decompose, histogram, turn_signals

TEXT = """\
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="m"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 3.5
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.1",model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="1.0",model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="m"} 1.0
vllm:time_to_first_token_seconds_count{engine="1",model_name="m"} 1.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="m"} 0.05
"""


def test_a_histogram_sums_its_series_and_reads_quantiles_within_buckets() -> None:
    ttft = histogram(TEXT, "vllm:time_to_first_token_seconds")
    assert (ttft.total, ttft.count) == (3.55, 5.0)
    assert ttft.buckets == ((0.1, 3.0), (1.0, 4.0), (float("inf"), 5.0))
    assert ttft.mean() == pytest.approx(0.71)
    # rank 2.5 of 5 falls in the first bucket: 0 + 0.1 * 2.5 / 3
    assert ttft.quantile(0.5) == pytest.approx(0.1 * 2.5 / 3)
    # rank 3.5: halfway through the (0.1, 1.0] bucket
    assert ttft.quantile(0.7) == pytest.approx(0.55)
    # past the last finite bound: that bound (PromQL does the same)
    assert ttft.quantile(0.99) == 1.0
    assert histogram(TEXT, "vllm:absent").mean() is None


def test_a_turn_is_the_difference_of_two_scrapes() -> None:
    before = Histogram(1.0, 2.0, ((0.1, 1.0), (float("inf"), 2.0)))
    after = Histogram(4.0, 5.0, ((0.1, 2.0), (float("inf"), 5.0)))
    delta = after.minus(before)
    assert (delta.total, delta.count, delta.buckets) == (3.0, 3.0, ((0.1, 1.0),
                                                                    (float("inf"), 3.0)))


def _signals(client: float, ttft: float, queue: float, prefill: float) -> dict[str, float]:
    empty = Histogram(0.0, 0.0, ())

    def one(mean_s: float) -> Histogram:
        return Histogram(mean_s * 10, 10.0, ((float("inf"), 10.0),))

    return turn_signals({"ttft": empty, "queue": empty, "prefill": empty},
                        {"ttft": one(ttft), "queue": one(queue), "prefill": one(prefill)},
                        client)


def test_a_gap_is_split_into_added_queue_compute_and_other_which_sum_to_it() -> None:
    ours = _signals(client=500.0, ttft=0.480, queue=0.100, prefill=0.300)
    theirs = _signals(client=400.0, ttft=0.390, queue=0.050, prefill=0.290)
    assert ours["added_mean_ms"] == pytest.approx(20.0)
    assert ours["other_mean_ms"] == pytest.approx(80.0)
    gap = decompose(ours, theirs)
    assert gap is not None
    assert gap == pytest.approx({"gap": 100.0, "added": 10.0, "queue": 50.0, "compute": 10.0,
                                 "other": 30.0})
    assert gap["added"] + gap["queue"] + gap["compute"] + gap["other"] == pytest.approx(
        gap["gap"])


def test_a_side_without_engine_figures_has_no_decomposition() -> None:
    empty = Histogram(0.0, 0.0, ())
    blind = turn_signals({"ttft": empty, "queue": empty, "prefill": empty},
                         {"ttft": empty, "queue": empty, "prefill": empty}, 300.0)
    assert "added_mean_ms" not in blind
    assert decompose(blind, _signals(400.0, 0.39, 0.05, 0.29)) is None
