"""`kvcoord bench routing`: one simulator run per workload and host size, kv_aware's verdicts
against every other policy, and the targets rows that say where it is not yet the best."""

from __future__ import annotations

from typing import Any

from bench.routing_matrix import METRICS, bench_routing, routing_invariants, routing_targets


def test_the_quick_matrix_runs_every_policy_and_judges_kv_aware_against_each() -> None:
    results = bench_routing(quick=True)
    (label, cell), = results["cells"].items()
    assert label == "workload:chat host 0x"
    assert set(cell["policies"]) == {"kv_aware", "round_robin", "least_loaded", "sglang_like",
                                     "dynamo_like"}
    for metric in METRICS:
        assert set(cell["verdicts"][metric]) == set(cell["policies"]) - {"kv_aware"}
        assert cell["won"][metric] == all(v == "better" for v in cell["verdicts"][metric].values())
    assert results["metrics"] == 3
    assert results["metrics_won"] == sum(cell["won"].values())
    # The simulator can never beat an infinite cache.
    assert routing_invariants({"routing": results}) == []


def cell(won: dict[str, bool], at_bound: bool, hit_max: float = 0.3) -> dict[str, Any]:
    verdict = {m: {"sglang_like": "better" if won[m] else "no difference"} for m in METRICS}
    row = {"hit_ratio_max": hit_max}
    return {"won": won, "verdicts": verdict, "hit_at_bound": at_bound,
            "bounds": {"infinite": 0.5}, "policies": {"kv_aware": row, "sglang_like": row}}


def test_targets_say_met_at_the_bound_or_missed_and_against_whom() -> None:
    results = {"routing": {"cells": {
        "w host 0x": cell({"hit_ratio": False, "ttft_p50_ms": True, "ttft_p99_ms": False},
                          at_bound=True),
        "w host 4x": cell({"hit_ratio": False, "ttft_p50_ms": True, "ttft_p99_ms": True},
                          at_bound=False),
    }}}
    rows = routing_targets(results)
    assert [(r[0], r[2], r[3]) for r in rows] == [
        ("w host 0x: hit_ratio", "sglang_like: no difference", "at the bound"),
        ("w host 0x: ttft_p50_ms", "better than all", "met"),
        ("w host 0x: ttft_p99_ms", "sglang_like: no difference", "MISSED"),
        ("w host 4x: hit_ratio", "sglang_like: no difference", "MISSED"),
        ("w host 4x: ttft_p50_ms", "better than all", "met"),
        ("w host 4x: ttft_p99_ms", "better than all", "met"),
    ]


def test_a_hit_ratio_above_the_infinite_cache_is_a_broken_invariant() -> None:
    results = {"routing": {"cells": {"w host 0x": cell(
        {m: True for m in METRICS}, at_bound=False, hit_max=0.51)}}}
    assert routing_invariants(results) == [
        "w host 0x: kv_aware hit 0.5100 above the infinite bound 0.5000",
        "w host 0x: sglang_like hit 0.5100 above the infinite bound 0.5000",
    ]
