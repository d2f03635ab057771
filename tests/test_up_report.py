"""``kvcoord up``'s report from recorded passes (no processes): TTFT per policy and per kind
beside the prefill saved, and a verdict that says which way each went and whether the two
passes sent the same prompts."""

from __future__ import annotations

import re

from kvcoord.demo_workload import PassResult, RequestRecord, WorkloadSpec
from kvcoord.up_report import different_prompts, render_report, ttft_ms, verdict

WORKERS = ["w0", "w1"]


def record(kind: str, worker: str, cached: int, ttft_ms: float, key: int) -> RequestRecord:
    computed = 100 - cached if cached < 100 else 1
    return RequestRecord(kind, worker, 100, cached, computed, ttft_ms / 1000,
                         ttft_ms / 1000 + 0.05, 0, key)


def passes() -> tuple[PassResult, PassResult]:
    kv = PassResult("kv_aware", [
        record("chat", "w0", 0, 200.0, 1), record("chat", "w0", 80, 40.0, 2),
        record("chat", "w1", 96, 30.0, 3), record("grpo", "w1", 96, 20.0, 4),
    ], wall_s=3.0, grpo_s=1.25)
    rr = PassResult("round_robin", [
        record("chat", "w0", 0, 210.0, 1), record("chat", "w1", 0, 190.0, 2),
        record("chat", "w0", 96, 35.0, 3), record("grpo", "w1", 0, 180.0, 4),
    ], wall_s=3.5, grpo_s=1.0)
    return kv, rr


def cells(report: str, label: str) -> list[str]:
    line = next(line for line in report.splitlines() if line.startswith(label + "  "))
    return re.split(r"\s{2,}", line[len(label):].strip())


def test_ttft_rows_sit_beside_the_prefill_rows_for_each_policy() -> None:
    kv, rr = passes()
    report = render_report(WorkloadSpec(), WORKERS, [kv, rr], "fresh fleets.")
    assert cells(report, "prefill computed") == ["128", "304"]
    assert cells(report, "TTFT p50 (ms)") == ["30.0", "180.0"]  # nearest rank: 2nd of 4
    assert cells(report, "TTFT p99 (ms)") == ["200.0", "210.0"]
    assert cells(report, "  chat turns p50 / p99") == ["40 / 200", "190 / 210"]
    assert cells(report, "  GRPO samples p50 / p99") == ["20 / 20", "180 / 180"]
    assert cells(report, "latency p50 (ms)") == ["80.0", "230.0"]
    assert cells(report, "GRPO rounds (s)") == ["1.2", "1.0"]
    assert report.splitlines()[-1] == (
        "kv_aware computed 176 fewer prefill tokens than round_robin (58% less) on the same "
        "requests; its TTFT was p50 30 against 180 ms, p99 200 against 210 ms.")


def test_the_verdict_says_when_the_headline_policy_lost_and_when_prompts_differed() -> None:
    kv, rr = passes()
    assert ttft_ms(kv, 50, "chat") == 40.0
    assert different_prompts(kv, rr) == 0
    rr.records[0] = record("chat", "w0", 0, 210.0, 99)  # another prompt in place of key 1
    assert different_prompts(kv, rr) == different_prompts(rr, kv) == 1
    assert verdict(rr, kv) == (
        "round_robin computed 176 more prefill tokens than kv_aware (138% more) on requests "
        "of which 1 differed (a greedy reply came out otherwise); its TTFT was p50 180 "
        "against 30 ms, p99 210 against 200 ms.")
