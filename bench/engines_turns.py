"""The engines bench's turns: each router in front of the engines, fresh, for a whole replay of
the stream, and what the turn measured beside the client's figures.

- **CPU per process** (psutil, each process with its children): the gateway, the coordinator
  and each bridge for kvcoord; smg for smg.
- **Idle**: in the first repeat, before its replay, each router sits idle, up and with the
  engines reset, for ``idle_s``; its CPU then is what its timers cost a fleet doing nothing.
- **Signals** (``engines_signals``): the engines' own TTFT, queue and prefill times over the
  turn, and the gateway's added latency.

Routers take turns in ``ROUTERS`` order within a repeat, repeats one after another, so drift in
the machine's speed spreads over every router.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.engines_checks import check_index
from bench.engines_fleet import MODEL, PAGE_SIZE, Engine
from bench.engines_load import replay
from bench.engines_procs import cpu_by_process, metric_sum
from bench.engines_report import ROUTERS, summarize_turn
from bench.engines_routers import RouterRun, kvcoord_router, smg_router
from bench.engines_signals import (
    ENGINE_HISTOGRAMS,
    GATEWAY_ADDED,
    Histogram,
    access_log_size,
    envoy_added,
    scrape,
    turn_signals,
)
from bench.engines_stream import Stream
from bench.engines_trace import read_trace, trace_text
from worker.text.tokenizer import TextTokenizer

Log = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class TurnPlan:
    """What every turn of a case shares: the fleet, the paced stream, where routers run, how
    long the idle measure lasts, how many index probes, the model's files."""

    engines: tuple[Engine, ...]
    stream: Stream
    smg: Path
    model_dir: Path
    log_dir: Path
    max_model_len: int
    router_core: int | None
    client_core: int | None
    idle_s: float
    probes: int
    embedded: bool = True
    """Our coordinator in the gateway's process (else a process of its own)."""


TRACED = "kv_aware"  # the router whose decisions are traced (engines_trace)


def _open(name: str, plan: TurnPlan, tag: str) -> AbstractContextManager[RouterRun]:
    if name.startswith("smg_"):
        return smg_router(plan.smg, plan.engines, name.removeprefix("smg_"), plan.log_dir, tag,
                          core=plan.router_core)
    front = "envoy" if name.startswith("envoy_") else "gateway"
    policy = name.removeprefix("kvcoord_").removeprefix("envoy_")
    return kvcoord_router(plan.engines, plan.model_dir, plan.log_dir, plan.max_model_len, tag,
                          policy=policy, core=plan.router_core, embedded=plan.embedded,
                          decision_log=name == TRACED, front=front)


def _trace(plan: TurnPlan, tag: str) -> dict[str, Any]:
    """The decision trace of a finished turn, from its router's logs (closed by now)."""
    logs = [plan.log_dir / f"{tag}-gateway.log", plan.log_dir / f"{tag}-coordinator.log"]
    return read_trace(logs, PAGE_SIZE)


def _by_role(router: RouterRun, before: dict[str, float], after: dict[str, float]
             ) -> dict[str, float]:
    return {router.role(p): after[p.name] - before.get(p.name, 0.0) for p in router.procs}


@contextmanager
def _pinned(core: int | None) -> Iterator[None]:
    """This process (the client) on ``core`` while the block runs."""
    if core is None or not hasattr(os, "sched_setaffinity"):
        yield
        return
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, previous)


def idle_cpu(router: RouterRun, seconds: float) -> dict[str, Any]:
    """The router's CPU over ``seconds`` of doing nothing, per process and in all (ms/s)."""
    before = cpu_by_process(router.procs)
    time.sleep(seconds)
    by_role = _by_role(router, before, cpu_by_process(router.procs))
    return {"seconds": seconds,
            "cpu_ms_per_s": sum(by_role.values()) / seconds * 1000,
            "by_process_ms_per_s": {k: v / seconds * 1000 for k, v in by_role.items()}}


def engine_counters(engines: Sequence[Engine]) -> tuple[float, float]:
    """(prefix-cache queries, hits) in tokens, summed over the engines' /metrics."""
    queries = sum(metric_sum(f"{e.url}/metrics", "vllm:prefix_cache_queries_total")
                  for e in engines)
    hits = sum(metric_sum(f"{e.url}/metrics", "vllm:prefix_cache_hits_total") for e in engines)
    return queries, hits


def _histograms(router: RouterRun, engine_urls: list[str]) -> dict[str, Histogram]:
    out = scrape(engine_urls, ENGINE_HISTOGRAMS)
    if router.front == "gateway" and router.metrics_url is not None:  # our gateway
        out.update(scrape([router.metrics_url], {"added": GATEWAY_ADDED}))
    return out


def run_turn(router: RouterRun, plan: TurnPlan) -> dict[str, Any]:
    """Replay the plan's stream through ``router`` (engines reset, router up): the turn's
    summary, its CPU per process and the engines' and gateway's signals."""
    engine_urls = [f"{e.url}/metrics" for e in plan.engines]
    histograms0 = _histograms(router, engine_urls)
    queries0, hits0 = engine_counters(plan.engines)
    logged0 = access_log_size(router.access_log)
    cpu0 = cpu_by_process(router.procs)
    began = time.perf_counter()
    with _pinned(plan.client_core):
        outcomes = replay(router.url, MODEL, plan.stream.requests)
    wall = time.perf_counter() - began
    by_role = _by_role(router, cpu0, cpu_by_process(router.procs))
    queries1, hits1 = engine_counters(plan.engines)
    summary = summarize_turn(outcomes, wall, sum(by_role.values()), queries1 - queries0,
                             hits1 - hits0)
    summary["router_cpu_ms_per_request_by_process"] = {
        role: cpu / len(outcomes) * 1000 for role, cpu in by_role.items()} if outcomes else {}
    ttfts = [o.ttft_s * 1000 for o in outcomes if o.error is None and o.ttft_s is not None]
    summary["signals"] = turn_signals(histograms0, _histograms(router, engine_urls),
                                      statistics.fmean(ttfts) if ttfts else 0.0)
    if router.access_log is not None:  # Envoy's own measure, as the gateway's above
        summary["signals"].update(envoy_added(router.access_log, logged0,
                                              summary["answered"]))
    return summary


def turn_order(routers: Sequence[str], repeat: int) -> list[str]:
    """The routers' order in repeat ``repeat``: rotated by one each repeat, so that no router
    has every repeat's first turn."""
    shift = repeat % len(routers) if routers else 0
    return [*routers[shift:], *routers[:shift]]


def run_turns(plan: TurnPlan, repeats: int, tokenizer: TextTokenizer, log: Log,
              routers: Sequence[str] = ROUTERS,
              ) -> tuple[dict[str, list[dict[str, Any]]], list[dict[str, Any]],
                         dict[str, dict[str, Any]]]:
    """Every repeat of every router's turn; the index check after the first ``kv_aware`` turn
    (its probes cost a capped fleet half a minute; the decision trace compares the index's
    match with what the engines served on every turn); each router's idle CPU (first
    repeat). Repeat ``r`` starts with the ``r``-th router (``turn_order``): the case's first
    turn ran slower for whichever router had it (engines fresh from their start), and it was
    always ``kv_aware``'s."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in routers}
    index_checks: list[dict[str, Any]] = []
    idle: dict[str, dict[str, Any]] = {}
    for repeat in range(repeats):
        for name in turn_order(routers, repeat):
            with _open(name, plan, f"r{repeat}-{name}") as router:
                if repeat == 0 and plan.idle_s > 0:
                    idle[name] = idle_cpu(router, plan.idle_s)
                runs[name].append(run_turn(router, plan))
                if name == "kv_aware" and repeat == 0:  # the trace checks every turn
                    index_checks.append(check_index(router, list(plan.engines), tokenizer,
                                                    plan.stream.requests, plan.probes))
            last = runs[name][-1]
            if name == TRACED:
                last["decision_trace"] = _trace(plan, f"r{repeat}-{name}")
                log(trace_text(last["decision_trace"]))
            log(f"repeat {repeat} {name}: TTFT p50 {last['ttft_p50_ms']:.0f} ms, "
                f"p99 {last['ttft_p99_ms']:.0f} ms, cached {100 * last['cached_share']:.1f}%, "
                f"CPU {last['router_cpu_ms_per_request']:.1f} ms/req, "
                f"added {last['signals'].get('added_mean_ms') or 0:.1f} ms, "
                f"errors {last['errors']}")
    return runs, index_checks, idle
