"""What the engines bench reports: one turn's summary, each router's ranges over the repeats,
the verdicts of ``kv_aware`` against ``smg cache_aware``, the printed table, and the suite's
targets and invariants (bench/runner.py). Pure functions over plain values: nothing here starts
a process, so ``bench/suites.py`` imports it up front.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

from bench.engines_load import Outcome
from bench.engines_picker_down import picker_down_targets
from bench.engines_signals import PARTS, decompose
from kvcoord.tables import render_table
from kvcoord.up_report import percentile

ROUTERS = ("kv_aware", "smg_cache_aware", "smg_round_robin", "kvcoord_round_robin",
           "envoy_kv_aware", "envoy_round_robin")
"""The routers in turn order: (a) kvcoord gateway ``kv_aware``, (b) and (c) smg, (d) kvcoord
gateway ``round_robin``: the decisions of (c), so (d) less (c) is pure data-path cost; (e)
Envoy asking ``kvcoord epp``, ``kv_aware``: (a)'s decisions on a C++ data path; (f) the same
Envoy and picker deciding ``round_robin``: (f) less (c) is that data path's cost alone."""
DATA_PATH_PAIRS = (("kvcoord_round_robin", "smg_round_robin"),
                   ("envoy_round_robin", "smg_round_robin"))
"""Same decisions on both sides: what each of our data paths costs against smg's."""
ENVOY_DECIDING = "envoy_kv_aware"
"""Whose verdicts must equal ``kv_aware``'s: the same decisions through Envoy."""
MEASURES = ("ttft_p50_ms", "ttft_p99_ms", "latency_p50_ms", "latency_p99_ms", "cached_share",
            "engine_cached_share", "requests_per_s", "router_cpu_ms_per_request")
# Lower is better for these; higher for the rest.
LOWER_IS_BETTER = {"ttft_p50_ms", "ttft_p99_ms", "latency_p50_ms", "latency_p99_ms",
                   "router_cpu_ms_per_request"}
VERDICT_MEASURES = ("ttft_p50_ms", "ttft_p99_ms", "cached_share")
"""The issue's goal: kv_aware ahead of smg cache_aware on these, with ranges apart."""
PREFILL_RATIO_TARGET = 10.0
CPU_RATIO_TARGET = 2.0
ADDED_P50_TARGET_MS = 2.0
ENVOY_ADDED_P50_TARGET_MS = 1.0
BRIDGE_CPU_RATIO_TARGET = 0.5
DATA_PATH_TTFT_TARGET = 1.05
"""(f)'s TTFT p50 at most this times smg ``round_robin``'s (means over the repeats)."""


def decompositions(routers: dict[str, Any]) -> dict[str, Any]:
    """Each TTFT gap taken apart (means over the repeats, ms): every router against smg
    ``cache_aware``, and (d) against (c), the data path alone."""
    def mean_signals(name: str) -> dict[str, float]:
        runs = [run["signals"] for run in routers[name]["runs"].values()]
        keys = {k for run in runs for k, v in run.items() if isinstance(v, int | float)}
        return {k: statistics.fmean(run[k] for run in runs if run.get(k) is not None)
                for k in keys if any(run.get(k) is not None for run in runs)}

    signals = {name: mean_signals(name) for name in routers}
    out: dict[str, Any] = {"signals": signals, "gaps": {}}
    pairs = [(name, "smg_cache_aware") for name in routers if name != "smg_cache_aware"]
    pairs.extend(DATA_PATH_PAIRS)
    for ours, theirs in pairs:
        if ours in signals and theirs in signals:
            out["gaps"][f"{ours} - {theirs}"] = decompose(signals[ours], signals[theirs])
    return out


def decomposition_table(routers: dict[str, Any]) -> str:
    """Per router: client and engine mean TTFT and its parts; then each gap's parts (ms)."""
    parts = decompositions(routers)
    headers = ["router", "client TTFT", "engine TTFT", "added", "queue", "prefill", "other",
               "gateway added p50"]
    keys = ("client_ttft_mean_ms", "engine_ttft_mean_ms", "added_mean_ms", "queue_mean_ms",
            "prefill_mean_ms", "other_mean_ms", "gateway_added_p50_ms")

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:,.1f}"

    rows = [[name, *(ms(parts["signals"][name].get(k)) for k in keys)] for name in routers]
    rows += [[f"gap {pair}", ms(gap["gap"]), "", *(ms(gap[p]) for p in PARTS), ""]
             for pair, gap in parts["gaps"].items() if gap is not None]
    return "mean TTFT taken apart, ms (added = client less engine TTFT; compute = prefill)\n" \
        + render_table(headers, rows)


def cpu_table(routers: dict[str, Any], idle: dict[str, dict[str, Any]]) -> str:
    """CPU per request by process (mean over the repeats, ms), and idle CPU (ms per s)."""
    rows = []
    for name in routers:
        runs = list(routers[name]["runs"].values())
        roles = sorted({r for run in runs for r in run["router_cpu_ms_per_request_by_process"]})
        for role in roles:
            per = statistics.fmean(run["router_cpu_ms_per_request_by_process"].get(role, 0.0)
                                   for run in runs)
            idle_rate = idle.get(name, {}).get("by_process_ms_per_s", {}).get(role)
            rows.append([name, role, f"{per:.2f}",
                         "-" if idle_rate is None else f"{idle_rate:.2f}"])
    return "router CPU by process\n" + render_table(
        ["router", "process", "CPU ms / request", "idle CPU ms / s"], rows)


def summarize_turn(outcomes: Sequence[Outcome], wall_s: float, cpu_s: float,
                   engine_queries: float, engine_hits: float) -> dict[str, Any]:
    """One router's turn: client-side percentiles over the answered requests (ms), the
    engines' cached share from usage and from their own counters, throughput, and the router's
    CPU per request. ``errors`` lists what failed (the invariants fail the run on any)."""
    answered = [o for o in outcomes if o.error is None]
    ttft = [o.ttft_s * 1000 for o in answered if o.ttft_s is not None]
    latency = [o.latency_s * 1000 for o in answered if o.latency_s is not None]
    prompt = sum(o.prompt_tokens or 0 for o in answered)
    cached = sum(o.cached_tokens or 0 for o in answered)
    over = [o.index for o in answered if (o.cached_tokens or 0) > (o.prompt_tokens or 0)]
    errors = [f"request {o.index}: {o.error}" for o in outcomes if o.error is not None]
    return {
        "requests": len(outcomes), "answered": len(answered), "errors": len(errors),
        "first_errors": "; ".join(errors[:3]),
        "cached_over_prompt": len(over),
        "ttft_p50_ms": statistics.median(ttft) if ttft else 0.0,
        "ttft_p99_ms": percentile(ttft, 99),
        "latency_p50_ms": statistics.median(latency) if latency else 0.0,
        "latency_p99_ms": percentile(latency, 99),
        "prompt_tokens": prompt, "cached_tokens": cached,
        "cached_share": cached / prompt if prompt else 0.0,
        "engine_cached_share": engine_hits / engine_queries if engine_queries else 0.0,
        "requests_per_s": len(answered) / wall_s if wall_s else 0.0,
        "wall_s": wall_s,
        "router_cpu_s": cpu_s,
        "router_cpu_ms_per_request": cpu_s / len(outcomes) * 1000 if outcomes else 0.0,
        "by_worker": dict(sorted(Counter(o.worker for o in answered if o.worker).items())),
    }


def ranges(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each measure's min, max and mean over ``runs`` (a router's repeats), and the runs."""
    out: dict[str, Any] = {}
    for measure in MEASURES:
        values = [run[measure] for run in runs]
        out[measure] = {"min": min(values), "max": max(values),
                        "mean": statistics.fmean(values)}
    out["runs"] = {f"run{i}": run for i, run in enumerate(runs)}
    return out


def verdict(ours: dict[str, float], theirs: dict[str, float], lower_is_better: bool) -> str:
    """``better`` or ``worse`` only when the min-max ranges are apart; else ``overlap``."""
    if lower_is_better:
        ours, theirs = {"min": -ours["max"], "max": -ours["min"]}, \
            {"min": -theirs["max"], "max": -theirs["min"]}
    if ours["min"] > theirs["max"]:
        return "better"
    if ours["max"] < theirs["min"]:
        return "worse"
    return "overlap"


def verdicts(routers: dict[str, Any], name: str = "kv_aware") -> dict[str, str]:
    """``name`` (kv_aware by default) against smg cache_aware on the goal's measures."""
    ours, theirs = routers[name], routers["smg_cache_aware"]
    return {m: verdict(ours[m], theirs[m], m in LOWER_IS_BETTER) for m in VERDICT_MEASURES}


def _cell(value: dict[str, float], measure: str) -> str:
    def fmt(x: float) -> str:
        if "share" in measure:
            return f"{100 * x:.1f}%"
        return f"{x:,.2f}" if x < 100 else f"{x:,.0f}"
    if value["min"] == value["max"]:
        return fmt(value["mean"])
    return f"{fmt(value['mean'])} ({fmt(value['min'])}-{fmt(value['max'])})"


def table(routers: dict[str, Any]) -> str:
    """Routers as rows, each measure's mean (min-max over the repeats) as a column."""
    headers = ["router", "TTFT p50 ms", "TTFT p99 ms", "latency p50 ms", "latency p99 ms",
               "cached (usage)", "cached (engines)", "req/s", "router CPU ms/req"]
    rows = [[name, *(_cell(routers[name][m], m) for m in MEASURES)] for name in ROUTERS
            if name in routers]  # a case measured before a turn existed lacks it
    return render_table(headers, rows)


def targets(results: dict[str, Any]) -> list[list[str]]:
    """Per case: prefill sizing (>= 10x), the issue's goals per measure (met only with ranges
    apart), router CPU per request at most 2x smg cache_aware's, gateway-added p50 <= 2 ms;
    the Envoy turns' goals, and the picker-down measure's where the case has it."""
    rows = []
    for name, case in results["engines"]["cases"].items():
        ratio = case["prefill"]["ratio"]
        rows.append([f"{name}: cold / cached prefill, 2,048 tokens",
                     f">= {PREFILL_RATIO_TARGET:.0f}x", f"{ratio:.1f}x",
                     "met" if ratio >= PREFILL_RATIO_TARGET else "MISSED"])
        for measure, said in case["verdicts"].items():
            rows.append([f"{name}: kv_aware vs smg cache_aware: {measure}",
                         "better, ranges apart", said, "met" if said == "better" else "MISSED"])
        routers = case["routers"]
        theirs = routers["smg_cache_aware"]["router_cpu_ms_per_request"]["mean"]
        for ours_name in ("kv_aware", "envoy_kv_aware"):
            if ours_name not in routers:  # a case measured before the Envoy turn existed
                continue
            ours = routers[ours_name]["router_cpu_ms_per_request"]["mean"]
            times = ours / theirs if theirs else float("inf")
            rows.append([f"{name}: router CPU per request, {ours_name} / smg cache_aware",
                         f"<= {CPU_RATIO_TARGET:.0f}x", f"{times:.1f}x",
                         "met" if times <= CPU_RATIO_TARGET else "MISSED"])
        signals = case["decomposition"]["signals"]
        for ours_name, target in (("kv_aware", ADDED_P50_TARGET_MS),
                                  (ENVOY_DECIDING, ENVOY_ADDED_P50_TARGET_MS)):
            if ours_name not in signals:
                continue
            added = signals[ours_name].get("gateway_added_p50_ms")
            rows.append([f"{name}: {ours_name}: gateway-added latency p50",
                         f"<= {target:g} ms", "-" if added is None else f"{added:.2f} ms",
                         "met" if added is not None and added <= target else "MISSED"])
        rows.extend(_envoy_targets(name, case))
        if case.get("picker_down"):  # the run's first case (before it existed: none)
            rows.extend(picker_down_targets(name, case["picker_down"]))
    return rows


def _envoy_targets(name: str, case: dict[str, Any]) -> list[list[str]]:
    """(e) reaches (a)'s verdicts; (f)'s TTFT p50 within 5% of smg round_robin's; each of
    (e)'s bridges at most half smg cache_aware's CPU per request."""
    routers, rows = case["routers"], []
    if ENVOY_DECIDING in routers:
        runs = list(routers[ENVOY_DECIDING]["runs"].values())
        bridges = {role for run in runs for role in run["router_cpu_ms_per_request_by_process"]
                   if role.startswith("bridge-")}
        theirs = routers["smg_cache_aware"]["router_cpu_ms_per_request"]["mean"]
        if bridges and theirs:
            worst = max(statistics.fmean(run["router_cpu_ms_per_request_by_process"]
                                         .get(role, 0.0) for run in runs) for role in bridges)
            rows.append([f"{name}: {ENVOY_DECIDING}: busiest bridge's CPU per request / smg "
                         "cache_aware", f"<= {BRIDGE_CPU_RATIO_TARGET:g}x",
                         f"{worst / theirs:.2f}x",
                         "met" if worst / theirs <= BRIDGE_CPU_RATIO_TARGET else "MISSED"])
    if ENVOY_DECIDING in routers:
        same = verdicts(routers, ENVOY_DECIDING) == case["verdicts"]
        rows.append([f"{name}: {ENVOY_DECIDING} verdicts vs smg cache_aware",
                     "kv_aware's", ", ".join(f"{m.removesuffix('_ms')} {v}" for m, v in
                                             verdicts(routers, ENVOY_DECIDING).items()),
                     "met" if same else "MISSED"])
    if "envoy_round_robin" in routers:
        ours = routers["envoy_round_robin"]["ttft_p50_ms"]["mean"]
        theirs = routers["smg_round_robin"]["ttft_p50_ms"]["mean"]
        times = ours / theirs if theirs else float("inf")
        rows.append([f"{name}: envoy_round_robin / smg round_robin: TTFT p50",
                     f"<= {DATA_PATH_TTFT_TARGET:.2f}x", f"{times:.2f}x",
                     "met" if times <= DATA_PATH_TTFT_TARGET else "MISSED"])
    return rows


def invariants(results: dict[str, Any]) -> list[str]:
    """Every request of every turn answered with usage; no engine reported more cached tokens
    than a prompt has; the engines' cached tokens agreed with the index on every probe; the
    smg comparison ran on every request it meant to."""
    engines = results["engines"]
    broken = []
    for case_name, case in engines["cases"].items():
        for name, router in case["routers"].items():
            for run_name, run in router["runs"].items():
                if run["errors"] or run["answered"] != run["requests"]:
                    broken.append(f"{case_name} {name} {run_name}: "
                                  f"{run['requests'] - run['answered']} of {run['requests']} "
                                  f"requests failed: {run['first_errors']}")
                if run["cached_over_prompt"]:
                    broken.append(f"{case_name} {name} {run_name}: "
                                  f"{run['cached_over_prompt']} requests with more cached "
                                  "tokens than prompt tokens")
        for run_name, check in case["index_checks"].items():
            if check["disagreements"] or check["probes"] == 0:
                broken.append(f"{case_name}: index check after kv_aware {run_name}: "
                              f"{len(check['disagreements'])} of {check['probes']} probes "
                              f"disagree: {list(check['disagreements'].values())[:3]}")
    compared = engines["sglang_like_vs_smg"]
    if compared["agreed"] + compared["differed"] != compared["requests"]:
        broken.append("sglang_like vs smg: not every request was compared")
    return broken
