"""The engines bench's goals for the Envoy turns (``bench/engines_report.targets``), read from a
committed case: (e) must reach (a)'s verdicts against smg ``cache_aware``, (f)'s TTFT p50 must be
within 5% of smg ``round_robin``'s, (e)'s added latency p50 at most 1 ms, its busiest bridge at
most half smg's CPU per request; and Envoy's access log read as the gateway-added signal."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from bench.engines_procs import EnginesError
from bench.engines_report import targets
from bench.engines_signals import envoy_added

CASE = Path(__file__).resolve().parent.parent / "bench" / "results" / "engines" \
    / "agent-quota-pressure.json"


def _case() -> tuple[dict[str, Any], dict[str, Any]]:
    results = json.loads(CASE.read_text())["results"]
    (case,) = results["engines"]["cases"].values()
    return results, case


def _rows(results: dict[str, Any], part: str) -> list[list[str]]:
    return [row for row in targets(results) if part in row[0]]


def _scaled(router: dict[str, Any], measure: str, factor: float) -> dict[str, Any]:
    scaled = copy.deepcopy(router)
    scaled[measure] = {k: v * factor for k, v in router[measure].items()}
    return scaled


@pytest.mark.parametrize(("factor", "said"), [(1.04, "met"), (1.06, "MISSED")])
def test_the_data_path_turn_is_held_within_5_percent_of_smg_round_robin(
    factor: float, said: str,
) -> None:
    results, case = _case()
    case["routers"]["envoy_round_robin"] = _scaled(case["routers"]["smg_round_robin"],
                                                   "ttft_p50_ms", factor)
    (row,) = _rows(results, "envoy_round_robin / smg round_robin")
    assert row[2] == f"{factor:.2f}x" and row[3] == said


def test_the_envoy_turn_must_reach_kv_awares_verdicts() -> None:
    results, case = _case()
    (row,) = _rows(results, "envoy_kv_aware verdicts")
    assert case["verdicts"] == {"cached_share": "better", "ttft_p50_ms": "better",
                                "ttft_p99_ms": "better"}
    assert row[3] == "met"
    # Its cached share as smg's: the ranges meet, the verdict is no longer kv_aware's.
    case["routers"]["envoy_kv_aware"]["cached_share"] = case["routers"]["smg_cache_aware"][
        "cached_share"]
    (row,) = _rows(results, "envoy_kv_aware verdicts")
    assert "cached_share overlap" in row[2] and row[3] == "MISSED"


def test_the_busiest_bridge_is_held_to_half_smgs_cpu_per_request() -> None:
    results, case = _case()
    (row,) = _rows(results, "busiest bridge")
    runs = case["routers"]["envoy_kv_aware"]["runs"].values()
    smg = case["routers"]["smg_cache_aware"]["router_cpu_ms_per_request"]["mean"]
    worst = max(sum(run["router_cpu_ms_per_request_by_process"][f"bridge-vllm-{i}"]
                    for run in runs) / 3 for i in range(4))
    assert row[2] == f"{worst / smg:.2f}x" and row[3] == ("met" if worst / smg <= 0.5
                                                          else "MISSED")
    for run in runs:
        run["router_cpu_ms_per_request_by_process"]["bridge-vllm-0"] = smg
    (row,) = _rows(results, "busiest bridge")
    assert row[3] == "MISSED"


@pytest.mark.parametrize(("added_ms", "said"), [(0.9, "met"), (1.1, "MISSED")])
def test_the_envoy_turns_added_latency_is_held_to_1_ms(added_ms: float, said: str) -> None:
    results, case = _case()
    case["decomposition"]["signals"]["envoy_kv_aware"]["gateway_added_p50_ms"] = added_ms
    (row,) = _rows(results, "envoy_kv_aware: gateway-added")
    assert row[3] == said


def test_envoys_access_log_gives_the_added_latency_of_a_turns_requests(tmp_path: Path) -> None:
    log = tmp_path / "access.log"
    earlier = json.dumps({"added_us": 99_000, "status": 200}) + "\n"
    log.write_text(earlier + "".join(
        json.dumps({"added_us": us, "status": 200}) + "\n" for us in (800, 1_200, 1_000)))
    added = envoy_added(log, len(earlier), 3)  # the line before the turn is not counted
    assert added == {"gateway_added_p50_ms": 1.0, "gateway_added_p99_ms": 1.2,
                     "gateway_added_mean_ms": 1.0}
    # A request that never reached an engine ("-") is not one Envoy forwarded.
    log.write_text(log.read_text() + json.dumps({"added_us": "-", "status": 503}) + "\n")
    with pytest.raises(EnginesError, match="3 requests reached an engine, of 4"):
        envoy_added(log, len(earlier), 4)
