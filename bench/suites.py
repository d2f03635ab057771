"""The suites ``kvcoord bench`` runs: for each, its steps (quick or full sizes), its targets
table (bench/targets.py) and its invariants (bench/invariants.py).

A step is ``(name, thunk)``; the thunk returns that step's results (a dict, or None for an
optional peer that is not installed). Step modules are imported when a suite runs, so one suite's
optional dependencies (torch, pyzmq) are not needed by another.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench import engines_report, invariants, rl_report, targets

Step = tuple[str, Callable[[], Any]]
Results = dict[str, Any]
Choices = dict[str, tuple[str, ...]]
"""A suite's options as given on the command line (``--rig production,shared``): option ->
names, each known (``Suite.parse``)."""


@dataclass(frozen=True, slots=True)
class Suite:
    steps: Callable[[bool], list[Step]]
    """``steps(quick)``: the steps in order."""
    targets: Callable[[Results], list[list[str]]]
    invariants: Callable[[Results], list[str]]
    """What broke, one line each; empty when everything held."""
    in_all: bool = True
    """Whether ``kvcoord bench all`` (``make smoke``, ``make bench``) runs it."""
    preflight: Callable[[bool], str | None] | None = None
    """``preflight(quick)``: one line saying what the suite lacks (a peer not installed), or
    None; the runner exits 2 with that line before running anything."""
    chosen: Callable[[bool, Choices], list[Step]] | None = None
    """For a suite that takes options: ``chosen(quick, choices)`` replaces ``steps``."""
    parse: Callable[[str, str], tuple[str, ...]] | None = None
    """``parse(option, value)``: the names ``value`` gives, or ValueError naming the unknown
    one and the known ones (the runner exits 2 with that line)."""
    result_name: Callable[[Choices], str] | None = None
    """``result_name(choices)``: the JSON's path under the results folder, without ``.json``
    (None: the suite's name)."""


def coordinator_steps(quick: bool) -> list[Step]:
    from bench.bench_core import (
        bench_dynamo_peer,
        bench_hashing,
        bench_index,
        bench_index_memory,
        bench_slot_reads,
    )
    from bench.bench_route import bench_route_work
    from bench.bench_rpc import bench_rpc

    return [
        ("hashing", bench_hashing),
        ("index_64_workers", lambda: bench_index(64, repeats=1 if quick else 3)),
        ("index_1024_workers", lambda: bench_index(1024, prompts_per_worker=1 if quick else 8,
                                                   repeats=1 if quick else 3)),
        # The same on the pure-Python holdings (the path where no compiler exists).
        ("index_64_workers_pure", lambda: bench_index(64, repeats=1 if quick else 3,
                                                      accelerated=False)),
        ("index_1024_workers_pure", lambda: bench_index(
            1024, prompts_per_worker=1 if quick else 8, repeats=1 if quick else 3,
            accelerated=False)),
        # Bytes per unique key at 10^7 keys (10^5 quick), both paths.
        ("index_memory", lambda: bench_index_memory(10**5 if quick else 10**7)),
        ("index_memory_pure", lambda: bench_index_memory(10**5 if quick else 10**7,
                                                         accelerated=False)),
        # One worker's keys read and resynced among 64 (10^6 keys, 10^5 quick), beside the
        # whole table read through the same path.
        ("slot_reads", lambda: bench_slot_reads(10**5 if quick else 10**6,
                                                repeats=3 if quick else 5)),
        ("dynamo", bench_dynamo_peer),
        ("route_work_64_workers", lambda: bench_route_work(64, quick=quick)),
        ("route_work_1024_workers", lambda: bench_route_work(1024, quick=quick)),
        ("rpc", lambda: bench_rpc(64, quick=quick)),
    ]


def worker_steps(quick: bool) -> list[Step]:
    from bench.bench_engine import bench_engine
    from bench.bench_host_tier import bench_host_tier
    from bench.bench_worker_core import bench_allocator, bench_index_write

    return [
        ("allocator", lambda: bench_allocator(2**16, pairs=20_000, seed_pairs=500, repeats=3)
         if quick else bench_allocator(2**20)),
        ("index_write", bench_index_write),
        ("engine", lambda: bench_engine(repeats=2 if quick else 5)),
        ("host_tier", lambda: bench_host_tier(quick=quick)),
    ]


def policy_steps(quick: bool) -> list[Step]:
    from bench.bench_policy import bench_barrier, bench_routes_during_async

    return [
        ("barrier", lambda: bench_barrier(updates=3 if quick else 15)),
        ("routes_during_async", lambda: bench_routes_during_async(seconds=0.5 if quick else 2.0)),
    ]


def replication_steps(quick: bool) -> list[Step]:
    from bench.bench_replication import bench_bootstrap, bench_ingest, bench_lag

    return [
        ("ingest", lambda: bench_ingest(seconds=0.5 if quick else 2.0)),
        ("lag", lambda: bench_lag(rate=500, seconds=0.5 if quick else 3.0)),
        ("bootstrap", lambda: bench_bootstrap(pages=1024 if quick else 4096)),
    ]


def bridge_steps(quick: bool) -> list[Step]:
    from bench.bench_bridge import bench_decode_and_map, bench_end_to_end

    n = 100 if quick else 300
    return [("decode_and_map", lambda: bench_decode_and_map(n)),
            ("end_to_end", lambda: bench_end_to_end(n))]


def security_steps(quick: bool) -> list[Step]:
    from bench.bench_guard import bench_guard
    from bench.bench_security import bench_auth, bench_campaign

    return [("guard", lambda: bench_guard(quick)), ("campaign", lambda: bench_campaign(quick)),
            ("auth", lambda: bench_auth(quick))]


def gateway_steps(quick: bool) -> list[Step]:
    from bench.bench_gateway import bench_gateway_overhead, bench_gateway_ttft

    return [("overhead", lambda: bench_gateway_overhead(100 if quick else 1000)),
            ("ttft", lambda: bench_gateway_ttft(300))]  # the whole committed slice, always


def engines_steps(quick: bool, choices: Choices | None = None) -> list[Step]:
    from bench.bench_engines import full_config, quick_config, run_engines

    config = (quick_config() if quick else full_config()).chosen(choices or {})
    return [("engines", lambda: run_engines(config))]


def engines_parse(option: str, value: str) -> tuple[str, ...]:
    from bench.engines_cases import parse_choice

    return parse_choice(option, value)


def engines_result_name(choices: Choices) -> str:
    from bench.engines_cases import case_file

    return case_file(choices["case"][0]) if "case" in choices else "engines"


def engines_preflight(quick: bool) -> str | None:
    from bench.bench_engines import preflight

    return preflight(quick)


def rl_steps(quick: bool) -> list[Step]:
    from bench.bench_rl import full_config, quick_config, run_rl

    return [("rl", lambda: run_rl(quick_config() if quick else full_config()))]


def rl_preflight(quick: bool) -> str | None:
    from bench.bench_rl import preflight

    return preflight(quick)


def fleet_steps(quick: bool) -> list[Step]:
    from bench.bench_fleet import fleet_steps as steps

    return steps(quick)


def routing_steps(quick: bool) -> list[Step]:
    from bench.routing_matrix import bench_routing

    return [("routing", lambda: bench_routing(quick))]


def _routing_targets(results: Results) -> list[list[str]]:
    from bench.routing_matrix import routing_targets

    return routing_targets(results)


def _routing_invariants(results: Results) -> list[str]:
    from bench.routing_matrix import routing_invariants

    return routing_invariants(results)


def transport_steps(quick: bool) -> list[Step]:
    from bench.bench_transport import transport_steps as steps

    return steps(quick)


def _transport_targets(results: Results) -> list[list[str]]:
    from bench.bench_transport import transport_targets

    return transport_targets(results)


def _transport_invariants(results: Results) -> list[str]:
    from bench.bench_transport import transport_invariants

    return transport_invariants(results)


SUITES: dict[str, Suite] = {
    "coordinator": Suite(coordinator_steps, targets.coordinator_targets, invariants.coordinator),
    "worker": Suite(worker_steps, targets.worker_targets, invariants.worker),
    "policy": Suite(policy_steps, targets.policy_targets, invariants.policy),
    "replication": Suite(replication_steps, targets.replication_targets, invariants.replication),
    "bridge": Suite(bridge_steps, targets.bridge_targets, invariants.bridge),
    "security": Suite(security_steps, targets.security_targets, invariants.security),
    "gateway": Suite(gateway_steps, targets.gateway_targets, invariants.gateway),
    "fleet": Suite(fleet_steps, targets.fleet_targets, invariants.fleet),
    "routing": Suite(routing_steps, _routing_targets, _routing_invariants),
    # The event transport: gRPC streams against Redis Streams and NATS JetStream (issue 29).
    "transport": Suite(transport_steps, _transport_targets, _transport_invariants),
    # Real vLLM engines and SGLang's smg (optional venvs): run by name, `make test-vllm`
    # runs its quick form; never part of `all`.
    "engines": Suite(engines_steps, engines_report.targets, engines_report.invariants,
                     in_all=False, preflight=engines_preflight, chosen=engines_steps,
                     parse=engines_parse, result_name=engines_result_name),
    # RL policy updates on two real vLLM engines (vLLM's environment): run by name, never in `all`.
    "rl": Suite(rl_steps, rl_report.targets, rl_report.invariants, in_all=False,
                preflight=rl_preflight),
}
