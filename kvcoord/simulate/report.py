"""What ``kvcoord simulate`` prints and writes: the table, the JSON contract, the PNG plot.

JSON (ARCHITECTURE §0 "simulate --json", binding): ``{"trace", "workers", "capacity_tokens",
"bounds": {"infinite", "pooled"}, "policies": {NAME: {"hit_ratio", "prefill_tokens",
"cached_tokens", "ttft_p50_ms", "ttft_p99_ms", "load_imbalance"}}}``; each of those
per-policy values is now the **mean over the seeds** (token counts rounded to integers), and
beside each sits ``<field>_min`` and ``<field>_max`` over the seeds. Added per policy (with its
``_min``/``_max``): ``host_hit_ratio``, the part of ``hit_ratio`` copied back from host memory.
Added in ``bounds``: ``pooled_host``, one LRU over every worker's device and host capacity
(equal to ``pooled`` without a host tier). Added beside the contract's top-level keys:
``host_capacity_tokens`` (per worker; 0 = no host tier), ``requests``, ``page_size``,
``seeds`` (the list run), ``arrival_jitter_ms``, and ``differences``: for each policy other
than ``kv_aware``, per compared field, ``kv_aware``'s verdict against it ("better", "worse",
"no difference": see ``summary``). ``trace`` stays a string, as the contract has it: the
trace's file name, never a path; its content is ``trace_sha256`` beside it.
:func:`write_json` adds ``kvcoord.provenance``'s ``commit`` and ``dirty`` (not its ``trace``
object, which would change the contract's key). matplotlib is optional
(``pip install 'kvcoord[plot]'``) and imported only by :func:`write_plot`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcoord.provenance import provenance
from kvcoord.simulate.engine import PolicyRun
from kvcoord.simulate.summary import FIELDS, Spread, spreads, verdict
from kvcoord.tables import render_table

BASELINE = "kv_aware"  # the production router: every other policy is compared with it
COMPARED = ("hit_ratio", "ttft_p50_ms", "ttft_p99_ms", "load_imbalance")
_INTEGER_FIELDS = frozenset({"prefill_tokens", "cached_tokens"})


@dataclass(frozen=True, slots=True)
class SimulationReport:
    """Everything one ``simulate`` call produced. ``runs[policy]`` holds one run per seed, in
    ``seeds`` order."""

    trace: str
    trace_sha256: str
    workers: int
    capacity_tokens: int
    host_capacity_tokens: int
    page_size: int
    requests: int
    seeds: tuple[int, ...]
    arrival_jitter_ms: float
    infinite: float
    pooled: float
    pooled_host: float
    runs: Mapping[str, Sequence[PolicyRun]]
    elapsed_s: float = 0.0


def differences(report: SimulationReport) -> dict[str, dict[str, str]]:
    """``kv_aware``'s verdict against each other policy on each compared field; empty when
    ``kv_aware`` was not run."""
    if BASELINE not in report.runs:
        return {}
    ours = spreads(report.runs[BASELINE])
    out = {}
    for name, runs in report.runs.items():
        if name != BASELINE:
            theirs = spreads(runs)
            out[name] = {f: verdict(f, ours[f], theirs[f]) for f in COMPARED}
    return out


def _policy_json(spread: Mapping[str, Spread]) -> dict[str, float | int]:
    out: dict[str, float | int] = {}
    for name in FIELDS:  # the contract's keys first, as means
        s = spread[name]
        out[name] = round(s.mean) if name in _INTEGER_FIELDS else s.mean
    for name in FIELDS:
        s = spread[name]
        low, high = (int(s.low), int(s.high)) if name in _INTEGER_FIELDS else (s.low, s.high)
        out[f"{name}_min"], out[f"{name}_max"] = low, high
    return out


def to_json(report: SimulationReport) -> dict[str, Any]:
    """The contract's object, with the added keys the module docstring lists."""
    return {
        "trace": Path(report.trace).name,
        "trace_sha256": report.trace_sha256,
        "workers": report.workers,
        "capacity_tokens": report.capacity_tokens,
        "host_capacity_tokens": report.host_capacity_tokens,
        "requests": report.requests,
        "page_size": report.page_size,
        "seeds": list(report.seeds),
        "arrival_jitter_ms": report.arrival_jitter_ms,
        "bounds": {"infinite": report.infinite, "pooled": report.pooled,
                   "pooled_host": report.pooled_host},
        "policies": {name: _policy_json(spreads(runs)) for name, runs in report.runs.items()},
        "differences": differences(report),
    }


def write_json(report: SimulationReport, path: str | Path) -> None:
    """:func:`to_json` plus the provenance every result file carries (commit, dirty tree)."""
    source = provenance()
    out = {**to_json(report), "commit": source["commit"], "dirty": source["dirty"]}
    Path(path).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")


def _cell(s: Spread, fmt: str) -> str:
    return f"{s.mean:{fmt}} ({s.low:{fmt}}-{s.high:{fmt}})"


def render(report: SimulationReport) -> str:
    """The terminal report: a header, the bounds, one row per policy (mean and min-max over
    the seeds), then ``kv_aware`` against each other policy."""
    seeds = ", ".join(map(str, report.seeds))
    host = report.host_capacity_tokens
    header = (
        f"trace {report.trace}: {report.requests} requests, {report.workers} workers x "
        f"{report.capacity_tokens:,} KV tokens"
        + (f" + {host:,} in host memory" if host else "")
        + f", page {report.page_size} tokens, seeds {seeds} "
        f"(arrivals jittered by up to {report.arrival_jitter_ms:g} ms; "
        f"{report.elapsed_s:.1f}s)\n"
        f"bounds: infinite cache {report.infinite:.1%}, pooled LRU "
        f"({report.workers} x capacity) {report.pooled:.1%}"
        + (f", pooled LRU with host ({report.workers} x (capacity + host)) "
           f"{report.pooled_host:.1%}" if host else "")
        + "\neach cell: mean over the seeds (min-max)"
    )
    bound = report.pooled_host if host else report.pooled
    rows = []
    for name, runs in report.runs.items():
        s = spreads(runs)
        hit, host_hit = s["hit_ratio"], s["host_hit_ratio"]
        of_pooled = f"{hit.mean / bound:.2f}x" if bound > 0 else "-"
        rows.append([
            name, _cell(Spread(hit.mean * 100, hit.low * 100, hit.high * 100), ".1f"),
            _cell(Spread(host_hit.mean * 100, host_hit.low * 100, host_hit.high * 100), ".1f"),
            of_pooled, f"{s['prefill_tokens'].mean:.0f}", _cell(s["ttft_p50_ms"], ".0f"),
            _cell(s["ttft_p99_ms"], ".0f"), _cell(s["load_imbalance"], ".2f"),
        ])
    table = render_table(
        ["policy", "hit %", "host hit %", "of pooled_host" if host else "of pooled",
         "prefill tokens", "TTFT p50 ms", "TTFT p99 ms", "imbalance"], rows,
    )
    out = f"{header}\n\n{table}"
    verdicts = differences(report)
    if verdicts:
        compare = render_table(
            [f"{BASELINE} vs", "hit", "TTFT p50", "TTFT p99", "imbalance"],
            [[name, *v.values()] for name, v in verdicts.items()],
        )
        out += (f"\n\n{BASELINE} against each policy: a difference counts only where the "
                f"seeds' min-max ranges do not overlap\n{compare}")
    return out


def write_plot(report: SimulationReport, path: str | Path) -> None:
    """A PNG of the first seed's runs: TTFT CDF per policy (left) and computed prefill tokens
    per worker (right). ValueError (with the install hint) when matplotlib is not installed.
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
    for k, (name, runs) in enumerate(report.runs.items()):
        run = runs[0]
        ttft = sorted(t * 1000.0 for t in run.ttft_s)
        n = len(ttft)
        cdf.plot(ttft, [(i + 1) / n for i in range(n)], label=name)
        offset = (k - (len(report.runs) - 1) / 2) * width
        xs = [w + offset for w in range(len(run.worker_prefill_tokens))]
        bars.bar(xs, [t / 1e6 for t in run.worker_prefill_tokens], width, label=name)
    cdf.set_xscale("symlog", linthresh=10.0)
    cdf.set_xlabel("TTFT (ms)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title(f"TTFT CDF (seed {report.seeds[0]})")
    cdf.grid(True, alpha=0.3)
    cdf.legend()
    bars.set_xlabel("worker")
    bars.set_ylabel("computed prefill tokens (millions)")
    bars.set_title(f"per-worker load (seed {report.seeds[0]})")
    bars.legend(fontsize="small")
    host = (f" + {report.host_capacity_tokens:,} host" if report.host_capacity_tokens else "")
    fig.suptitle(f"{Path(report.trace).name}: {report.workers} workers x "
                 f"{report.capacity_tokens:,} tokens{host}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
