"""Hostile input against a running coordinator and worker (issue 9): the fuzz campaign of
``tests.fuzz_campaign`` at a larger size than the test's, on one fleet with auth on.

- ``campaign``: every hostile class against every method of both services, as admin (the role
  that reaches deepest), twice (warm-up, then measured; once with --quick). Per class: the
  distinct inputs and the sends (the warm-up pass sends each input again), the statuses
  returned, grpcio's own answers to unparseable bytes, bugs (INTERNAL for a parseable request,
  UNKNOWN not from a parse failure), crashes, RSS growth over the measured pass and the peak
  above the class's start. The baseline, measured in the same run before the campaign: RSS
  growth of the same servers over as many well-formed requests.
- ``auth``: the same kinds of garbage without a token and with a scheduler's token, per
  method: anything but UNAUTHENTICATED / PERMISSION_DENIED (grpcio's parse failures aside) is
  counted as a leak through the guard.

Run: ``kvcoord bench security [--quick]``; it prints the tables and writes
bench/results/security.json.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import grpc

from coordinator.rpc.identities import COORDINATOR_PERMISSIONS, WORKER_PERMISSIONS, Role
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from kvcoord.tables import render_table
from tests.fuzz_campaign import Campaign, Report, rss_mib
from tests.fuzz_fleet import FuzzFleet
from worker.v1 import worker_pb2 as wpb
from worker.v1 import worker_pb2_grpc as wpb_grpc

AUTH_CLASSES = ("random_fields", "empty_fields", "hostile_strings", "type_confusion", "raw_bytes")
PARSE_FAILURES = {"UNKNOWN"}  # grpcio, for a unary request that does not parse


def _examples(quick: bool) -> int:
    """Cases per (class, method) and pass: ~500 cases in all quick (one pass, no warm-up:
    hypothesis's first example of each class is the same minimal case, the second is not),
    ~9,000 in full (two passes)."""
    return 2 if quick else 20


def bench_campaign(quick: bool = False) -> dict[str, Any]:
    """The admin campaign on a fresh fleet; prints the per-class table."""
    with tempfile.TemporaryDirectory(prefix="kvcoord-security-") as tmp, \
            FuzzFleet(Path(tmp), auth=True) as fleet:
        baseline = _well_formed_growth(fleet, requests=50 if quick else 1000)
        report = Campaign(fleet.endpoints(), examples=_examples(quick),
                          metadata=fleet.metadata("admin"), warmup=not quick).run()
        alive = fleet.alive("coordinator") and fleet.alive("worker")
    print(render_table(["hostile class", "statuses returned", "distinct inputs",
                        "sends (warm-up incl.)", "crashes", "bugs",
                        "RSS growth MiB (coord/worker)", "peak MiB (coord/worker)"],
                       _class_rows(report)))
    for failure in report.failures():
        print("BUG:", failure)
    return _campaign_results(report, baseline, alive)


def bench_auth(quick: bool = False) -> dict[str, Any]:
    """Garbage without a token and with a scheduler's token, on a fresh fleet."""
    with tempfile.TemporaryDirectory(prefix="kvcoord-security-") as tmp, \
            FuzzFleet(Path(tmp), auth=True) as fleet:
        return {role or "no_token": _auth_leaks(fleet, role, examples=1 if quick else 5)
                for role in (None, "scheduler")}


def _pair(by_server: dict[str, float]) -> str:
    """``coordinator/worker`` MiB, one decimal."""
    return "/".join(f"{by_server.get(s, 0.0):.1f}" for s in ("coordinator", "worker"))


def _class_rows(report: Report) -> list[list[str]]:
    return [[kind, ", ".join(f"{code} {n}" for code, n in t.statuses.most_common()),
             str(t.distinct), str(t.tried), str(t.crashes), str(t.internal + t.unknown),
             _pair(t.rss_growth_mib), _pair(t.peak_mib)]
            for kind, t in report.classes.items()]


def _campaign_results(report: Report, baseline: dict[str, float], alive: bool) -> dict[str, Any]:
    classes = {
        kind: {
            "distinct": t.distinct, "sends": t.tried, "crashes": t.crashes,
            "bugs": t.internal + t.unknown,
            "statuses": ", ".join(f"{code} {n}" for code, n in t.statuses.most_common()),
            "rss_growth_mib": _pair(t.rss_growth_mib), "peak_mib": _pair(t.peak_mib),
        }
        for kind, t in report.classes.items()
    }
    growth = report.rss_growth_mib()
    return {
        "cases": report.cases, "distinct_inputs": report.distinct,
        "wall_s": round(report.wall_s, 1), "cases_per_s": round(report.cases / report.wall_s, 1),
        "methods_fuzzed": len(report.methods),
        "crashes": report.total("crashes"), "internal": report.total("internal"),
        "unknown": report.total("unknown"),
        "grpcio_parse_failures": report.total("decode_failures"),
        "oversized_details": report.total("oversized_details"),
        "servers_alive_after": alive,
        "rss_growth_mib": {k: round(v, 1) for k, v in growth.items()},
        "rss_growth_mib.well_formed_baseline": {k: round(v, 1) for k, v in baseline.items()},
        "rss_after_mib": {k: round(v, 1) for k, v in report.rss_after_mib.items()},
        "peak_mib.max": {s: round(max(t.peak_mib.get(s, 0.0)
                                      for t in report.classes.values()), 1)
                         for s in ("coordinator", "worker")},
        "classes": classes,
        "bugs": report.failures(),
    }


def _well_formed_growth(fleet: FuzzFleet, requests: int) -> dict[str, float]:
    """RSS growth of each server over ``requests`` ordinary calls each (Route, Lookup and
    GetStats; Generate and GetStats), after a warm-up of a tenth as many."""
    admin = fleet.metadata("admin")
    prompt = pb.Prompt(token_ids=list(range(64)))
    with grpc.insecure_channel(fleet.coordinator_target) as c_channel, \
            grpc.insecure_channel(fleet.worker_target) as w_channel:
        coordinator = pb_grpc.CoordinatorStub(c_channel)
        worker = wpb_grpc.WorkerStub(w_channel)

        def one(i: int) -> None:
            coordinator.Route(pb.RouteRequest(prompt=prompt), timeout=5.0, metadata=admin)
            coordinator.Lookup(pb.LookupRequest(prompt=prompt), timeout=5.0, metadata=admin)
            coordinator.GetStats(pb.GetStatsRequest(), timeout=5.0, metadata=admin)
            worker.Generate(wpb.GenerateRequest(token_ids=[1, 2, 3, i % 500],
                                                max_new_tokens=2), timeout=30.0,
                            metadata=admin)
            worker.GetStats(wpb.GetStatsRequest(), timeout=5.0, metadata=admin)

        for i in range(requests // 10):
            one(i)
        before = {name: rss_mib(fleet.pid(name)) for name in ("coordinator", "worker")}
        for i in range(requests):
            one(i)
        return {name: rss_mib(fleet.pid(name)) - before[name] for name in before}


def _auth_leaks(fleet: FuzzFleet, role: str | None, examples: int) -> dict[str, Any]:
    """Garbage as ``role`` (None: no token): per method, the statuses that are neither the
    expected refusal nor grpcio's answer to unparseable bytes."""
    report = Campaign(fleet.endpoints(), examples=examples, classes=AUTH_CLASSES,
                      metadata=fleet.metadata(role), warmup=False).run()
    expected = "UNAUTHENTICATED" if role is None else "PERMISSION_DENIED"
    permissions = {"coordinator.v1.Coordinator": COORDINATOR_PERMISSIONS,
                   "worker.v1.Worker": WORKER_PERMISSIONS}
    leaks = 0
    refused = 0
    for method, codes in report.methods.items():
        service, name = method.split("/")
        if role is not None and Role(role) in permissions[service][name]:
            continue  # the role may call it: whatever it answers is the handler's business
        refused += codes[expected]
        leaks += sum(n for code, n in codes.items() if code not in {expected, *PARSE_FAILURES})
    return {"cases": report.cases, "refused": refused, "leaks": leaks,
            "bugs": report.total("internal") + report.total("unknown")}
