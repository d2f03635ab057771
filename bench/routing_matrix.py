"""``kvcoord bench routing``: is ``kv_aware`` the best policy on every workload and host size?

One simulator run (``kvcoord.simulate.runner.simulate``: every policy, the same seeds, the same
arrivals) per cell of workloads x host memory: the Mooncake synthetic trace and each generated
family (``kvcoord.simulate.workloads``), at 0, 1x and 4x the device capacity in host memory.
In each cell ``kv_aware`` is compared with every other policy on hit ratio, TTFT p50 and TTFT
p99; a difference counts only where the seeds' min-max ranges do not overlap
(``summary.verdict``), so a tie is "no difference". A metric is *won* in a cell when ``kv_aware``
is better than every other policy on it; *at the bound* when its hit ratio and the best
other's both reach the bound the cell's memory allows (the infinite cache, or the pooled LRU
of device and host memory), where nothing can be better.

The baselines are measured in the same run: the peers' and baselines' rows come from the same
``simulate`` call as ``kv_aware``'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcoord.simulate.report import to_json
from kvcoord.simulate.runner import DEFAULT_CAPACITY_TOKENS, simulate
from kvcoord.simulate.summary import spreads, verdict
from kvcoord.simulate.workloads import WORKLOADS, generate

WORKERS = 8
HOST_MULTIPLES = (0, 1, 4)
METRICS = ("hit_ratio", "ttft_p50_ms", "ttft_p99_ms")
SYNTHETIC = Path(__file__).resolve().parents[2] / "shared" / "traces" / \
    "mooncake_synthetic_trace.jsonl"
# Within this of the bound a hit ratio is at it (rounding of page-sized cuts).
AT_BOUND = 0.001


def _cell(requests: Any, name: str, host_multiple: int, seeds: int) -> dict[str, Any]:
    report = simulate(requests, workers=WORKERS,
                      host_capacity_tokens=host_multiple * DEFAULT_CAPACITY_TOKENS,
                      seeds=seeds, trace_name=name)
    ours = spreads(report.runs["kv_aware"])
    others = {p: spreads(runs) for p, runs in report.runs.items() if p != "kv_aware"}
    bound = report.pooled_host if host_multiple else report.pooled
    verdicts: dict[str, dict[str, str]] = {}
    for metric in METRICS:
        verdicts[metric] = {p: verdict(metric, ours[metric], s[metric])
                            for p, s in others.items()}
    best_other_hit = max(s["hit_ratio"].high for s in others.values())
    at_bound = (ours["hit_ratio"].low >= bound - AT_BOUND and best_other_hit >= bound - AT_BOUND)
    full = to_json(report)
    return {
        "trace": full["trace"], "trace_sha256": full["trace_sha256"],
        "requests": full["requests"], "seeds": full["seeds"],
        "host_capacity_tokens": full["host_capacity_tokens"], "bounds": full["bounds"],
        "policies": {p: {k: v for k, v in row.items() if k.startswith(METRICS)}
                     for p, row in full["policies"].items()},
        "elapsed_s": report.elapsed_s,
        "verdicts": verdicts,
        "won": {m: all(v == "better" for v in verdicts[m].values()) for m in METRICS},
        "hit_at_bound": at_bound,
        "bound": bound,
    }


def _workloads(quick: bool) -> list[tuple[str, Any]]:
    if quick:
        return [("workload:chat", generate("chat", requests=300, seed=0))]
    cases: list[tuple[str, Any]] = []
    if SYNTHETIC.exists():
        cases.append(("mooncake_synthetic", SYNTHETIC))
    cases += [(f"workload:{name}", generate(name, seed=0)) for name in sorted(WORKLOADS)]
    return cases


def bench_routing(quick: bool = False) -> dict[str, Any]:
    """Every workload x host multiple (quick: one small chat run, no host tier, one seed)."""
    seeds = 1 if quick else 3
    hosts = (0,) if quick else HOST_MULTIPLES
    cells: dict[str, dict[str, Any]] = {}
    for name, requests in _workloads(quick):
        for host in hosts:
            cells[f"{name} host {host}x"] = _cell(requests, name, host, seeds)
    metrics_won = sum(sum(c["won"].values()) for c in cells.values())
    return {"cells": cells, "metrics": len(cells) * len(METRICS), "metrics_won": metrics_won,
            "hit_at_bound": sum(c["hit_at_bound"] and not c["won"]["hit_ratio"]
                                for c in cells.values())}


def routing_targets(results: dict[str, Any]) -> list[list[str]]:
    """One row per cell and metric: kv_aware better than every other policy, ranges apart."""
    rows = []
    for label, cell in results["routing"]["cells"].items():
        for metric in METRICS:
            verdicts = cell["verdicts"][metric]
            short = [f"{p}: {v}" for p, v in verdicts.items() if v != "better"]
            if cell["won"][metric]:
                said, ok = "met", "better than all"
            elif metric == "hit_ratio" and cell["hit_at_bound"]:
                said, ok = "at the bound", "; ".join(short)
            else:
                said, ok = "MISSED", "; ".join(short)
            rows.append([f"{label}: {metric}", "better than every policy", ok, said])
    return rows


def routing_invariants(results: dict[str, Any]) -> list[str]:
    """A hit ratio above the infinite-cache bound is a broken simulator."""
    broken = []
    for label, cell in results["routing"]["cells"].items():
        for policy, row in cell["policies"].items():
            if row["hit_ratio_max"] > cell["bounds"]["infinite"] + 1e-9:
                broken.append(f"{label}: {policy} hit {row['hit_ratio_max']:.4f} above the "
                              f"infinite bound {cell['bounds']['infinite']:.4f}")
    return broken
