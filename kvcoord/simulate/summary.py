"""One policy's numbers: per seed, then over seeds (mean and min-max), and when two policies
differ.

Per seed (a :class:`PolicySummary`, the contract's per-policy fields, then the added ones):
hit_ratio = cached prompt tokens (device or host tier) / all prompt tokens, prefill_tokens =
prompt tokens computed (not served from either tier), ttft_p50_ms / ttft_p99_ms nearest-rank
percentiles, load_imbalance = the busiest worker's computed prefill tokens / the mean over
workers; added: host_hit_ratio = the prompt tokens copied back from a host tier / all prompt
tokens (a part of hit_ratio; 0 without a host tier).

Over seeds (a :class:`Spread` per field): the mean, the lowest and the highest. **A difference
counts only where the ranges do not overlap**: policy A is better than B on a field when A's
whole min-max range lies on the better side of B's; otherwise :func:`verdict` says
"no difference".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

from kvcoord.simulate.engine import PolicyRun

# Fields where a higher value is better; for the others (times, imbalance, computed tokens)
# lower is better.
HIGHER_IS_BETTER = frozenset({"hit_ratio", "cached_tokens"})


@dataclass(frozen=True, slots=True)
class PolicySummary:
    """One policy's numbers under one seed: the contract's per-policy fields, in its order,
    then the fields added since (never renamed)."""

    hit_ratio: float
    prefill_tokens: int
    cached_tokens: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    load_imbalance: float
    host_hit_ratio: float


FIELDS = tuple(f.name for f in fields(PolicySummary))


@dataclass(frozen=True, slots=True)
class Spread:
    """A field over seeds: its mean, lowest and highest value."""

    mean: float
    low: float
    high: float

    def overlaps(self, other: Spread) -> bool:
        return self.low <= other.high and other.low <= self.high


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
        host_hit_ratio=sum(run.host_tokens) / prompt if prompt else 0.0,
    )


def spreads(runs: Sequence[PolicyRun]) -> dict[str, Spread]:
    """Every field of :class:`PolicySummary` over ``runs`` (one per seed; at least one)."""
    if not runs:
        raise ValueError("no run to summarize")
    summaries = [summarize(run) for run in runs]
    out = {}
    for name in FIELDS:
        values = [float(getattr(s, name)) for s in summaries]
        out[name] = Spread(sum(values) / len(values), min(values), max(values))
    return out


def verdict(field: str, ours: Spread, theirs: Spread) -> str:
    """``"better"`` or ``"worse"`` for ``ours`` against ``theirs`` on ``field`` when their
    ranges do not overlap, else ``"no difference"``."""
    if ours.overlaps(theirs):
        return "no difference"
    ours_higher = ours.low > theirs.high
    return "better" if ours_higher == (field in HIGHER_IS_BETTER) else "worse"
