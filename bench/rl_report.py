"""What ``kvcoord bench rl`` reports: one arm's summary, the side-by-side table, the suite's
targets and invariants (bench/runner.py). Pure functions over plain values: nothing here starts
a process, so ``bench/suites.py`` imports it up front.

The invariants are the kvcoord arm's: every request answered, every sample reproduced by a
fresh engine of the version it names (0 wrong), no KV of old weights reused after an update
(0 stale reuse, on probes that were cached before it), every update committed by both engines,
a rollout record matching every sample. The no-barrier arm must only have run: what it gets
wrong is what the bench measures, not something that must hold.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvcoord.tables import render_table
from kvcoord.up_report import percentile

if TYPE_CHECKING:  # the suite's table loads without the fleet's modules
    from bench.rl_load import Sent
    from bench.rl_samples import Sample
    from bench.rl_updates import Probe, Update

ARMS = {"kvcoord": "kvcoord (sync update)", "no_barrier": "no barrier (reload + reset)"}


def spread_ms(seconds: Sequence[float]) -> dict[str, Any]:
    ms = [s * 1000 for s in seconds]
    return {"p50": statistics.median(ms) if ms else 0.0, "p99": percentile(ms, 99),
            "each": [round(x, 1) for x in ms]}


def by_version(samples: Iterable[Sample]) -> dict[str, int]:
    """Samples counted by the version they are attributed to, ``v0`` first."""
    counts: dict[str, int] = {}
    for sample in samples:
        counts[f"v{sample.version}"] = counts.get(f"v{sample.version}", 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: int(kv[0][1:])))


def summarize_arm(sent: Sequence[Sent], updates: Sequence[Update], probes: Sequence[Probe],
                  baseline: dict[str, Any], with_updates: dict[str, Any]) -> dict[str, Any]:
    """One arm's counts before regeneration (``bench_rl`` adds ``regeneration``)."""
    answered = [s.sample for s in sent if s.sample is not None]
    failures = [f"{s.status}: {s.error}" for s in sent if s.sample is None]
    stale = sum(1 for p in probes for cached in p.after if cached > 0)
    uncached = sum(1 for p in probes for cached in p.before if cached == 0)
    ratio = with_updates["samples_per_s"] / baseline["samples_per_s"] \
        if baseline["samples_per_s"] else 0.0
    return {
        "requests": len(sent), "samples": len(answered), "failed": len(failures),
        "first_failures": "; ".join(failures[:3]),
        "by_version": by_version(answered),
        "stale_reuse": stale, "probes": sum(len(p.after) for p in probes),
        "probes_not_cached_before": uncached,
        "probe_cached_tokens": {f"v{p.version}": {"before": list(p.before),
                                                  "after": list(p.after)} for p in probes},
        "updates": len(updates),
        "pause_ms": spread_ms([u.took_s for u in updates]),
        "bridge_pause_ms": spread_ms([p for u in updates for p in u.bridge_pause_s]),
        "update_problems": [p for u in updates for p in u.problems],
        "throughput": {"without_updates": baseline, "with_updates": with_updates,
                       "ratio": ratio},
    }


def _fmt_ms(spread: dict[str, Any]) -> str:
    return f"{spread['p50']:,.0f} / {spread['p99']:,.0f}" if spread["each"] else "-"


def _cells(arm: dict[str, Any]) -> list[str]:
    regen = arm["regeneration"]
    rollouts = arm.get("rollouts")
    put = arm["throughput"]
    return [
        f"{arm['samples']:,}",
        f"{arm['failed']:,}",
        f"{regen['wrong']:,} of {regen['checked']:,}",
        f"{regen['made_by_next_version']:,}",
        f"{regen['mixed']:,}",
        f"{arm['stale_reuse']} of {arm['probes']}",
        f"{arm['updates']}",
        _fmt_ms(arm["pause_ms"]),
        _fmt_ms(arm["bridge_pause_ms"]),
        f"{put['without_updates']['samples_per_s']:.1f}",
        f"{put['with_updates']['samples_per_s']:.1f}",
        f"{put['ratio']:.2f}x",
        f"{put['without_updates']['latency_p99_ms']:,.0f} / "
        f"{put['with_updates']['latency_p99_ms']:,.0f}",
        "-" if rollouts is None else f"{rollouts['matched']:,} of {rollouts['samples']:,}",
    ]


ROWS = ("samples attributed (200 answers)", "failed requests", "wrong samples (regenerated)",
        "  made wholly by the next version", "  mixed (partly old weights)",
        "stale reuse (probe after each update)", "updates",
        "update: trainer waits p50 / p99, ms", "gate closed at the bridges p50 / p99, ms",
        "samples/s without updates", "samples/s with updates", "with / without",
        "latency p99 without / with, ms", "rollout records matching")


def table(results: dict[str, Any]) -> str:
    """The arms side by side, one measure a row, every value right-aligned."""
    arms = results["arms"]
    columns = []
    for name, title in ARMS.items():
        cells = _cells(arms[name])
        width = max(len(title), *(len(c) for c in cells))
        columns.append([c.rjust(width) for c in cells])
    rows = [[what, *(column[i] for column in columns)] for i, what in enumerate(ROWS)]
    return render_table(["measure", *ARMS.values()], rows)


def targets(results: dict[str, Any]) -> list[list[str]]:
    """No bar is set: the pauses, the cost of updates in throughput and what the practice gets
    wrong are reported."""
    arms = results["rl"]["arms"]
    ours, theirs = arms["kvcoord"], arms["no_barrier"]
    wrong = theirs["regeneration"]
    return [
        ["kvcoord update pause p50 / p99 (trainer)", "(reported)",
         f"{_fmt_ms(ours['pause_ms'])} ms", "-"],
        ["kvcoord throughput with updates / without", "(reported)",
         f"{ours['throughput']['ratio']:.2f}x", "-"],
        ["no-barrier throughput with updates / without", "(reported)",
         f"{theirs['throughput']['ratio']:.2f}x", "-"],
        ["no-barrier samples wrong", "(reported)",
         f"{wrong['wrong']} of {wrong['checked']}", "-"],
    ]


def invariants(results: dict[str, Any]) -> list[str]:
    """Module docstring."""
    rl = results["rl"]
    ours, theirs = rl["arms"]["kvcoord"], rl["arms"]["no_barrier"]
    updates = rl["setup"]["updates"]
    broken = []
    if ours["failed"]:
        broken.append(f"kvcoord: {ours['failed']} of {ours['requests']} requests failed: "
                      f"{ours['first_failures']}")
    if ours["regeneration"]["wrong"]:
        broken.append(f"kvcoord: {ours['regeneration']['wrong']} samples not reproduced by "
                      f"their version's weights: {ours['wrong_examples']}")
    if ours["stale_reuse"]:
        broken.append(f"kvcoord: {ours['stale_reuse']} probes reused KV across an update: "
                      f"{ours['probe_cached_tokens']}")
    if ours["probes_not_cached_before"] or ours["probes"] != 2 * updates:
        broken.append(f"kvcoord: stale-reuse probes not measured ({ours['probes']} after "
                      f"{updates} updates, {ours['probes_not_cached_before']} not cached before)")
    if ours["update_problems"] or ours["updates"] != updates:
        broken.append(f"kvcoord: {ours['updates']} of {updates} updates; "
                      f"{ours['update_problems']}")
    if set(ours["by_version"]) != {f"v{v}" for v in range(updates + 1)}:
        broken.append(f"kvcoord: samples by version {ours['by_version']}, not every version "
                      f"0..{updates}")
    rollouts = ours["rollouts"]
    if rollouts["missing"] or rollouts["mismatched"]:
        broken.append(f"kvcoord: rollout records: {rollouts['missing']} missing, "
                      f"{rollouts['mismatched']} naming another worker, version or length")
    if theirs["samples"] == 0 or theirs["updates"] != updates:
        broken.append(f"no_barrier: did not run ({theirs['samples']} samples, "
                      f"{theirs['updates']} of {updates} updates)")
    return broken
