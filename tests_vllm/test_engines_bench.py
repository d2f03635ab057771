"""`kvcoord bench engines --quick` as `make test-vllm` runs it: two real vLLM (CPU) engines, each
pinned to a core, with ``kvcoord gateway`` (``kv_aware``), ``smg --policy cache_aware`` and
``smg --policy round_robin`` taking turns in front of them on the committed 36-request sample.

It passes only when every router answered every streamed request with usage, the engines'
cached tokens matched the coordinator's index on every probe (bench/engines_checks.py says why
the comparison is exact), and the ``sglang_like``-vs-``smg`` comparison covered every request:
the suite's invariants, which make the command exit 1. Whether ``kv_aware`` wins is measured
and reported (targets), not asserted: a quick run of one repeat on a shared machine is no
verdict. Needs vLLM's and smg's environments (``make test-vllm`` builds both).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.engines_fleet import SMG_VAR, smg_command, vllm_python
from bench.engines_predict import prefill_costs
from kvcoord import child_process

ROOT = Path(__file__).resolve().parents[1]
# Five turns (the fifth, Envoy and the picker, since issue 39): 313 s on this stop's 2 cores,
# with four 270-280 s there (the first measure, ~2 min, was on a faster machine). The bound
# catches a hang, not a slow machine.
BENCH_TIMEOUT_S = 480


@pytest.mark.timeout(BENCH_TIMEOUT_S + 30)
def test_the_quick_engines_bench_runs_every_router_and_the_index_matches_the_engines(
    tmp_path: Path,
) -> None:
    if vllm_python() is None or smg_command() is None:
        pytest.fail(f"the engines bench needs vLLM's environment and smg ({SMG_VAR}): run "
                    "`make test-vllm`, which builds both", pytrace=False)
    out = tmp_path / "out"
    began = time.monotonic()
    done = child_process.run(
        # --allow-busy: this checks that the bench runs and what it must hold, not its figures.
        [sys.executable, "-m", "kvcoord.cli", "bench", "engines", "--quick", "--allow-busy",
         "--out", str(out)],
        cwd=ROOT, env=dict(os.environ), capture_output=True, text=True,
        timeout=BENCH_TIMEOUT_S, stdin=subprocess.DEVNULL)
    took = time.monotonic() - began
    report = f"exit {done.returncode} after {took:.0f} s\n{done.stdout}\n{done.stderr[-8000:]}"
    assert done.returncode == 0, report
    results = json.loads((out / "engines.json").read_text())
    assert results["invariants_broken"] == [], report
    engines = results["results"]["engines"]
    case = engines["cases"]["trace/shared/roomy"]
    assert list(engines["cases"]) == ["trace/shared/roomy"]
    for name in ("kv_aware", "smg_cache_aware", "smg_round_robin", "kvcoord_round_robin",
                 "envoy_kv_aware", "envoy_round_robin"):
        run = case["routers"][name]["runs"]["run0"]
        assert (run["requests"], run["answered"], run["errors"]) == (36, 36, 0), name
        assert 0 < run["cached_tokens"] < run["prompt_tokens"], name
        # The engines' own histograms saw every request of the turn, and the split adds up.
        signals = run["signals"]
        assert signals["engine_requests"] == 36, (name, signals)
        assert signals["added_mean_ms"] + signals["engine_ttft_mean_ms"] == pytest.approx(
            signals["client_ttft_mean_ms"]), name
        assert case["idle"][name]["seconds"] == 1.0, name
    # kvcoord's CPU is counted per process (the coordinator runs in the gateway's: embedded,
    # the default); smg is one.
    by_process = case["routers"]["kv_aware"]["runs"]["run0"][
        "router_cpu_ms_per_request_by_process"]
    assert sorted(by_process) == ["bridge-vllm-0", "bridge-vllm-1", "gateway"]
    assert case["coordinator"] == "embedded"
    # Turns (e) and (f): Envoy asks `kvcoord epp`, whose process runs the coordinator as the
    # gateway's does.
    for name in ("envoy_kv_aware", "envoy_round_robin"):
        assert sorted(case["routers"][name]["runs"]["run0"][
            "router_cpu_ms_per_request_by_process"]) == ["bridge-vllm-0", "bridge-vllm-1",
                                                         "envoy", "epp"]
    # The simulator, calibrated on these engines, predicted each router it stands for.
    prediction = case["prediction"]
    assert sorted(prediction["routers"]) == ["kv_aware", "smg_cache_aware", "smg_round_robin"]
    # its costs from the case's own prefill sizing (two cold lengths and one cached)
    rate, _, fixed_s = prefill_costs(case["prefill"], case["engines"]["block_tokens"])
    assert prediction["cost_model"]["request_overhead_ms"] == pytest.approx(fixed_s * 1000)
    assert prediction["cost_model"]["prefill_tokens_per_s"] == pytest.approx(rate)
    for predicted in prediction["routers"].values():
        assert predicted["predicted"]["ttft_p50_ms"] > 0 and predicted["error"]["ttft_p50_ms"]
    assert sorted(case["routers"]["smg_cache_aware"]["runs"]["run0"][
        "router_cpu_ms_per_request_by_process"]) == ["smg"]
    # Our gateway measures its own added latency, Envoy's access log (e)'s and (f)'s.
    for name in ("kv_aware", "envoy_kv_aware", "envoy_round_robin"):
        assert case["decomposition"]["signals"][name]["gateway_added_p50_ms"] > 0, name
    assert "gateway_added_p50_ms" not in case["decomposition"]["signals"]["smg_cache_aware"]
    # Through the gateway, every request names the engine it went to.
    assert sum(case["routers"]["kv_aware"]["runs"]["run0"]["by_worker"].values()) == 36
    # Every kv_aware route was traced, and joined to the engine's answer by its route id.
    trace = case["routers"]["kv_aware"]["runs"]["run0"]["decision_trace"]
    assert (trace["routes"], trace["answered"]) == (36, 36), trace
    assert trace["served_cached_tokens"] == case["routers"]["kv_aware"]["runs"]["run0"][
        "cached_tokens"], trace
    assert "decision_trace" not in case["routers"]["smg_cache_aware"]["runs"]["run0"]
    # No router served more from cache than the stream's ceiling lets any router serve.
    ceiling = engines["setup"]["streams"]["trace"]["ceiling"]
    assert ceiling["prompt_tokens"] == case["routers"]["kv_aware"]["runs"]["run0"][
        "prompt_tokens"], ceiling
    for name, measured in case["routers"].items():
        assert measured["runs"]["run0"]["cached_tokens"] <= ceiling["cached_tokens"], name
    check = case["index_checks"]["run0"]
    assert check["probes"] == 6 and check["agreed"] == 6, check
    # The picker down (the run's first case): every request served through it; once it was
    # killed, failing open every request went to the fallback engine, failing closed every
    # one was refused with 503.
    down = case["picker_down"]
    for mode in ("fail_open", "fail_close"):
        before = down[mode]["before"]
        assert before["served"] == before["requests"] == 6, (mode, before)
        assert sum(before["served_by"].values()) == 6, (mode, before)
    opened = down["fail_open"]["after"]
    assert opened["served"] == 6 and opened["served_by"] == {down["fallback"]: 6}, opened
    closed = down["fail_close"]["after"]
    assert (closed["served"], closed["refused"], closed["served_by"]) == (0, {"503": 6}, {}), \
        closed
    compared = engines["sglang_like_vs_smg"]
    assert compared["agreed"] + compared["differed"] == compared["requests"] == 24
    print(f"\nengines bench --quick: {took:.0f} s")
