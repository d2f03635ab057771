"""``make chaos``: faults injected, round after round, into the multi-host cluster of
``tests/multihost_cluster.py`` (Redis on ``db``, coordinator replicas ``c1`` and ``c2``, workers
``w1``..``w3``, each in its own network namespace), and what the issue asks of each measured.
Prints a table, each figure beside its target with a verdict, and writes
``bench/results/chaos.json``: the definitions, every round and every raw sample. Needs root.

The faults and the rounds are ``bench/chaos_faults.py``; the thread that routes and looks up on
every replica all along is ``bench/chaos_watch.py``. After the fault rounds, a scripted worker on
c1 sends page events at a steady rate and c2's replication lag is read. ``DEFINITIONS`` (also in
the JSON) says exactly what each figure is. Exit status 1 when a target is missed.

Run alone: ``python -m bench.chaos [--rounds N]`` from the repository root, as root.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc

from bench.chaos_faults import FAULTS, Chaos, Round, run_round, schedule
from bench.chaos_watch import (
    LOOKUP_EVERY_S,
    ROUTE_EVERY_S,
    STALE_SLACK_S,
    Watch,
    at_stake,
    disagreements,
    stale_routes,
)
from coordinator.client import KvcoordError
from coordinator.hashing import DEV_HASH_KEY, HashConfig
from coordinator.logs import configure_logging
from coordinator.v1 import coordinator_pb2 as pb
from kvcoord.scripted_worker import ScriptedWorker
from kvcoord.tables import render_table
from tests.multihost_cluster import (
    LAG_BOUND_S,
    LEASE_S,
    PAGE,
    REPLICAS,
    Cluster,
    running_cluster,
)

OUT = Path(__file__).resolve().parent / "results" / "chaos.json"
LAG_RATE = 250  # page-event batches per second, from one scripted worker on c1
LAG_KEYS = 4  # pages per batch
LAG_SECONDS = 18.0  # at LAG_RATE, more events than c2's lag window (4096) holds
LAG_WINDOW = 4096  # coordinator.replication._LAG_SAMPLES: the quantiles' window
LAG_TARGET_MS = LEASE_S * 1000 / 10  # remote leases are renewed by events: stay far below one

DEFINITIONS = {
    "recovery_s": (
        "seconds from the end of the fault (the killed worker restarted, the link healed, "
        "Redis restarted, the killed replica started again; for kill_replica the kill itself, "
        "since the survivor must take over unaided) to the first moment the fleet is whole: "
        "on every serving replica all three workers READY at the current policy version and "
        "attached to a serving replica, and Lookup of every probe prompt answering the "
        "holdings noted before the fault (less a killed worker's pages, which died with it; "
        "none after a policy update, whose new version no page was computed under). Every "
        "replica answering those same holdings means they agree, too."),
    "stale_routes": (
        f"routes (round robin, each serving replica every {ROUTE_EVERY_S:g} s) naming a worker "
        f"that was killed, cut off or partitioned more than its lease + {STALE_SLACK_S:g} s "
        "(replication lag and scheduling slack) before the route was sent, and not yet "
        "restarted or healed; 'at stake': every route answered while some worker was in that "
        "state (0 at stake: the fault left no worker to route to wrongly)"),
    "lost_rollouts": (
        "rollout records read back before the fault (the round's own generations included) "
        "missing or changed when read back after recovery; 'checked': those records, summed "
        "over the rounds"),
    "disagreements": (
        f"episodes in which the serving replicas' Lookups of the probe prompts (sampled every "
        f"{LOOKUP_EVERY_S:g} s) differed for longer than the lag bound, {LAG_BOUND_S:g} s, "
        "outside a Redis outage (when replicas cannot hear each other)"),
    "lag_p99_ms": (
        "replication_lag_p99_ms (publish on c1 to apply on c2, wall clocks of one machine) "
        "from c2's GetStats after a scripted worker on c1 sent page-event batches at a steady "
        f"rate for long enough that c2's quantile window (its last {LAG_WINDOW} applied "
        "events) holds that load only"),
}


# ---------------------------------------------------------------------- sustained lag


async def sustained_lag(cluster: Cluster, rate: int, seconds: float) -> dict[str, Any]:
    """A scripted worker registers on c1 and sends ``rate`` batches/s of ``LAG_KEYS`` fresh
    pages for ``seconds``; c2's replication stats are sampled every second."""
    probe = ScriptedWorker(cluster.target("c1"), "lag-probe",
                           hash_config=HashConfig(DEV_HASH_KEY, page_size=PAGE))
    await probe.start()
    observer = cluster.client("c2")
    tasks: list[asyncio.Task[None]] = []

    async def acks() -> None:
        while True:
            await probe.next_message(timeout=3600)

    try:
        tasks = [asyncio.create_task(acks())]
        first = await asyncio.to_thread(observer.stats)
        loop = asyncio.get_running_loop()
        start, sent, samples, next_sample, next_beat = loop.time(), 0, [], 1.0, 0.0
        # One writer: grpc.aio refuses a second write while one is in flight.
        while (elapsed := loop.time() - start) < seconds:
            if elapsed >= next_beat:
                next_beat += 0.3  # the cluster's heartbeat period: the probe's lease holds
                await probe.heartbeat()
            while sent < int(elapsed * rate) + 1:
                keys = b"".join(os.urandom(16) for _ in range(LAG_KEYS))
                await probe.send_events([pb.PageEvent(kind=pb.PageEvent.KIND_STORED,
                                                      page_keys=keys, tier=pb.TIER_GPU)])
                sent += 1
            if elapsed >= next_sample:
                next_sample += 1.0
                stats = await asyncio.to_thread(observer.stats)
                samples.append({"t_s": round(elapsed, 2), "applied": stats.replication_applied,
                                "lag_p50_ms": stats.replication_lag_p50_ms,
                                "lag_p99_ms": stats.replication_lag_p99_ms})
            await asyncio.sleep(1 / rate)
        took = loop.time() - start
        await asyncio.sleep(0.5)  # the last batches applied
        last = await asyncio.to_thread(observer.stats)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await probe.close()
        observer.close()
    applied = last.replication_applied - first.replication_applied
    return {
        "rate_batches_per_s": rate, "pages_per_batch": LAG_KEYS, "seconds": seconds,
        "sent_batches": sent, "sent_per_s": sent / took, "applied_on_c2": applied,
        "window_holds_only_this_load": applied >= LAG_WINDOW,
        "lag_p50_ms": last.replication_lag_p50_ms, "lag_p99_ms": last.replication_lag_p99_ms,
        "lag_p99_ms_before": first.replication_lag_p99_ms, "samples": samples,
    }


# ---------------------------------------------------------------------- report


def summarize(rounds: list[Round], watch: Watch, began: float) -> dict[str, dict[str, Any]]:
    """Per fault kind, the figures of the table and the samples behind them (times in seconds
    since the run began)."""
    out: dict[str, dict[str, Any]] = {}
    for kind, fault in FAULTS.items():
        mine = [r for r in rounds if r.kind == kind]
        if not mine:
            continue
        recovery = [s for r in mine if (s := r.recovery_s) is not None]
        stale = [s for r in mine for s in stale_routes(watch.routes, watch.down, r.began, r.ended)]
        episodes = [e for r in mine for e in disagreements(watch.lookups, watch.no_replication,
                                                          r.began, r.ended, LAG_BOUND_S)]
        out[kind] = {
            "label": fault.label, "rounds": len(mine),
            "recovered": len(recovery), "errors": [r.error for r in mine if r.error],
            "recovery_s_p50": statistics.median(recovery) if recovery else None,
            "recovery_s_max": max(recovery) if recovery else None,
            "recovery_target_s": fault.recovery_target_s, "recovery_target_why": fault.why,
            "stale_routes": len(stale),
            "routes_at_stake": sum(len(at_stake(watch.routes, watch.down, r.began, r.ended))
                                   for r in mine),
            "stale_route_samples": [{**asdict(s), "sent": round(s.sent - began, 3)}
                                    for s in stale],
            "lost_rollouts": sum(len(r.rollouts_lost) for r in mine),
            "checked_rollouts": sum(r.rollouts_checked for r in mine),
            "disagreements": len(episodes),
            "disagreement_episodes": [{**asdict(e), "since": round(e.since - began, 3)}
                                      for e in episodes],
            "route_errors": sum(1 for s in watch.routes if s.worker_id is None
                                and any(r.began <= s.sent < r.ended for r in mine)),
        }
    return out


def _round_json(rnd: Round, began: float) -> dict[str, Any]:
    """The round with its times in seconds since the run began."""
    out = {**asdict(rnd), "recovery_s": rnd.recovery_s}
    for key in ("began", "fault_at", "repaired_at", "recovered_at", "ended"):
        if out[key] is not None:
            out[key] = round(out[key] - began, 3)
    return out


def _samples_json(watch: Watch, began: float) -> dict[str, Any]:
    """Every route sample as ``[t, replica, worker or null, error]`` (t: seconds since the run
    began, when the request was sent), every Lookup sample in which the replicas differed, and
    how many were taken in all."""
    differing = [{"t": round(s.sent - began, 3), "answers": s.answers} for s in watch.lookups
                 if len({repr(a) for a in s.answers.values()}) > 1]
    return {
        "routes": [[round(s.sent - began, 3), s.replica, s.worker_id, s.error]
                   for s in watch.routes],
        "lookup_samples": len(watch.lookups), "lookups_differing": differing,
    }


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def table_rows(summary: dict[str, dict[str, Any]], lag: dict[str, Any] | None) -> list[list[str]]:
    rows = []
    for kind in summary.values():
        label, rounds = kind["label"], kind["rounds"]
        if kind["recovered"]:
            value = f"{kind['recovery_s_p50']:.2f} / {kind['recovery_s_max']:.2f}"
        else:
            value = "never"
        recovered = kind["recovered"] == rounds and not kind["errors"]
        rows += [
            [label, f"recovery s, p50 / max ({kind['recovered']}/{rounds} rounds)", value,
             f"max <= {kind['recovery_target_s']:.1f}",
             _verdict(recovered and kind["recovery_s_max"] <= kind["recovery_target_s"])],
            [label, "stale routes, of routes at stake",
             f"{kind['stale_routes']} of {kind['routes_at_stake']}", "0",
             _verdict(kind["stale_routes"] == 0)],
            [label, "lost acked rollouts, of checked", f"{kind['lost_rollouts']} of "
             f"{kind['checked_rollouts']}", "0", _verdict(kind["lost_rollouts"] == 0)],
            [label, f"lookup disagreement > {LAG_BOUND_S:g} s", str(kind["disagreements"]), "0",
             _verdict(kind["disagreements"] == 0)],
        ]
    if lag is not None:
        rate = f"{lag['sent_per_s']:.0f} batches/s x {lag['pages_per_batch']} pages"
        mixed = "" if lag["window_holds_only_this_load"] else " (window mixed: run longer)"
        rows.append([f"steady events on c1 ({rate})", f"replication lag p99 on c2, ms{mixed}",
                     f"{lag['lag_p99_ms']:.1f}", f"<= {LAG_TARGET_MS:.0f}",
                     _verdict(lag["window_holds_only_this_load"]
                              and lag["lag_p99_ms"] <= LAG_TARGET_MS)])
        rows.append([f"steady events on c1 ({rate})", "replication lag p50 on c2, ms",
                     f"{lag['lag_p50_ms']:.1f}", "-", "-"])
    return rows


def _preflight() -> str | None:
    if not sys.platform.startswith("linux") or shutil.which("ip") is None:
        return "needs Linux with iproute2 (`ip netns`)"
    if os.geteuid() != 0:
        return "needs root (network namespaces): run `sudo make chaos`"
    if shutil.which("redis-server") is None:
        return "needs redis-server on PATH (apt-get install redis-server)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each fault kind")
    parser.add_argument("--lag-rate", type=int, default=LAG_RATE, help="batches/s on c1")
    parser.add_argument("--lag-seconds", type=float, default=LAG_SECONDS)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    problem = _preflight()
    if problem:
        print(f"chaos: {problem}", file=sys.stderr)
        return 2
    configure_logging("error")  # the SDK's hashing warning; the fleet logs to files
    logs = Path(tempfile.mkdtemp(prefix="kvcoord-chaos-logs-"))
    began = time.monotonic()
    rounds: list[Round] = []
    lag: dict[str, Any] | None = None
    with running_cluster(logs) as cluster:
        chaos = Chaos(cluster)
        chaos.watch.start()
        try:
            for kind, index in schedule(args.rounds):
                rnd = run_round(chaos, kind, index)
                rounds.append(rnd)
                recovery = "-" if rnd.recovery_s is None else f"{rnd.recovery_s:.2f} s"
                print(f"  {kind:<17} #{index} victim {rnd.victim:<3} recovery {recovery}"
                      + (f"  ERROR {rnd.error}" if rnd.error else ""), flush=True)
                if rnd.error:
                    break  # the fleet is not whole: later rounds would measure the wreck
        finally:
            chaos.watch.stop()
        if not any(r.error for r in rounds):
            try:
                lag = asyncio.run(sustained_lag(cluster, args.lag_rate, args.lag_seconds))
            except (grpc.RpcError, KvcoordError, EOFError, TimeoutError) as exc:
                print(f"  sustained lag: ERROR {type(exc).__name__}: {exc}", flush=True)
    summary = summarize(rounds, chaos.watch, began)
    rows = table_rows(summary, lag)
    # Redis keeps the stream across its restarts here (AOF, fsync always): a replica that
    # reports it lost re-publishes and re-asks every worker's snapshot for nothing.
    resnapshots = {r: (logs / f"{r}.log").read_text(errors="replace").count(
        '"replication.stream_lost"') for r in REPLICAS}
    rows.append(["whole run (the stream is never lost)",
                 "re-snapshots for a 'lost' stream (log)", str(sum(resnapshots.values())), "-",
                 "-"])
    print()
    print(render_table(["fault", "measure", "value", "target", "verdict"], rows))
    print("\n".join(f"\n{name}: {text}" for name, text in DEFINITIONS.items()))
    results = {
        "definitions": DEFINITIONS, "summary": summary, "lag": lag,
        "stream_lost_warnings": resnapshots,
        "rounds": [_round_json(r, began) for r in rounds],
        "config": {"rounds": args.rounds, "lease_s": LEASE_S, "lag_bound_s": LAG_BOUND_S,
                   "stale_slack_s": STALE_SLACK_S, "cpus": os.cpu_count(),
                   "wall_s": time.monotonic() - began, "logs": str(logs)},
        "samples": _samples_json(chaos.watch, began),
    }
    args.out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    print(f"\nwrote {args.out} ({time.monotonic() - began:.0f} s; fleet logs in {logs})")
    missed = any(row[-1] == "MISSED" for row in rows) or any(r.error for r in rounds)
    return 1 if missed or lag is None else 0


if __name__ == "__main__":
    sys.exit(main())
