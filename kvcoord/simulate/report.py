"""What ``kvcoord simulate`` prints and writes: the table, the JSON contract, the PNG plot.

JSON (DESIGN.md "simulate --json", binding): ``{"trace", "workers", "capacity_tokens",
"bounds": {"infinite", "pooled"}, "policies": {NAME: {"hit_ratio", "prefill_tokens",
"cached_tokens", "ttft_p50_ms", "ttft_p99_ms", "load_imbalance"}}}`` where hit_ratio = cached
prompt tokens / all prompt tokens, prefill_tokens = prompt tokens computed (not served from
cache), load_imbalance = the busiest worker's computed prefill tokens / the mean over workers.
Percentiles are nearest-rank. matplotlib is optional (``pip install 'kvcoord[plot]'``) and
imported only by :func:`write_plot`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvcoord.simulate.engine import PolicyRun
from kvcoord.tables import render_table


@dataclass(frozen=True, slots=True)
class PolicySummary:
    """One policy's numbers, exactly the contract's per-policy fields."""

    hit_ratio: float
    prefill_tokens: int
    cached_tokens: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    load_imbalance: float


@dataclass(frozen=True, slots=True)
class SimulationReport:
    """Everything one ``simulate`` call produced (``page_size``, ``requests``, ``seed`` and
    ``elapsed_s`` are shown in the table, not written to the JSON contract)."""

    trace: str
    workers: int
    capacity_tokens: int
    page_size: int
    requests: int
    seed: int
    infinite: float
    pooled: float
    runs: Mapping[str, PolicyRun]
    elapsed_s: float = 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank ``q``-quantile (0 < q <= 1) of ``values``; 0.0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summarize(run: PolicyRun) -> PolicySummary:
    prompt, cached = sum(run.prompt_tokens), sum(run.cached_tokens)
    loads = run.worker_prefill_tokens
    mean = sum(loads) / len(loads) if loads else 0.0
    return PolicySummary(
        hit_ratio=cached / prompt if prompt else 0.0,
        prefill_tokens=prompt - cached,
        cached_tokens=cached,
        ttft_p50_ms=percentile(run.ttft_s, 0.50) * 1000.0,
        ttft_p99_ms=percentile(run.ttft_s, 0.99) * 1000.0,
        load_imbalance=max(loads) / mean if mean > 0 else 1.0,
    )


def to_json(report: SimulationReport) -> dict[str, Any]:
    """The contract's object (nothing more, nothing less)."""
    return {
        "trace": report.trace,
        "workers": report.workers,
        "capacity_tokens": report.capacity_tokens,
        "bounds": {"infinite": report.infinite, "pooled": report.pooled},
        "policies": {name: asdict(summarize(run)) for name, run in report.runs.items()},
    }


def write_json(report: SimulationReport, path: str | Path) -> None:
    Path(path).write_text(json.dumps(to_json(report), indent=2) + "\n", encoding="utf-8")


def render(report: SimulationReport) -> str:
    """The terminal report: a header, the bounds, one row per policy."""
    header = (
        f"trace {report.trace}: {report.requests} requests, {report.workers} workers x "
        f"{report.capacity_tokens:,} KV tokens, page {report.page_size} tokens, seed "
        f"{report.seed} ({report.elapsed_s:.1f}s)\n"
        f"bounds: infinite cache {report.infinite:.1%}, pooled LRU "
        f"({report.workers} x capacity) {report.pooled:.1%}"
    )
    rows = []
    for name, run in report.runs.items():
        s = summarize(run)
        of_pooled = f"{s.hit_ratio / report.pooled:.2f}x" if report.pooled > 0 else "-"
        rows.append([
            name, f"{s.hit_ratio:.1%}", of_pooled, f"{s.prefill_tokens}", f"{s.cached_tokens}",
            f"{s.ttft_p50_ms:.0f}", f"{s.ttft_p99_ms:.0f}", f"{s.load_imbalance:.2f}",
        ])
    table = render_table(
        ["policy", "hit", "of pooled", "prefill tokens", "cached tokens", "TTFT p50 ms",
         "TTFT p99 ms", "imbalance"], rows,
    )
    return f"{header}\n\n{table}"


def write_plot(report: SimulationReport, path: str | Path) -> None:
    """A PNG: TTFT CDF per policy (left) and computed prefill tokens per worker (right).

    ValueError (with the install hint) when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: never needs a display
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib: pip install 'kvcoord[plot]' (or pip install matplotlib)"
        ) from None
    fig, (cdf, bars) = plt.subplots(1, 2, figsize=(13, 5))
    width = 0.8 / max(1, len(report.runs))
    for k, (name, run) in enumerate(report.runs.items()):
        ttft = sorted(t * 1000.0 for t in run.ttft_s)
        n = len(ttft)
        cdf.plot(ttft, [(i + 1) / n for i in range(n)], label=name)
        offset = (k - (len(report.runs) - 1) / 2) * width
        xs = [w + offset for w in range(len(run.worker_prefill_tokens))]
        bars.bar(xs, [t / 1e6 for t in run.worker_prefill_tokens], width, label=name)
    cdf.set_xscale("symlog", linthresh=10.0)
    cdf.set_xlabel("TTFT (ms)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("TTFT CDF")
    cdf.grid(True, alpha=0.3)
    cdf.legend()
    bars.set_xlabel("worker")
    bars.set_ylabel("computed prefill tokens (millions)")
    bars.set_title("per-worker load")
    bars.legend(fontsize="small")
    fig.suptitle(f"{Path(report.trace).name}: {report.workers} workers x "
                 f"{report.capacity_tokens:,} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
