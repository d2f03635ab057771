"""`kvcoord simulate`: trace replay through the production index and router (fast: a slice)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvcoord import child_process
from kvcoord.simulate.engine import ROUTERS
from kvcoord.simulate.report import SimulationReport, to_json
from kvcoord.simulate.runner import simulate
from kvcoord.simulate.summary import percentile
from kvcoord.simulate.trace import TraceError, block_tokens, load_trace, prompt_bytes

TRACE = Path(__file__).parent / "data" / "mooncake_300.jsonl"
CONTRACT_KEYS = ("hit_ratio", "prefill_tokens", "cached_tokens", "ttft_p50_ms", "ttft_p99_ms",
                 "load_imbalance")
ADDED_KEYS = ("host_hit_ratio",)  # beside the contract's, never in place of one
POLICY_KEYS = {*CONTRACT_KEYS, *ADDED_KEYS, *(f"{k}_min" for k in CONTRACT_KEYS + ADDED_KEYS),
               *(f"{k}_max" for k in CONTRACT_KEYS + ADDED_KEYS)}


@pytest.fixture(scope="module")
def report() -> SimulationReport:
    return simulate(TRACE, workers=4, capacity_tokens=200_000, seed=7)


def test_the_same_slice_and_seed_give_identical_numbers_twice(report: SimulationReport) -> None:
    again = simulate(TRACE, workers=4, capacity_tokens=200_000, seed=7)
    assert to_json(again) == to_json(report)
    assert again.runs == report.runs  # per request and per worker too, not only summaries


def test_json_has_the_contract_shape_with_the_seed_keys_beside_it(
    report: SimulationReport,
) -> None:
    out = json.loads(json.dumps(to_json(report)))
    assert set(out) == {"trace", "trace_sha256", "workers", "capacity_tokens", "bounds",
                        "policies", "requests", "page_size", "seeds", "arrival_jitter_ms",
                        "differences", "host_capacity_tokens"}
    assert (out["workers"], out["capacity_tokens"], out["host_capacity_tokens"]) == (
        4, 200_000, 0)
    # The contract's string, a name and never a path; the content beside it.
    assert out["trace"] == "mooncake_300.jsonl"
    assert out["trace_sha256"] == hashlib.sha256(TRACE.read_bytes()).hexdigest()
    assert (out["seeds"], out["arrival_jitter_ms"], out["requests"]) == ([7, 8, 9], 250.0, 300)
    assert set(out["bounds"]) == {"infinite", "pooled", "pooled_host"}
    assert out["bounds"]["pooled_host"] == out["bounds"]["pooled"]  # no host tier
    assert list(out["policies"]) == list(ROUTERS)
    assert {"round_robin", "least_loaded", "kv_aware", "sglang_like", "dynamo_like"} <= set(
        out["policies"])
    for numbers in out["policies"].values():
        assert set(numbers) == POLICY_KEYS
        assert isinstance(numbers["prefill_tokens"], int)
        assert isinstance(numbers["cached_tokens"], int)
        total = numbers["prefill_tokens"] + numbers["cached_tokens"]
        # Means over seeds: the token counts are rounded to integers, half a token at most.
        assert numbers["hit_ratio"] == pytest.approx(numbers["cached_tokens"] / total,
                                                     rel=0, abs=0.5 / total)
        assert numbers["load_imbalance"] >= 1.0
        assert 0 <= numbers["ttft_p50_ms"] <= numbers["ttft_p99_ms"]
        assert numbers["host_hit_ratio"] == 0.0  # no host tier, no host hit
        for key in CONTRACT_KEYS + ADDED_KEYS:  # the keys are the means over the seeds
            assert numbers[f"{key}_min"] <= numbers[key] <= numbers[f"{key}_max"], key


def test_every_policy_serves_the_same_prompt_tokens(report: SimulationReport) -> None:
    requests = load_trace(TRACE)
    total = sum(r.input_length for r in requests)
    for numbers in to_json(report)["policies"].values():
        assert numbers["prefill_tokens"] + numbers["cached_tokens"] == total


def test_bounds_are_ordered(report: SimulationReport) -> None:
    assert 0 < report.pooled <= report.infinite <= 1
    for name, numbers in to_json(report)["policies"].items():
        assert numbers["hit_ratio"] <= report.infinite, name


def test_kv_aware_beats_round_robin_at_tiny_capacity() -> None:
    tiny = simulate(TRACE, workers=4, capacity_tokens=50_000, policies=["round_robin",
                                                                        "kv_aware"], seeds=1)
    policies = to_json(tiny)["policies"]
    assert policies["round_robin"]["hit_ratio"] < policies["kv_aware"]["hit_ratio"]


def test_a_single_worker_fleet_is_its_own_pool() -> None:
    # One worker, nothing else competing for its cache: routing cannot matter.
    one = simulate(TRACE, workers=1, capacity_tokens=100_000, limit=120,
                   policies=["round_robin", "kv_aware"], seeds=2)
    policies = to_json(one)["policies"]
    assert policies["round_robin"] == policies["kv_aware"]
    assert policies["kv_aware"]["load_imbalance"] == 1.0


def test_equal_hash_ids_expand_to_equal_tokens_and_the_last_block_is_cut() -> None:
    assert block_tokens(7) == block_tokens(7) != block_tokens(8)
    assert len(block_tokens(7)) == 512 * 4
    first = load_trace(TRACE, limit=1)[0]
    data = prompt_bytes(first)
    assert len(data) == first.input_length * 4
    assert data[: 512 * 4] == block_tokens(first.hash_ids[0])


def test_percentile_is_nearest_rank() -> None:
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0], 0.5) == 3.0
    assert percentile(list(map(float, range(1, 101))), 0.99) == 99.0
    assert percentile([], 0.5) == 0.0


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not valid JSON"),
        ('{"timestamp": 1, "input_length": 10, "output_length": 1}', "missing field(s) hash_ids"),
        ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}',
         "timestamp must be"),
        ('{"timestamp": 1, "input_length": 600, "output_length": 1, "hash_ids": [1]}',
         "does not fit 1 block(s)"),
        ('{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}',
         "hash_ids must be"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_a_malformed_line_is_refused_with_its_line_number(
    tmp_path: Path, line: str, message: str
) -> None:
    trace = tmp_path / "bad.jsonl"
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}'
    trace.write_text(f"{good}\n{line}\n")
    with pytest.raises(TraceError, match=r"bad\.jsonl:2: ") as caught:
        load_trace(trace)
    assert message in str(caught.value)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return child_process.run(
        [sys.executable, "-m", "kvcoord.cli", "simulate", *args], capture_output=True,
        text=True, timeout=60, stdin=subprocess.DEVNULL,
    )


def test_cli_prints_the_table_and_writes_the_json(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    result = run_cli("--trace", str(TRACE), "--workers", "4", "--json", str(out), "--limit", "100")
    assert result.returncode == 0, result.stderr
    assert "kv_aware" in result.stdout and "infinite cache" in result.stdout
    assert "seeds 0, 1, 2" in result.stdout  # three seeds by default
    assert "ranges do not overlap" in result.stdout
    written = json.loads(out.read_text())
    assert written["workers"] == 4 and written["capacity_tokens"] == 500_000
    assert written["seeds"] == [0, 1, 2]
    assert written["trace"] == "mooncake_300.jsonl"
    assert {"commit", "dirty"} <= set(written)  # the provenance every result file carries
    assert set(written["policies"]) == set(ROUTERS)
    assert "100%" in result.stderr  # the progress bar, on stderr only


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trace", "/nonexistent/trace.jsonl", "--workers", "2"], "trace file not found"),
        (["--trace", str(TRACE), "--workers", "0"], "--workers must be >= 1"),
        (["--trace", str(TRACE), "--workers", "2", "--policy", "magic"],
         "unknown policy 'magic'"),
        (["--trace", str(TRACE), "--workers", "2", "--capacity-tokens", "3"],
         "--capacity-tokens must hold"),
        (["--trace", str(TRACE), "--workers", "2", "--limit", "0"], "--limit must be >= 1"),
        (["--trace", str(TRACE), "--workers", "2", "--seeds", "0"], "--seeds must be >= 1"),
        (["--trace", str(TRACE), "--workers", "2", "--jitter-ms", "-1"],
         "--jitter-ms must be >= 0"),
        (["--trace", str(TRACE), "--workers", "2", "--host-capacity-tokens", "-512"],
         "--host-capacity-tokens must be a whole number of tokens >= 0"),
        (["--trace", str(TRACE), "--workers", "2", "--host-capacity-tokens", "1.5e6"],
         "--host-capacity-tokens must be a whole number of tokens >= 0"),
        (["--trace", str(TRACE), "--workers", "2", "--host-capacity-tokens", "100"],
         "--host-capacity-tokens must be 0 or hold at least one page of 512"),
    ],
)
def test_cli_refuses_bad_input_with_a_clear_message(args: list[str], message: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1  # one line, no usage block


def test_cli_names_the_malformed_line(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, '
                     '"hash_ids": [1]}\n{"timestamp": 5}\n')
    result = run_cli("--trace", str(trace), "--workers", "2")
    assert result.returncode == 2
    assert "t.jsonl:2: missing field(s)" in result.stderr


def test_plot_writes_a_png(tmp_path: Path, report: SimulationReport) -> None:
    pytest.importorskip("matplotlib")
    from kvcoord.simulate.report import write_plot

    png = tmp_path / "sim.png"
    write_plot(report, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
