"""The chaos bench's figures: ``DEFINITIONS`` (also written into the JSON), the per-fault-kind
``summarize`` of the rounds and samples, and the table rows with a verdict each.

A verdict is "met" or "MISSED" only where something was at stake: a figure over 0 routes at
stake, 0 records checked or 0 replica comparisons reads "-", never "met".
"""

from __future__ import annotations

import statistics
from dataclasses import asdict
from typing import Any

from bench.chaos_faults import FAULTS, LOSS_LEASES, LOSS_PERCENT
from bench.chaos_lag import LAG_WINDOW
from bench.chaos_load import ANSWER_SLACK_S, UNREPORTED_S, Load, answered, overlaps
from bench.chaos_round import POLICY_STALE_S, Round
from bench.chaos_watch import (
    ROUTE_EVERY_S,
    STALE_SLACK_S,
    UNSERVED_GAP_S,
    Watch,
    availability,
    critical_samples,
    policy_stake,
    stale_routes,
    stale_stake,
    version_violations,
)
from tests.multihost_cluster import LAG_BOUND_S, LEASE_S

LAG_TARGET_MS = LEASE_S * 1000 / 10  # remote leases are renewed by events: stay far below one

DEFINITIONS = {
    "recovery_s": (
        "seconds from the end of the fault (the killed worker restarted, the link healed or the "
        "nftables rules removed, Redis restarted, the killed replica started again; for "
        "kill_replica the kill itself, since the survivor must take over unaided) to the first "
        "moment the fleet is whole: on every serving replica all three workers READY at the "
        "current policy version and attached to a serving replica, and Lookup of every probe "
        "prompt answering the holdings noted before the fault (less a killed worker's pages; "
        "none after a policy update, whose new version no page was computed under). For "
        "kill_worker it is counted from the new process's own gRPC answering instead: the "
        "rejoin, judged apart from the process start (process_start_s)"),
    "process_start_s": (
        "kill_worker: seconds from starting the new worker process to its own gRPC answering "
        "(interpreter, torch import, model load, listen), judged against its own target"),
    "stale_routes": (
        f"routes (round robin, one thread per replica, every {ROUTE_EVERY_S:g} s) naming a "
        f"worker that was killed, cut off, partitioned, cut from its owner (until READY on "
        f"another replica) or whose lease lapsed under packet loss (until READY again) more "
        f"than its lease + {STALE_SLACK_S:g} s before the route was sent, and not yet "
        f"restarted or healed"),
    "stale_routes_at_stake": (
        "answered routes sent during the round while some worker had been unreachable (killed, "
        "cut off, partitioned, its packets to its owner dropped until it is READY on another "
        "replica, or its lease lapsed under packet loss) for more than its lease + "
        f"{STALE_SLACK_S:g} s: what stale_routes could have caught; 0 when no worker was past "
        "its lease, and then the stale-routes verdict is '-'"),
    "policy_routes_at_stake": (
        "answered routes sent during the round more than policy_stale_ms "
        f"({POLICY_STALE_S * 1000:.0f} ms, one lease) after a sync policy update committed: "
        "what the route part of policy_violations could have caught (the run starts with one "
        "healthy update, so every later route is checked against the version)"),
    "critical_samples": (
        "routes, answered or refused, sent from policy_stale_ms after a commit made in the "
        "round until the fault's end: the window in which a replica that missed the commit must "
        "have stopped answering at the old version. redis_cut_update samples it densely "
        "(several threads, short deadlines) on the replica cut from Redis"),
    "policy_violations": (
        "routes sent more than policy_stale_ms after CommitPolicyUpdate(v) returned that carry "
        "a version below v, plus generations that overlapped a weight update: under a version "
        "below v, routed more than policy_stale_ms after the commit returned, or answered more "
        f"than {ANSWER_SLACK_S:g} s after it (the drain should have waited for them); a worker "
        "the update fenced is left out"),
    "lost_rollouts": (
        "rollout records missing or changed (another worker or version) when read back through "
        "ReadRollouts after recovery: the round's own probe prompts' records (those its serving "
        "added, read before the fault), and every generation answered during the round "
        "(generation runs on every replica from before the fault to recovery, each under a "
        "rollout id of ours); 'checked': those records, each round's own, never earlier "
        f"rounds'. A generation whose worker was SIGKILLed within {UNREPORTED_S:g} s of "
        "answering may die unreported in its queue: counted apart (died_with_worker)"),
    "digest_disagreements": (
        "rounds in which the serving replicas' index digests (GetStats index_digest: every "
        "confirmed (worker, key, tier) entry, order-independent) still differed "
        f"{LAG_BOUND_S:g} s after generation paused once the fleet was whole; 'compared': "
        "rounds with two serving replicas"),
    "availability": (
        "from the fault to recovery: route errors (refused or failed routes, every replica), "
        "and unserved seconds: time inside stretches longer than "
        f"{UNSERVED_GAP_S:g} s in which no replica answered a route"),
    "lag_p99_ms": (
        "replication_lag_p99_ms (publish on c1 to apply on c2, wall clocks of one machine) from "
        "c2's GetStats after a scripted worker on c1 sent page-event batches at a steady rate "
        f"(storing fresh pages, evicting the oldest once its pool is full) for long enough "
        f"that c2's quantile window (its last {LAG_WINDOW} applied events) holds that load "
        "only"),
    "packet_loss": (f"{LOSS_PERCENT}% of the worker's packets dropped at random, both "
                    f"directions, for {LOSS_LEASES} leases"),
}


def _recovery(r: Round) -> float | None:
    """``r.recovery_s``, less the new process's start where one was noted (kill_worker): the
    rejoin alone, judged against the fault's recovery target."""
    if r.recovery_s is None:
        return None
    start: float = r.notes.get("process_start_s", 0.0)
    return r.recovery_s - start


def _fault_window(r: Round) -> tuple[float, float]:
    return r.fault_at, (r.recovered_at or r.ended)


def summarize(rounds: list[Round], watch: Watch, load: Load,
              began: float) -> dict[str, dict[str, Any]]:
    """Per fault kind, the figures of the table and the samples behind them (times in seconds
    since the run began)."""
    out: dict[str, dict[str, Any]] = {}
    for kind, fault in FAULTS.items():
        mine = [r for r in rounds if r.kind == kind]
        if not mine:
            continue
        recovery = [s for r in mine if (s := _recovery(r)) is not None]
        stale = [s for r in mine for s in stale_routes(watch.routes, watch.down, r.began,
                                                       r.ended)]
        old = [s for r in mine for s in version_violations(watch.routes, watch.commits,
                                                           POLICY_STALE_S, r.began, r.ended)]
        overlapping = [g for r in mine for g in overlaps(load.generations, watch.commits,
                                                         POLICY_STALE_S, r.began, r.ended)]
        served = [availability(watch.routes, *_fault_window(r)) for r in mine]
        compared = [r for r in mine if r.agreed is not None]
        out[kind] = {
            "label": fault.label, "rounds": len(mine),
            "recovered": len(recovery), "errors": [r.error for r in mine if r.error],
            "recovery_s_p50": statistics.median(recovery) if recovery else None,
            "recovery_s_max": max(recovery) if recovery else None,
            "recovery_target_s": fault.recovery_target_s, "recovery_target_why": fault.why,
            "process_start_s": [r.notes["process_start_s"] for r in mine
                                if "process_start_s" in r.notes],
            "process_start_target_s": fault.start_target_s,
            "stale_routes": len(stale),
            "stale_routes_at_stake": sum(len(stale_stake(watch.routes, watch.down, r.began,
                                                         r.ended)) for r in mine),
            "policy_routes_at_stake": sum(len(policy_stake(watch.routes, watch.commits,
                                                           POLICY_STALE_S, r.began, r.ended))
                                          for r in mine),
            "critical_samples": sum(len(critical_samples(
                watch.routes, watch.commits, POLICY_STALE_S, r.began, r.repaired_at or r.ended))
                for r in mine),
            "stale_route_samples": [{**asdict(s), "sent": round(s.sent - began, 3)}
                                    for s in stale],
            "policy_violations": len(old) + len(overlapping),
            "old_version_routes": [{**asdict(s), "sent": round(s.sent - began, 3)} for s in old],
            "overlapping_generations": [{**asdict(g), "sent": round(g.sent - began, 3)}
                                        for g in overlapping],
            "generations": sum(len(answered(load.generations, r.began, r.ended)) for r in mine),
            "generation_errors": sum(1 for g in load.generations if g.error
                                     and any(r.began <= g.sent < r.ended for r in mine)),
            "lost_rollouts": sum(len(r.rollouts_lost) for r in mine),
            "checked_rollouts": sum(r.rollouts_checked for r in mine),
            "died_with_worker": sum(len(r.died_with_worker) for r in mine),
            "digest_disagreements": sum(1 for r in compared if r.agreed is False),
            "digest_compared": len(compared),
            "route_errors": sum(a.errors for a in served),
            "unserved_s": round(sum(a.unserved_s for a in served), 3),
            "unserved_s_max_round": round(max(a.unserved_s for a in served), 3),
        }
    return out


def verdict(ok: bool, at_stake: int = 1) -> str:
    """'-' when nothing was at stake; otherwise met or MISSED."""
    if at_stake == 0:
        return "-"
    return "met" if ok else "MISSED"


def table_rows(summary: dict[str, dict[str, Any]]) -> list[list[str]]:
    rows = []
    for kind in summary.values():
        label, rounds = kind["label"], kind["rounds"]
        if kind["recovered"]:
            value = f"{kind['recovery_s_p50']:.2f} / {kind['recovery_s_max']:.2f}"
        else:
            value = "never"
        recovered = kind["recovered"] == rounds and not kind["errors"]
        stake, policy = kind["stale_routes_at_stake"], kind["policy_routes_at_stake"]
        since = " after the new process answered" if kind["process_start_target_s"] else ""
        rows.append(
            [label, f"recovery s{since}, p50 / max ({kind['recovered']}/{rounds} rounds)",
             value, f"max <= {kind['recovery_target_s']:.1f}",
             verdict(recovered and kind["recovery_s_max"] <= kind["recovery_target_s"])])
        if (target := kind["process_start_target_s"]) is not None:
            starts = kind["process_start_s"]
            rows.append([label, f"process start s, p50 / max ({len(starts)}/{rounds} rounds)",
                         f"{statistics.median(starts):.2f} / {max(starts):.2f}" if starts
                         else "never", f"max <= {target:.1f}",
                         verdict(len(starts) == rounds and max(starts, default=0) <= target)])
        rows += [
            [label, "stale routes, of routes at stake", f"{kind['stale_routes']} of {stake}",
             "0", verdict(kind["stale_routes"] == 0, stake)],
            [label, "policy violations (routes + generations)",
             f"{kind['policy_violations']} ({policy} routes, {kind['generations']} gens)", "0",
             verdict(kind["policy_violations"] == 0, policy + kind["generations"])],
            [label, "routes in the policy_stale window after a commit (answered or refused)",
             str(kind["critical_samples"]), "-", "-"],
            [label, "lost rollout records, of checked",
             f"{kind['lost_rollouts']} of {kind['checked_rollouts']}"
             + (f" (+{kind['died_with_worker']} died w/ worker)" if kind["died_with_worker"]
                else ""), "0",
             verdict(kind["lost_rollouts"] == 0, kind["checked_rollouts"])],
            [label, "index digests differing when quiet, of rounds",
             f"{kind['digest_disagreements']} of {kind['digest_compared']}", "0",
             verdict(kind["digest_disagreements"] == 0, kind["digest_compared"])],
            [label, "availability: route errors; unserved s",
             f"{kind['route_errors']}; {kind['unserved_s']:.2f}", "-", "-"],
        ]
    return rows


def lag_rows(lag: dict[str, Any], judged: bool) -> list[list[str]]:
    """The sustained-lag rows; ``judged`` False (a quick run, too short to fill the window):
    shown with no verdict."""
    rate = f"{lag['sent_per_s']:.0f} batches/s x {lag['pages_per_batch']} pages"
    mixed = "" if lag["window_holds_only_this_load"] else " (window mixed)"
    ok = lag["window_holds_only_this_load"] and lag["lag_p99_ms"] <= LAG_TARGET_MS
    return [
        [f"steady events on c1 ({rate})", f"replication lag p99 on c2, ms{mixed}",
         f"{lag['lag_p99_ms']:.1f}", f"<= {LAG_TARGET_MS:.0f}", verdict(ok) if judged else "-"],
        [f"steady events on c1 ({rate})", "replication lag p50 on c2, ms",
         f"{lag['lag_p50_ms']:.1f}", "-", "-"],
    ]


def invariants_broken(summary: dict[str, dict[str, Any]]) -> list[str]:
    """What broke that must never break: a stale route, a policy violation, a lost record,
    replicas disagreeing, a round that could not finish."""
    broken = []
    for kind, s in summary.items():
        for key in ("stale_routes", "policy_violations", "lost_rollouts",
                    "digest_disagreements"):
            if s[key]:
                broken.append(f"{kind}: {key} = {s[key]}")
        broken += [f"{kind}: {error}" for error in s["errors"]]
    return broken
