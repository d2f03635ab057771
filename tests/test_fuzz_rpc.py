"""Hostile requests against every RPC of a running coordinator and worker (issue 9).

One fleet (``kvcoord coordinator`` and ``kvcoord worker`` subprocesses, auth on) takes a
derandomized campaign of every hostile class in ``tests.fuzz_wire`` against every method of
both services, twice (warm-up, then measured), as admin (the role that reaches deepest): no
server exits, none answers a parseable request INTERNAL or anything UNKNOWN, both still answer,
and resident memory grows less than ``RSS_BOUND_MIB`` over the measured pass. Then the same
kinds of garbage without a token and with a scheduler's token: refused UNAUTHENTICATED /
PERMISSION_DENIED (or, for bytes that do not parse at all, grpcio's own answer), never a bug.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from bench.targets import SECURITY_RSS_BOUND_MIB
from coordinator.rpc.identities import COORDINATOR_PERMISSIONS, WORKER_PERMISSIONS, Role
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from tests.fuzz_campaign import Campaign, Endpoint, Report, rss_mib
from tests.fuzz_fleet import REAL_WORKER, FuzzFleet
from tests.fuzz_wire import HOSTILE_CLASSES
from worker.v1 import worker_pb2 as wpb
from worker.v1 import worker_pb2_grpc as wpb_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EXAMPLES = 8
"""Cases per (class, method) and pass: 14 classes x 19 methods x 8 x 2 passes, fewer where a
class's space is smaller: 3,816 cases, ~35 s on 2 cores (the whole file ~60 s)."""
RSS_BOUND_MIB = SECURITY_RSS_BOUND_MIB
"""64 MiB: growth of either server over the measured pass (``kvcoord bench security`` holds
the same bar). Measured over four runs: 5-51 MiB for the coordinator, the spread being refused
huge requests kept until a garbage collection (see the last test); -8 to +1 MiB with that
fixed; ~1 MiB for the worker. What legitimately stays: rollouts the fake worker reports (the
log is bounded) and allocator arenas. A leak of one request buffer per request (KiB to MiB
each, ~2,000 measured requests per server) would pass the bound many times over."""
AUTH_CLASSES = ("random_fields", "empty_fields", "hostile_strings", "type_confusion", "raw_bytes")
AUTH_EXAMPLES = 3
PARSE_FAILURES = {"UNKNOWN"}
"""How bytes that do not parse as a unary request are answered: grpcio's UNKNOWN, before any
of our code runs (a client-stream message that does not parse gets our INVALID_ARGUMENT). The
campaign counts them apart; its ``internal``/``unknown`` totals are only the unexplained ones."""
SERVICES = {
    pb.DESCRIPTOR.services_by_name["Coordinator"]: COORDINATOR_PERMISSIONS,
    wpb.DESCRIPTOR.services_by_name["Worker"]: WORKER_PERMISSIONS,
}
ALL_METHODS = {f"{service.full_name}/{m.name}" for service in SERVICES for m in service.methods}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzFleet]:
    with FuzzFleet(tmp_path_factory.mktemp("fuzz"), auth=True) as running:
        yield running


@pytest.fixture(scope="module")
def admin_report(fleet: FuzzFleet) -> Report:
    return Campaign(fleet.endpoints(), examples=EXAMPLES, metadata=fleet.metadata("admin")).run()


def _bugs(report: Report, fleet: FuzzFleet) -> str:
    """The bug cases and both servers' log tails (their tracebacks), for a failure message."""
    return "\n".join([*report.failures(), "--- coordinator log", fleet.log_tail("coordinator"),
                      "--- worker log", fleet.log_tail("worker")])


def test_the_campaign_tries_thousands_of_cases_of_every_hostile_class(
    admin_report: Report,
) -> None:
    assert admin_report.cases >= 3000
    # Both passes send the same derandomized cases: the distinct inputs are about half.
    assert 1500 <= admin_report.distinct <= admin_report.cases // 2
    assert set(admin_report.classes) == set(HOSTILE_CLASSES)
    assert all(tally.tried >= 2 * len(ALL_METHODS) for tally in admin_report.classes.values())


def test_every_rpc_of_both_services_is_fuzzed(admin_report: Report) -> None:
    assert set(admin_report.methods) == ALL_METHODS
    assert all(sum(codes.values()) >= 100 for codes in admin_report.methods.values())


def test_no_parseable_request_is_answered_internal_or_unknown(
    admin_report: Report, fleet: FuzzFleet,
) -> None:
    assert admin_report.total("internal") == 0, _bugs(admin_report, fleet)
    assert admin_report.total("unknown") == 0, _bugs(admin_report, fleet)
    assert admin_report.total("crashes") == 0
    # Undecodable bytes are answered by grpcio itself, and the campaign did send them.
    assert admin_report.total("decode_failures") > 0


def test_both_servers_are_alive_and_answer_after_the_campaign(
    admin_report: Report, fleet: FuzzFleet,
) -> None:
    assert fleet.alive("coordinator") and fleet.alive("worker")
    admin = fleet.metadata("admin")
    with grpc.insecure_channel(fleet.coordinator_target) as channel:
        listed = pb_grpc.CoordinatorStub(channel).ListWorkers(
            pb.ListWorkersRequest(), timeout=5.0, metadata=admin)
    assert REAL_WORKER in {w.worker_id for w in listed.workers}
    with grpc.insecure_channel(fleet.worker_target) as channel:
        stats = wpb_grpc.WorkerStub(channel).GetStats(wpb.GetStatsRequest(), timeout=5.0,
                                                      metadata=admin)
    assert stats.worker_id == REAL_WORKER


def test_resident_memory_grows_less_than_the_bound(admin_report: Report) -> None:
    growth = admin_report.rss_growth_mib()
    assert set(growth) == {"coordinator", "worker"}
    assert all(mib < RSS_BOUND_MIB for mib in growth.values()), growth


def _campaign(fleet: FuzzFleet, role: str | None) -> Report:
    return Campaign(fleet.endpoints(), examples=AUTH_EXAMPLES, classes=AUTH_CLASSES,
                    metadata=fleet.metadata(role), warmup=False).run()


def test_garbage_without_a_token_is_refused_unauthenticated(fleet: FuzzFleet) -> None:
    report = _campaign(fleet, None)
    assert report.total("internal") == report.total("unknown") == 0, _bugs(report, fleet)
    assert set(report.methods) == ALL_METHODS
    for method, codes in report.methods.items():
        assert set(codes) <= {"UNAUTHENTICATED", *PARSE_FAILURES}, (method, codes)
        assert codes["UNAUTHENTICATED"] > 0, (method, codes)


def test_a_scheduler_is_denied_every_rpc_its_role_may_not_call(fleet: FuzzFleet) -> None:
    report = _campaign(fleet, "scheduler")
    assert report.total("internal") == report.total("unknown") == 0, _bugs(report, fleet)
    denied = {f"{service.full_name}/{name}"
              for service, permissions in SERVICES.items()
              for name, roles in permissions.items() if Role.SCHEDULER not in roles}
    assert denied, "the role table lets schedulers call everything?"
    for method in denied:
        codes = report.methods[method]
        assert set(codes) <= {"PERMISSION_DENIED", *PARSE_FAILURES}, (method, codes)
        assert codes["PERMISSION_DENIED"] > 0, (method, codes)



def test_the_campaign_counts_a_failing_handler_as_a_bug() -> None:
    """The campaign itself: against an in-process server whose Lookup aborts INTERNAL and whose
    GetStats raises (grpcio: UNKNOWN), parseable cases of those methods are bugs, with cases."""
    def handler(method: str) -> grpc.RpcMethodHandler:
        def unary(request: bytes, context: grpc.ServicerContext) -> bytes:
            if method == "Lookup":
                context.abort(grpc.StatusCode.INTERNAL, "internal error")
            if method == "GetStats":
                raise RuntimeError("a handler bug")
            return b""

        def stream(request: object, context: grpc.ServicerContext) -> Iterator[bytes]:
            return iter(())

        descriptor = service.methods_by_name[method]
        if descriptor.client_streaming:
            return grpc.stream_stream_rpc_method_handler(stream)
        if descriptor.server_streaming:
            return grpc.unary_stream_rpc_method_handler(stream)
        return grpc.unary_unary_rpc_method_handler(unary)

    service = pb.DESCRIPTOR.services_by_name["Coordinator"]
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        service.full_name, {m.name: handler(m.name) for m in service.methods})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        endpoint = Endpoint("broken", f"127.0.0.1:{port}", os.getpid(), lambda: True, service,
                            probe=("GetPolicy", b""))
        report = Campaign([endpoint], examples=3, classes=("random_fields",),
                          warmup=False).run()
    finally:
        server.stop(0)
    assert report.methods[f"{service.full_name}/Lookup"]["INTERNAL"] == report.total("internal")
    assert report.methods[f"{service.full_name}/GetStats"]["UNKNOWN"] == report.total("unknown")
    assert report.total("internal") > 0 and report.total("unknown") > 0
    assert {f.split(" [")[0] for f in report.failures()} == {"broken Lookup", "broken GetStats"}


def test_refused_requests_do_not_stay_resident(fleet: FuzzFleet) -> None:
    """Without a token, 15 MiB RouteBatch requests (60 prompts of 262,144 one-byte token ids:
    ~128 MiB once parsed) are refused UNAUTHENTICATED; what the first two grow (allocator
    arenas) may stay, but each of the ten after them must not keep its request: under 16 MiB
    each on average above the larger of the first two (measured: ~8 when freed, ~130 when kept).
    The allocator moves the process by an arena at a time, either way, and not every run alike
    (seen before and after issue 15: 114 -> 216 -> 190 -> 226, and 141 -> 92 -> 194 -> 216 MiB),
    so the bound is taken over ten requests from the higher of two warm-ups."""
    request = pb.RouteBatchRequest(prompts=[pb.Prompt(token_ids=[1] * 262_144)] * 60)
    payload = request.SerializeToString()
    pid = fleet.pid("coordinator")
    options = [("grpc.max_send_message_length", 64 * 1024 * 1024)]
    with grpc.insecure_channel(fleet.coordinator_target, options=options) as channel:
        route_batch = channel.unary_unary("/coordinator.v1.Coordinator/RouteBatch")
        sizes = []
        for _ in range(12):
            with pytest.raises(grpc.RpcError) as refused:
                route_batch(payload, timeout=60.0)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            sizes.append(rss_mib(pid))
    assert (sizes[-1] - max(sizes[:2])) / 10 < 16.0, sizes
