"""Each suite's targets table: the performance bars the issues set, each row ``[what, target,
measured, verdict]`` with verdict met, MISSED or "-" (reported only). A miss is not an error
(bench/runner.py); what must hold whatever the machine is in bench/invariants.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def coordinator_targets(results: dict[str, Any]) -> list[list[str]]:
    """The issue's targets, each with the measured value and whether it holds."""
    rpc = results["rpc"]
    rows = [
        ["Route, page keys / echo", ">= 0.85x", rpc["ratio.route.page_keys"]],
        ["Route, token ids (SDK: token_bytes) / echo", ">= 0.70x",
         rpc["ratio.route.token_bytes"]],
        ["Route, token ids (repeated uint32) / echo", ">= 0.70x", rpc["ratio.route.token_ids"]],
        ["Route, fresh token ids / echo", "(cold hash)", rpc["ratio.route.token_ids_fresh"]],
        ["RouteBatch (16 prompts x 4) / unary prompts/s", ">= 10x",
         rpc["ratio.batch_vs_unary.grpo_16x4"]],
        ["RouteBatch (4 prompts x 16) / unary prompts/s", ">= 10x",
         rpc["ratio.batch_vs_unary.grpo_4x16"]],
        ["Route with auth on / off (token, roles, rate limiter)", "(reported)",
         rpc["ratio.auth_on_vs_off.route.token_bytes"]],
        ["RouteBatch 4x16 with auth on / off", "(reported)",
         rpc["ratio.auth_on_vs_off.route_batch.grpo_4x16"]],
        ["Route with auth over TLS / plaintext without auth", "(reported)",
         rpc["ratio.auth_tls_on_vs_off.route.token_bytes"]],
        ["RouteBatch 4x16 with auth over TLS / plaintext without auth", "(reported)",
         rpc["ratio.auth_tls_on_vs_off.route_batch.grpo_4x16"]],
    ]
    thresholds = {">= 0.85x": 0.85, ">= 0.70x": 0.70, ">= 10x": 10.0}
    out = []
    for name, target, value in rows:
        limit = thresholds.get(target)
        verdict = "-" if limit is None else ("met" if value >= limit else "MISSED")
        out.append([name, target, f"{value:.2f}x", verdict])
    for name, path in (("index_memory", "compiled index core"),
                       ("index_memory_pure", "pure-Python index")):
        memory = results.get(name)
        if memory:
            per_key = memory["traced_bytes_per_key"]
            out.append([f"bytes per unique key at {memory['unique_keys']:,.0f} keys ({path}; "
                        f"RSS {memory['rss_bytes_per_key']:.0f})", "<= 120 B at 1e7",
                        f"{per_key:.0f} B",
                        "met" if per_key <= 120 and memory["unique_keys"] >= 10**7 else
                        ("MISSED" if memory["unique_keys"] >= 10**7 else "-")])
    peer = results.get("dynamo")
    if peer:
        for key, value in peer.items():
            if key.startswith("speedup."):
                what = key.removeprefix("speedup.")
                limit, target = _peer_target(what)
                verdict = "met" if value >= limit else "MISSED"
                out.append([f"vs Dynamo: {what}", target, f"{value:.2f}x", verdict])
    return out


def _peer_target(what: str) -> tuple[float, str]:
    """The issue's bar against Dynamo: store/match 2x faster; keyed BLAKE2b hashing within 2x;
    the opt-in xxh3 mode at parity."""
    if "blake2b" in what:
        return 0.5, ">= 0.5x"
    if "xxh3" in what:
        return 1.0, ">= 1x"
    return 2.0, ">= 2x"


def worker_targets(results: dict[str, Any]) -> list[list[str]]:
    """The worker issue's targets: speedups over the seed, measured in the same run."""
    bars = {"alloc_free_single": 50.0, "index_write": 100.0}
    rows = []
    for section in ("allocator", "index_write"):
        for key, value in results[section].items():
            if key.startswith("speedup."):
                what = key.removeprefix("speedup.")
                limit = next((v for k, v in bars.items() if what.startswith(k)), None)
                verdict = "-" if limit is None else ("met" if value >= limit else "MISSED")
                target = "-" if limit is None else f">= {limit:.0f}x"
                rows.append([f"{section}: {what} vs seed", target, f"{value:,.1f}x", verdict])
    host = results["host_tier"]
    faster = host["speedup.host_prefix_vs_cold"]
    rows.append([f"prefill {host['prompt_tokens']} tokens, {host['prefix_tokens']}-token prefix "
                 "in the host tier vs cold", "> 1x", f"{faster:.2f}x",
                 "met" if faster > 1 else "MISSED"])
    rows.append(["  the same prefix in the host tier vs on the device", "(reported)",
                 f"{host['host_prefix_over_device_prefix']:.3f}x", "-"])
    return rows


def policy_targets(results: dict[str, Any]) -> list[list[str]]:
    """The policy issue's bar: the barrier costs <= 20 ms at 64 workers."""
    rows = []
    for key, value in results["barrier"].items():
        if key.startswith("barrier_ms_p50."):
            limit = 20.0 if key.endswith(".w64") else None
            verdict = "-" if limit is None else ("met" if value <= limit else "MISSED")
            rows.append([f"barrier p50, {key.rsplit('.', 1)[1]} workers",
                         "<= 20 ms" if limit else "-", f"{value:.2f} ms", verdict])
    for key, value in results["routes_during_async"].items():
        if key.startswith("speedup."):
            rows.append([f"routes/s during async update vs none ({key.rsplit('.', 1)[1]})", "-",
                         f"{value:.2f}x", "-"])
    return rows


def replication_targets(results: dict[str, Any]) -> list[list[str]]:
    """The bars this project set for replication (issue 6 asks for the lag to be measured)."""
    ingest, lag, boot = results["ingest"], results["lag"], results["bootstrap"]
    rows = [
        ("Sync ingest, replication on / off (the owner's publishing cost)", ">= 0.7x",
         ingest["ratio.on_vs_off"], ingest["ratio.on_vs_off"] >= 0.7, "{:.2f}x"),
        ("same, with a peer process sharing this 2-core machine", "-",
         ingest["ratio.on_with_peer_vs_off"], None, "{:.2f}x"),
        (f"replication lag p99 at {lag['rate_batches_per_s.target']} batches/s", "<= 50 ms",
         lag["lag_ms.p99"], lag["lag_ms.p99"] <= 50, "{:.1f} ms"),
        ("peer index equal to the owner's after the run", "<= 1000 ms",
         lag["indexes_equal_after_ms"], lag["indexes_equal_after_ms"] <= 1000, "{:.1f} ms"),
        (f"new replica SERVING with {boot['pages']:,} pages indexed", "<= 2000 ms",
         boot["serving_after_ms"], boot["serving_after_ms"] <= 2000 and boot["index_complete"],
         "{:.0f} ms"),
    ]
    return [[name, target, fmt.format(value), "-" if ok is None else "met" if ok else "MISSED"]
            for name, target, value, ok, fmt in rows]


def bridge_targets(results: dict[str, Any]) -> list[list[str]]:
    """This project's bar for the bridge: it keeps up with a worker's own Sync path."""
    ratio = results["end_to_end"]["ratio.bridge_vs_worker"]
    return [["engine blocks/s through the bridge / the same pages on a worker's Sync stream",
             ">= 0.5x", f"{ratio:.2f}x", "met" if ratio >= 0.5 else "MISSED"],
            ["bridge work per block (decode + chain hash)", "-",
             f"{results['decode_and_map']['us_per_block']:.1f} us", "-"]]


def gateway_targets(results: dict[str, Any]) -> list[list[str]]:
    """What the gateway adds over calling a worker directly, and what kv_aware routing buys
    at the gateway over round_robin (reported; the issue names no bar for either)."""
    o, t = results["overhead"], results["ttft"]
    return [
        ["latency the gateway adds (p50 / p99)", "-",
         f"{o['added.p50_ms']:.2f} / {o['added.p99_ms']:.2f} ms", "-"],
        ["gateway CPU per request", "-", f"{o['gateway_cpu_us_per_request']:.0f} us", "-"],
        ["requests/s through the gateway / direct", "-",
         f"{o['gateway.requests_per_s'] / o['direct.requests_per_s']:.2f}x", "-"],
        ["TTFT p50, kv_aware vs round_robin (trace slice)", "-",
         f"{t['kv_aware.ttft_p50_ms']:.1f} vs {t['round_robin.ttft_p50_ms']:.1f} ms", "-"],
        ["cached-token ratio, kv_aware vs round_robin", "-",
         f"{t['kv_aware.cached_token_ratio']:.2f} vs {t['round_robin.cached_token_ratio']:.2f}",
         "-"],
    ]


SECURITY_RSS_BOUND_MIB = 64.0
"""tests/test_fuzz_rpc.py's bound on a server's RSS growth over the measured pass."""


def security_targets(results: dict[str, Any]) -> list[list[str]]:
    """The issue's bars (no crash, no INTERNAL/UNKNOWN of ours, memory within a bound) and the
    guard's (every call it must refuse, refused)."""
    c = results["campaign"]
    growth, base = c["rss_growth_mib"], c["rss_growth_mib.well_formed_baseline"]
    rows: list[tuple[str, str, str, bool | None]] = [
        (f"crashes over {c['distinct_inputs']:,} distinct hostile inputs "
         f"({c['cases']:,} sends)", "0", str(c["crashes"]),
         c["crashes"] == 0 and c["servers_alive_after"]),
        ("INTERNAL for a parseable request", "0", str(c["internal"]), c["internal"] == 0),
        ("UNKNOWN not from a parse failure", "0", str(c["unknown"]), c["unknown"] == 0),
        ("grpcio's own answer to unparseable unary bytes (UNKNOWN)", "-",
         str(c["grpcio_parse_failures"]), None),
        ("refusal details over the client's 16 KiB metadata limit", "0",
         str(c["oversized_details"]), c["oversized_details"] == 0),
    ]
    for server in ("coordinator", "worker"):
        rows.append((f"RSS growth over the measured pass, {server} (well-formed baseline "
                     f"{base[server]:.1f} MiB)", f"< {SECURITY_RSS_BOUND_MIB:.0f} MiB",
                     f"{growth[server]:.1f} MiB", growth[server] < SECURITY_RSS_BOUND_MIB))
        rows.append((f"peak RSS above a class's start, {server}", "-",
                     f"{c['peak_mib.max'][server]:.1f} MiB", None))
    guard = results["guard"]
    rows.append((f"guard per call, auth on ({guard['identities']} identities) vs off "
                 f"({guard['auth_off_us']:.2f} us)", "-", f"+{guard['added_us']:.2f} us", None))
    for who, auth in results["auth"].items():
        rows.append((f"{who}: calls not refused as they must be ({auth['cases']} cases)", "0",
                     str(auth["leaks"] + auth["bugs"]), auth["leaks"] + auth["bugs"] == 0))
    return [[name, target, value, "-" if ok is None else "met" if ok else "MISSED"]
            for name, target, value, ok in rows]


def _ratio(value: float | None, floor: float | None) -> str:
    return f"{value / floor:.2f}x" if value and floor else "n/a"


def fleet_targets(results: dict[str, Any]) -> list[list[str]]:
    """Issue 17's bars against the same-run floors, on the largest single-replica case (its
    floors were measured on that coordinator process, before the load)."""
    from bench.bench_fleet import LAG_BOUND_MS, largest_n_under_bound

    single = {k: v for k, v in results.items() if k.startswith("1r_")}
    name = max(single, key=lambda k: single[k]["workers"])
    case = single[name]
    floors, ingest, alone = case["floors"], case["ingest"], case["route_alone"]
    loaded = case["ingest_and_routes"]
    batch_us, key_us = (ingest["marginal_cpu_us_per_batch"]["r0"],
                        ingest["cpu_us_per_key_op"]["r0"])
    batch_ratio = batch_us / floors["stream_message_cpu_us"]
    route_ratio = alone["cpu_us"] / floors["unary_cpu_us"]
    lag, route_p99 = loaded["lag_owner_p99_ms"], loaded["route_p99_ms"]
    largest = largest_n_under_bound(results)
    # Computed where the replica kept up (a saturated one's CPU share says nothing of its
    # capacity): workers / cores busy.
    headline_case = f"1r_{largest}" if largest is not None else None
    headline = "n/a"
    if headline_case is not None:
        kept = results[headline_case]
        headline = " / ".join(
            f"{kept[w]['workers_per_replica_core']:.0f}" for w in ("ingest", "ingest_and_routes"))

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    rss = case["memory"]["rss_bytes_per_key"]["r0"]
    return [
        [f"CPU per event batch (less idle) / bare stream message ({name})", "<= 1.5x",
         f"{batch_us:.0f} us ({batch_ratio:.2f}x)", verdict(batch_ratio <= 1.5)],
        [f"CPU per key operation ({name}, batch cost included)", "<= 0.3 us",
         f"{key_us:.2f} us", verdict(key_us <= 0.3)],
        [f"CPU per Route (trace prompts, {case['workers']} workers) / bare unary", "<= 1.25x",
         _ratio(alone["cpu_us"], floors["unary_cpu_us"]), verdict(route_ratio <= 1.25)],
        [f"lag p99 (owner) at {case['workers']} workers, with routes",
         f"< {LAG_BOUND_MS:.0f} ms",
         f"{lag:.0f} ms" if lag is not None else "no sample",
         verdict(lag is not None and lag < LAG_BOUND_MS)],
        [f"Route p99 under that ingest ({loaded['routes']} routes)", "< 5 ms",
         f"{route_p99:.1f} ms" if route_p99 is not None else "none", verdict(
             route_p99 is not None and route_p99 < 5.0)],
        ["largest N with owner lag p99 < 300 ms", "1024", str(largest),
         verdict(largest is not None and largest >= 1024)],
        [f"workers per replica-core at 5 batches/s x 64 keys ({headline_case or 'none'}: "
         "the largest under the lag bound; ingest alone / with 200 routes/s)", "-",
         headline, "-"],
        [f"RSS per index key ({name}, {case['memory']['index_keys']['r0']:,} keys)",
         "<= 120 B at 1e7",
         f"{rss:.0f} B" if rss else "n/a", verdict(rss is not None and rss <= 120)],
        [f"batches sent / target ({name})", "-", f"{ingest['achieved_fraction']:.2f}", "-"],
        *_frontend_rows(results, case["workers"], verdict),
        *_pure_rows(results.get(f"pure_{name}"), floors),
        *_shared_routes_rows(results.get("shared_routes"), verdict),
        *_shard_rows(results, verdict),
        *_shard_decisions_rows(results.get("shard_decisions"), verdict),
    ]


def _frontend_rows(results: dict[str, Any], workers: int,
                   verdict: Callable[[bool], str]) -> list[list[str]]:
    """Issue 29's bars on one replica with its ingest in a sync frontend process: routes
    under 20 ms and none refused at any ingest load, lag under the bound."""
    rows = []
    for where in ("same_core", "other_core"):
        case = results.get(f"frontend_{where}_1r_{workers}")
        if case is None:
            continue
        loaded = case["ingest_and_routes"]
        lag, p99 = loaded["lag_owner_p99_ms"], loaded["route_p99_ms"]
        label = f"frontend_{where}_1r_{workers}"
        rows += [
            [f"Route p99 with ingest in a frontend ({label})", "< 20 ms",
             f"{p99:.1f} ms" if p99 is not None else "none",
             verdict(p99 is not None and p99 < 20.0)],
            [f"routes refused ({label})", "0", str(loaded["route_errors"]),
             verdict(loaded["route_errors"] == 0)],
            [f"lag p99 owner ({label})", "< 300 ms",
             f"{lag:.0f} ms" if lag is not None else "no sample",
             verdict(lag is not None and lag < 300.0)],
        ]
    return rows


def _pure_rows(pure: dict[str, Any] | None, floors: dict[str, Any]) -> list[list[str]]:
    """The same fleet on the pure-Python index core, beside (reported, not judged)."""
    if pure is None:
        return []
    ingest, loaded = pure["ingest"], pure["ingest_and_routes"]
    batch_us = ingest["marginal_cpu_us_per_batch"]["r0"]
    lag = loaded["lag_owner_p99_ms"]
    rss = pure["memory"]["rss_bytes_per_key"]["r0"]
    n = pure["workers"]
    return [
        [f"pure-Python index, {n} workers: CPU per batch / per key op", "(reported)",
         f"{batch_us:.0f} us ({batch_us / floors['stream_message_cpu_us']:.2f}x) / "
         f"{ingest['cpu_us_per_key_op']['r0']:.2f} us", "-"],
        [f"pure-Python index, {n} workers: lag p99 with routes / Route p99 / RSS per key",
         "(reported)", f"{lag:.0f} ms / {loaded['route_p99_ms']:.1f} ms / "
         f"{rss:.0f} B" if lag is not None and loaded["route_p99_ms"] is not None and rss
         else "n/a", "-"],
    ]


def _shared_routes_rows(shared: dict[str, Any] | None,
                        verdict: Callable[[bool], str]) -> list[list[str]]:
    """Issue 17 §4: two replicas on Redis route as one (share_routes off: the baseline)."""
    if shared is None:
        return []
    on, off, one = shared["2r_shared"], shared["2r_not_shared"], shared["1r"]
    groups = on["siblings_groups"]
    ratio = shared["burst_imbalance_vs_1r"]
    return [
        ["16 siblings alternately to 2 replicas, 20 ms apart: groups placed as by 1 replica",
         f"{groups}/{groups}",
         f"{on['siblings_placed_as_one_replica']}/{groups} "
         f"(not shared: {off['siblings_placed_as_one_replica']}/{groups})",
         verdict(on["siblings_placed_as_one_replica"] == groups)],
        ["concurrent burst from 2 replicas: load imbalance / 1 replica's", "<= 1.1x",
         f"{ratio['2r_shared']:.2f}x (not shared: {ratio['2r_not_shared']:.2f}x; "
         f"1 replica {one['burst_imbalance']:.2f})", verdict(ratio["2r_shared"] <= 1.1)],
        ["concurrent sibling pairs (one per replica) on one worker / apart", "-",
         f"{on['pairs_together']} / {on['pairs_apart']} (not shared: {off['pairs_together']} "
         f"/ {off['pairs_apart']}; 1 replica {one['pairs_together']} / {one['pairs_apart']})",
         "-"],
    ]


def _ms(value: float | None) -> str:
    return f"{value:.1f} ms" if value is not None else "none"


def _shard_rows(results: dict[str, Any], verdict: Callable[[bool], str]) -> list[list[str]]:
    """Issue 29's bars on two shards (each replica ingesting half the fleet; routes through
    shard a's, asking shard b): routes under 20 ms and none refused; lag and ingest reported."""
    rows = []
    for label, case in results.items():
        if not label.startswith("shards_"):
            continue
        loaded, alone = case["ingest_and_routes"], case["route_alone"]
        p99 = loaded["route_p99_ms"]
        per_batch = " / ".join(f"{v:.0f}" for v in case["ingest"]["cpu_us_per_batch"].values())
        rows += [
            [f"Route p99 across shards, under ingest ({label})", "< 20 ms", _ms(p99),
             verdict(p99 is not None and p99 < 20.0)],
            [f"routes refused ({label})", "0", str(loaded["route_errors"]),
             verdict(loaded["route_errors"] == 0)],
            [f"lag p99 owner / through the other shard ({label})", "(reported)",
             f"{_lag(loaded, 'owner')} / {_lag(loaded, 'other')}", "-"],
            [f"CPU per batch of its own shard, shard a / b ({label})", "(reported)",
             f"{per_batch} us", "-"],
            [f"CPU per Route alone, shard a (routing) + b (shortlist) ({label})", "(reported)",
             f"{alone['cpu_us']:.0f} + {alone['cpu_us_other_replicas']:.0f} us", "-"],
        ]
    return rows


def _lag(window: dict[str, Any], side: str) -> str:
    """A lag p99, or how many probes were not seen at all when it is the 5 s deadline."""
    from bench.fleet_load import PROBE_DEADLINE_S

    p99, censored = window[f"lag_{side}_p99_ms"], window["lag_censored_at_5s"][side]
    if p99 is not None and p99 >= PROBE_DEADLINE_S * 1000:
        return f"not seen in {PROBE_DEADLINE_S:.0f} s ({censored}/{window['lag_samples'][side]})"
    return _ms(p99)


def _shard_decisions_rows(decisions: dict[str, Any] | None,
                          verdict: Callable[[bool], str]) -> list[list[str]]:
    """Two shards decide as one coordinator (an invariant too), and the peer hop's cost."""
    if decisions is None:
        return []
    one, two = decisions["one_coordinator"], decisions["two_shards"]
    return [
        [f"routes decided as one coordinator, two shards ({decisions['workers']} workers)",
         "1.00", f"{decisions['identical_fraction']:.2f} "
         f"({decisions['identical']}/{decisions['routes']})",
         verdict(decisions["identical_fraction"] == 1.0)],
        ["sequential Route p50 / p99, one coordinator vs two shards (the peer hop)",
         "(reported)", f"{_ms(one['route_p50_ms'])} / {_ms(one['route_p99_ms'])} vs "
         f"{_ms(two['route_p50_ms'])} / {_ms(two['route_p99_ms'])}", "-"],
    ]
