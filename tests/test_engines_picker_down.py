"""The engines bench's picker-down measure, read back: what one half of requests got, and the
goals, met on a measure that holds them and missed on each planted fault (a request lost while
the picker was up, failing open to the wrong engine, failing closed with another status or
only after a wait). The measure itself runs on real engines in tests_vllm/test_engines_bench.py.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from bench.engines_load import Outcome
from bench.engines_picker_down import (
    REFUSAL_FAST_MS,
    half_summary,
    picker_down_targets,
    picker_down_text,
)


def _served(index: int, ttft_s: float) -> Outcome:
    return Outcome(index, 0.0, ttft_s, ttft_s + 0.5, 900, 0, None)


def _refused(index: int, status: int | None, latency_s: float) -> Outcome:
    return Outcome(index, 0.0, None, latency_s, error="APIStatusError: refused", status=status)


def test_a_half_counts_served_and_refused_requests_and_who_served() -> None:
    got = half_summary([_served(0, 0.2), _served(1, 0.4), _served(4, 0.3),
                        _refused(2, 503, 0.003), _refused(3, None, 0.009)],
                       ["vllm-0", "vllm-0", "vllm-0"])
    assert (got["requests"], got["served"]) == (5, 3)
    assert got["refused"] == {"503": 1, "none": 1}
    assert got["served_by"] == {"vllm-0": 3}
    assert got["served_ttft_p50_ms"] == pytest.approx(300.0)
    assert got["refused_max_ms"] == pytest.approx(9.0)
    assert len(got["first_errors"]) == 2
    nothing_refused = half_summary([_served(0, 0.2)], ["vllm-1"])
    assert nothing_refused["refused"] == {} and nothing_refused["refused_p50_ms"] is None


def _half(served: int, refused: dict[str, int], by: dict[str, int],
          refused_max_ms: float | None = None) -> dict[str, Any]:
    return {"requests": 6, "served": served, "refused": refused, "served_by": by,
            "served_ttft_p50_ms": 300.0 if served else None,
            "refused_p50_ms": refused_max_ms, "refused_max_ms": refused_max_ms,
            "first_errors": []}


def _measure() -> dict[str, Any]:
    return {"requests_per_half": 6, "fallback": "vllm-0",
            "fail_open": {"before": _half(6, {}, {"vllm-0": 3, "vllm-1": 3}),
                          "after": _half(6, {}, {"vllm-0": 6})},
            "fail_close": {"before": _half(6, {}, {"vllm-0": 2, "vllm-1": 4}),
                           "after": _half(0, {"503": 6}, {}, refused_max_ms=4.0)}}


def _verdicts(measured: dict[str, Any]) -> list[str]:
    return [row[3] for row in picker_down_targets("trace/quota/pressure", measured)]


def test_a_picker_down_measure_that_holds_meets_every_goal() -> None:
    assert _verdicts(_measure()) == ["met"] * 4
    text = picker_down_text(_measure())
    assert "fail_close  after        0 6x 503" in text and "vllm-0 6" in text


@pytest.mark.parametrize("fault", [
    "lost while up", "opened to another engine", "opened and failed", "closed with 500",
    "closed after a wait", "closed and served"])
def test_each_planted_fault_misses_its_goal(fault: str) -> None:
    measured = copy.deepcopy(_measure())
    opened, closed = measured["fail_open"]["after"], measured["fail_close"]["after"]
    if fault == "lost while up":
        measured["fail_close"]["before"] = _half(5, {"503": 1}, {"vllm-1": 5})
    elif fault == "opened to another engine":
        opened["served_by"] = {"vllm-0": 5, "vllm-1": 1}
    elif fault == "opened and failed":
        measured["fail_open"]["after"] = _half(4, {"503": 2}, {"vllm-0": 4})
    elif fault == "closed with 500":
        closed["refused"] = {"503": 5, "500": 1}
    elif fault == "closed after a wait":
        closed["refused_max_ms"] = REFUSAL_FAST_MS + 1
    else:
        measured["fail_close"]["after"] = _half(6, {}, {"vllm-0": 6})
    assert "MISSED" in _verdicts(measured), fault
