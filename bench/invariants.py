"""What each suite measured that must hold on any machine, at any size: one function per suite
taking its results and returning what broke, one line each (empty: everything held).

A broken invariant fails the run (exit 1; bench/runner.py). Checks a step can only make while
it runs (the allocator's ``check_integrity``, the engine's cached-token count, the slot tables
being equal, a barrier that did not pass) raise inside the step instead: a crash, also exit 1.
"""

from __future__ import annotations

from typing import Any

Results = dict[str, Any]


def _nonzero(section: Results | None, name: str, what: str) -> list[str]:
    """``what`` for every count in ``section`` whose key contains ``name`` and is not 0."""
    if section is None:
        return []
    return [f"{key} = {value}: {what}" for key, value in section.items()
            if name in key and value]


def coordinator(results: Results) -> list[str]:
    broken = _nonzero(results["hashing"], "cache_mismatches",
                      "the chain cache changed page keys")
    for name in ("index_64_workers", "index_1024_workers", "index_64_workers_pure",
                 "index_1024_workers_pure"):
        broken += [f"{name}.{line}" for line in _nonzero(
            results[name], "owner_misses", "stored prompts not matched in full on their owner")]
        if not results[name].get("pending_matches"):
            broken.append(f"{name}.pending_matches = 0: match_detail was timed without meeting "
                          f"a pending entry, so its pending walk never ran")
    for name in ("route_work_64_workers", "route_work_1024_workers"):
        broken += [f"{name}.{line}" for line in _nonzero(
            results[name], "wrong_routes",
            "routes to a worker not READY or with a matched depth the index does not hold")]
    broken += _nonzero(results["rpc"], "wrong_routes.",
                            "answers over gRPC that disagree with the fleet or with Lookup")
    return broken


def worker(results: Results) -> list[str]:
    # allocator.check_integrity, identical slot tables and the engine's cached-token counts are
    # checked inside the steps (they raise).
    return []


def policy(results: Results) -> list[str]:
    return (_nonzero(results["barrier"], "commits_before_last_apply",
                          "CommitPolicyUpdate returned before the last APPLIED ack")
            + _nonzero(results["routes_during_async"], "stale_routes",
                            "routes during an async update to a version the worker did "
                            "not serve"))


def replication(results: Results) -> list[str]:
    broken = [f"ingest.{line}" for line in _nonzero(
        results["ingest"], "lost_pages", "acked pages missing from the owner's index")]
    lag = results["lag"]
    broken += [f"lag.{line}" for line in _nonzero(
        lag, "lost_pages", "acked pages missing from the owner's index")]
    if not lag["indexes_equal"]:
        broken.append("lag.indexes_equal = False: the peer's index still differed from the "
                      "owner's 2 s after the last batch")
    if results["bootstrap"]["index_complete"] != 1.0:
        broken.append("bootstrap.index_complete = 0: the new replica served without every "
                      "worker's pages")
    return broken


def bridge(results: Results) -> list[str]:
    return [f"{step}.{line}" for step in ("decode_and_map", "end_to_end")
            for line in _nonzero(results[step], "wrong_keys",
                                 "bridged pages missing or not ours for the engine's tokens")]


def gateway(results: Results) -> list[str]:
    """Every streamed request reached its first token and its usage (a refusal raises in the
    step), and no engine reported more cached tokens than the prompts hold."""
    t = results["ttft"]
    broken = []
    for routing in ("round_robin", "kv_aware"):
        if t[f"{routing}.answered"] != t["requests"]:
            broken.append(f"ttft.{routing}: {t[f'{routing}.answered']} of {t['requests']} "
                          "streams reported usage")
        if not 0 <= t[f"{routing}.cached_token_ratio"] <= 1:
            broken.append(f"ttft.{routing}: cached-token ratio "
                          f"{t[f'{routing}.cached_token_ratio']} outside 0..1")
    return broken


def security(results: Results) -> list[str]:
    c = results["campaign"]
    broken = [f"campaign.{key} = {c[key]}: {what}" for key, what in (
        ("crashes", "a server died on hostile input"),
        ("internal", "INTERNAL for a parseable request"),
        ("unknown", "UNKNOWN not from a parse failure"),
        ("oversized_details", "refusal details over the client's metadata limit"),
    ) if c[key]]
    if not c["servers_alive_after"]:
        broken.append("campaign.servers_alive_after = False: a server died")
    for who, auth in results["auth"].items():
        if auth["leaks"] or auth["bugs"]:
            broken.append(f"auth.{who}: {auth['leaks']} leaks, {auth['bugs']} bugs: calls not "
                          "refused as they must be")
    return broken


def fleet(results: Results) -> list[str]:
    """Every route answered (with the ingest budget on), keys were probed (one not visible in
    5 s is a censored lag sample, counted), the coordinators indexed what was sent, and two
    shards decided every route of ``shard_decisions`` as one coordinator did."""
    broken = []
    decisions = results.get("shard_decisions")
    if decisions is not None and decisions["identical_fraction"] != 1.0:
        broken.append(f"shard_decisions: {decisions['identical']} of {decisions['routes']} "
                      f"routes decided as one coordinator does (first difference at "
                      f"{decisions['first_difference']}: {decisions['first_difference_workers']})")
    shared = results.get("shared_routes")
    if shared is not None:
        for label in ("1r", "2r_shared", "2r_not_shared"):
            measured = shared[label]
            if measured["burst_routes"] != sum(measured["burst_routes_by_worker"].values()):
                broken.append(f"shared_routes.{label}: burst routes miscounted")
    for name, case in results.items():
        if name in ("shared_routes", "shard_decisions"):
            continue
        for window in ("ingest", "ingest_and_routes"):
            measured = case[window]
            # The unbounded baseline shows what starved routes look like: measured, not held.
            if measured["route_errors"] and case.get("ingest_max_share") != 1.0:
                broken.append(f"{name}.{window}: {measured['route_errors']} routes refused")
            samples = measured["lag_samples"]
            if samples["owner"] == 0:
                broken.append(f"{name}.{window}: no key was probed")
        if min(case["memory"]["index_keys"].values()) == 0:
            broken.append(f"{name}: a replica indexed nothing")
    return broken
