"""Attribution (ARCHITECTURE §0, invariant 4): ``RolloutLog`` against both stores (append and
read exact records in order, cursor semantics, follow, every refusal appending nothing, the
maxlen bound); the worker's ``RolloutReporter`` against a real coordinator server, what it sent
read back with ReadRollouts (batching, flush on stop, records kept across a missing link, a
stopped coordinator and a restarted one that does not know the worker yet, refusals dropped,
the queue bound); and the worker servicer handing each answered Generate to the reporter."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest

from bench.scripted_worker import ScriptedWorker
from coordinator.client import AsyncCoordinatorClient
from coordinator.config import CoordinatorConfig
from coordinator.control.rollouts import RolloutLog
from coordinator.core.errors import FailedPrecondition, InvalidArgument
from coordinator.core.rollout_records import MAX_RECORDS_PER_CALL, Rollout
from coordinator.rpc.guard import acting_as
from coordinator.rpc.identities import ANONYMOUS
from coordinator.server.main import RunningCoordinator, start_coordinator
from coordinator.store.memory import MemoryStore
from coordinator.store.protocol import MetadataStore, parse_entry_id
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from kvcoord import cli
from tests.coordinator_fixtures import DEV_HASH, FAST_KNOBS, running_coordinator, target
from worker.config import WorkerConfig
from worker.main import start_worker
from worker.metrics import WorkerMetrics
from worker.runtime.engine import ModelConfig
from worker.runtime.runtime import WorkerRuntime
from worker.serving.gate import GenerationGate
from worker.serving.generations import GenerationRunner, SyncState
from worker.serving.servicer import WorkerServicer
from worker.sync.rollout_reporter import RolloutReporter
from worker.v1 import worker_pb2 as wpb

REDIS_STREAM_SLACK = 100  # XADD MAXLEN ~ trims whole stream nodes (stream-node-max-entries)
WAIT_S = 5.0


def rollout(rollout_id: str, version: int = 3, worker: str = "w1", *, prompt: int = 40,
            cached: int = 32, completion: int = 8) -> Rollout:
    return Rollout(rollout_id, version, worker, prompt, cached, completion)


async def read_all(log: RolloutLog, since: str | None = None, **kwargs: int) -> list[Rollout]:
    return [r async for r in log.read(since, follow=False, **kwargs)]


def without_cursor(records: list[Rollout]) -> list[Rollout]:
    return [Rollout(r.rollout_id, r.policy_version, r.worker_id, r.prompt_tokens,
                    r.cached_tokens, r.completion_tokens) for r in records]


# ---------------------------------------------------------------- RolloutLog: append and read


async def test_appended_records_read_back_exactly_in_order_with_increasing_cursors(
    store: MetadataStore,
) -> None:
    log = RolloutLog(store)
    sent = [rollout("a", 3, prompt=40, cached=32, completion=8),
            rollout("b", 4, prompt=7, cached=0, completion=1),
            rollout("c", 3, prompt=2**32 - 1, cached=2**32 - 1, completion=0)]
    assert await log.append("w1", {3, 4}, sent) == 3
    got = await read_all(log)
    assert without_cursor(got) == sent
    ids = [e.entry_id for e in await store.read("rollouts", after=None, count=10)]
    assert [r.cursor for r in got] == ids
    assert sorted(set(ids), key=parse_entry_id) == ids  # distinct and increasing


async def test_read_since_a_cursor_returns_only_the_records_strictly_after_it(
    store: MetadataStore,
) -> None:
    log = RolloutLog(store)
    await log.append("w1", {3}, [rollout(str(i)) for i in range(5)])
    everything = await read_all(log)
    assert [r.rollout_id for r in await read_all(log, everything[1].cursor)] == ["2", "3", "4"]
    assert await read_all(log, everything[-1].cursor) == []
    assert await read_all(log, "") == everything  # "" = from the oldest kept, like None


async def test_a_read_spanning_several_store_batches_returns_every_record_once(
    store: MetadataStore,
) -> None:
    log = RolloutLog(store)
    await log.append("w1", {3}, [rollout(str(i)) for i in range(7)])
    got = await read_all(log, batch=2)
    assert [r.rollout_id for r in got] == [str(i) for i in range(7)]


async def test_appending_an_empty_batch_appends_nothing(store: MetadataStore) -> None:
    log = RolloutLog(store)
    assert await log.append("w1", set(), []) == 0
    assert await read_all(log) == []


@pytest.mark.parametrize("cursor", ["yesterday", "12-", "-1", "1-2-3", "\uff11-0", f"{2**64}-0"])
async def test_a_malformed_cursor_is_refused_before_anything_is_read(
    store: MetadataStore, cursor: str,
) -> None:
    with pytest.raises(InvalidArgument, match="cursor"):
        await read_all(RolloutLog(store), cursor)


async def test_follow_delivers_a_record_appended_after_the_reader_caught_up(
    store: MetadataStore,
) -> None:
    log = RolloutLog(store)
    await log.append("w1", {3}, [rollout("before")])
    reader = log.read(None, follow=True, poll_s=0.01)
    try:
        first = await asyncio.wait_for(anext(reader), WAIT_S)
        waiting = asyncio.ensure_future(anext(reader))
        await asyncio.sleep(0.05)  # let it poll an empty tail a few times
        assert not waiting.done()
        await log.append("w1", {3}, [rollout("after")])
        second = await asyncio.wait_for(waiting, WAIT_S)
    finally:
        await reader.aclose()
    assert (first.rollout_id, second.rollout_id) == ("before", "after")


async def test_a_following_reader_stops_cleanly_when_cancelled(store: MetadataStore) -> None:
    log = RolloutLog(store)
    got: list[str] = []

    async def consume() -> None:
        async for record in log.read(None, follow=True, poll_s=0.01):
            got.append(record.rollout_id)

    task = asyncio.create_task(consume())
    await log.append("w1", {3}, [rollout("x")])
    async with asyncio.timeout(WAIT_S):
        while not got:
            await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert got == ["x"]


async def test_the_stream_stays_bounded_by_maxlen_keeping_the_newest(
    store: MetadataStore,
) -> None:
    maxlen = 10
    log = RolloutLog(store, maxlen=maxlen)
    await log.append("w1", {3}, [rollout(str(i)) for i in range(300)])
    kept = [r.rollout_id for r in await read_all(log)]
    slack = 0 if isinstance(store, MemoryStore) else REDIS_STREAM_SLACK
    assert maxlen <= len(kept) <= maxlen + slack
    assert kept == [str(i) for i in range(300 - len(kept), 300)]


def test_a_non_positive_maxlen_is_refused() -> None:
    with pytest.raises(ValueError, match="maxlen must be positive"):
        RolloutLog(MemoryStore(), maxlen=0)


# ---------------------------------------------------------------- RolloutLog: refusals

REFUSALS: list[tuple[str, list[Rollout], type[Exception], str]] = [
    ("empty id", [rollout("ok"), rollout("")], InvalidArgument,
     r"^records\[1\]\.rollout_id must be non-empty$"),
    ("long id", [rollout("x" * 257)], InvalidArgument,
     r"^records\[0\]\.rollout_id is 257 characters; at most 256$"),
    ("negative prompt", [rollout("a", prompt=-1, cached=0)], InvalidArgument,
     r"^records\[0\]\.prompt_tokens must be 0\.\.4294967295, got -1$"),
    ("oversized completion", [rollout("a", completion=2**32)], InvalidArgument,
     r"^records\[0\]\.completion_tokens must be 0\.\.4294967295, got 4294967296$"),
    ("negative cached", [rollout("a", cached=-5)], InvalidArgument,
     r"^records\[0\]\.cached_tokens must be 0\.\.4294967295, got -5$"),
    ("negative version", [rollout("a", version=-1)], InvalidArgument,
     r"^records\[0\]\.policy_version must be 0\.\.9223372036854775807, got -1$"),
    ("cached over prompt", [rollout("a"), rollout("b", prompt=10, cached=11)], InvalidArgument,
     r"^records\[1\]\.cached_tokens \(11\) exceeds prompt_tokens \(10\)$"),
    ("another worker's", [rollout("a"), rollout("b", worker="w2")], FailedPrecondition,
     r"^records\[1\]: worker 'w1' reports only its own rollouts, got worker_id 'w2'$"),
    ("unserved version", [rollout("a"), rollout("b", version=5)], FailedPrecondition,
     r"^records\[1\]: worker 'w1' was not serving version 5$"),
    ("too many", [rollout(str(i)) for i in range(MAX_RECORDS_PER_CALL + 1)], InvalidArgument,
     r"^4097 rollout records in one call; at most 4096$"),
    # A bad field anywhere refuses the batch as invalid before any ownership check.
    ("invalid wins", [rollout("a", worker="w2"), rollout("")], InvalidArgument,
     r"^records\[1\]\.rollout_id must be non-empty$"),
]


@pytest.mark.parametrize(("records", "error", "message"),
                         [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
async def test_a_refused_batch_appends_nothing(
    store: MetadataStore, records: list[Rollout], error: type[Exception], message: str,
) -> None:
    log = RolloutLog(store)
    with pytest.raises(error, match=message):
        await log.append("w1", {3, 4}, records)
    assert await read_all(log) == []


async def test_an_empty_reporting_worker_id_is_refused(store: MetadataStore) -> None:
    with pytest.raises(InvalidArgument, match=r"^worker_id must be non-empty$"):
        await RolloutLog(store).append("", {3}, [rollout("a", worker="")])


# ---------------------------------------------------------------- worker: RolloutReporter
#
# The reporter talks to a real coordinator over a real channel. ``ReportLog`` only watches that
# channel (each ReportRollouts call's rollout ids and the code the coordinator answered); what
# arrived is read back with ReadRollouts.

FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
                  ("grpc.max_reconnect_backoff_ms", 100)]
OK, UNAVAILABLE = grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


class ReportLog(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Records every ReportRollouts call on the channel and its status code; answers nothing."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.codes: list[grpc.StatusCode] = []
        self._changed = asyncio.Condition()

    async def intercept_unary_unary(
        self, continuation: Callable[..., Awaitable[grpc.aio.UnaryUnaryCall]],
        details: grpc.aio.ClientCallDetails, request: pb.ReportRolloutsRequest,
    ) -> grpc.aio.UnaryUnaryCall:
        call = await continuation(details, request)
        code = await call.code()  # the call has ended: answered, refused or unreachable
        async with self._changed:
            self.calls.append([r.rollout_id for r in request.records])
            self.codes.append(code)
            self._changed.notify_all()
        return call

    async def wait_for(self, condition: Callable[[], bool], what: str) -> None:
        try:
            async with asyncio.timeout(WAIT_S), self._changed:
                await self._changed.wait_for(condition)
        except TimeoutError:
            raise AssertionError(f"timed out waiting for {what}; calls {self.calls}, "
                                 f"codes {self.codes}") from None

    async def wait_calls(self, n: int) -> None:
        await self.wait_for(lambda: len(self.calls) >= n, f"{n} ReportRollouts calls")


class Link:
    """The reporter's stub callable: a stub on a real channel to ``address``, or None while
    ``up`` is False. ``asked`` counts the reporter's looks at the link."""

    def __init__(self, address: str, *, up: bool = True) -> None:
        self.wire = ReportLog()
        self.channel = grpc.aio.insecure_channel(address, options=FAST_RECONNECT,
                                                 interceptors=[self.wire])
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.up = up
        self.asked = 0
        self._asked = asyncio.Event()

    def __call__(self) -> pb_grpc.CoordinatorStub | None:
        self.asked += 1
        self._asked.set()
        return self.stub if self.up else None

    async def wait_asked(self, n: int) -> None:
        async with asyncio.timeout(WAIT_S):
            while self.asked < n:
                self._asked.clear()
                await self._asked.wait()


async def register_w1(coord: RunningCoordinator, version: int = 3) -> ScriptedWorker:
    """Registers worker ``w1`` serving ``version``: the coordinator accepts its records of it."""
    worker = ScriptedWorker(target(coord), "w1", hash_config=DEV_HASH, policy_version=version)
    await worker.register()
    return worker


async def arrived(coord: RunningCoordinator) -> list[str]:
    """The rollout ids the coordinator holds, oldest first (ReadRollouts)."""
    async with AsyncCoordinatorClient(target(coord)) as client:
        return [r.rollout_id async for r in client.rollouts()]


@pytest.fixture
async def served() -> AsyncIterator[tuple[RunningCoordinator, Link]]:
    """A coordinator where ``w1`` is registered at version 3, and a link to it."""
    async with running_coordinator() as coord:
        worker = await register_w1(coord)
        link = Link(target(coord))
        try:
            yield coord, link
        finally:
            await link.channel.close()
            await worker.close()


def started(link: Link, **kwargs: int) -> RolloutReporter:
    reporter = RolloutReporter(link, worker_id="w1", **kwargs)
    reporter.start()
    return reporter


async def test_full_batches_go_at_once_and_a_partial_one_waits_for_stop(
    served: tuple[RunningCoordinator, Link],
) -> None:
    coord, link = served
    reporter = started(link, batch_size=3, flush_ms=60_000)
    for i in range(2):
        reporter.add(rollout(str(i)))
    await asyncio.sleep(0.05)  # an absence cannot be awaited: under a batch, long before a flush
    assert link.wire.calls == [] and await arrived(coord) == []
    for i in range(2, 7):
        reporter.add(rollout(str(i)))
    await link.wire.wait_calls(3)
    assert link.wire.calls == [["0", "1", "2"], ["3", "4", "5"], ["6"]]
    assert link.wire.codes == [OK] * 3
    assert await arrived(coord) == [str(i) for i in range(7)]
    reporter.add(rollout("7"))
    await reporter.stop()
    assert link.wire.calls[3:] == [["7"]]
    assert await arrived(coord) == [str(i) for i in range(8)]
    assert (reporter.sent, reporter.pending) == (8, 0)


async def test_a_partial_batch_is_sent_when_the_flush_timer_fires(
    served: tuple[RunningCoordinator, Link],
) -> None:
    coord, link = served
    reporter = started(link, flush_ms=20)
    reporter.add(rollout("a"))
    await link.wire.wait_calls(1)
    assert link.wire.calls == [["a"]]
    assert await arrived(coord) == ["a"]
    assert (reporter.sent, reporter.pending) == (1, 0)
    await reporter.stop()


async def test_records_wait_while_disconnected_and_go_after_the_reconnect(
    served: tuple[RunningCoordinator, Link],
) -> None:
    coord, link = served
    link.up = False
    reporter = started(link, flush_ms=10)
    reporter.add(rollout("a"))
    reporter.add(rollout("b"))
    await link.wait_asked(5)  # several flush ticks found no link
    assert link.wire.calls == [] and reporter.pending == 2
    assert await arrived(coord) == []
    link.up = True
    await link.wire.wait_calls(1)
    assert link.wire.calls == [["a", "b"]]
    assert await arrived(coord) == ["a", "b"]
    await reporter.stop()
    assert reporter.sent == 2


async def test_a_transient_error_keeps_the_batch_and_sends_it_again() -> None:
    """The coordinator goes down (UNAVAILABLE), comes back without knowing the worker
    (FAILED_PRECONDITION "unknown worker"), then the worker registers: the record waited through
    both and lands exactly once."""
    first = await start_coordinator(CoordinatorConfig(listen="127.0.0.1:0", **FAST_KNOBS))
    address = target(first)
    await (await register_w1(first)).close()
    link = Link(address)
    reporter = started(link, flush_ms=10)
    worker: ScriptedWorker | None = None
    try:
        await first.stop(grace=0.2)
        reporter.add(rollout("a"))
        await link.wire.wait_for(lambda: UNAVAILABLE in link.wire.codes, "UNAVAILABLE")
        assert reporter.pending == 1
        # A restart on the same address; the embedded store forgot w1 (and every record).
        async with running_coordinator(listen=address) as second:
            await link.wire.wait_for(lambda: FAILED_PRECONDITION in link.wire.codes,
                                     "FAILED_PRECONDITION")
            assert reporter.pending == 1 and await arrived(second) == []
            worker = await register_w1(second)
            await link.wire.wait_for(lambda: OK in link.wire.codes, "the batch accepted")
            assert await arrived(second) == ["a"]
            await reporter.stop()
            assert await arrived(second) == ["a"]
    finally:
        await reporter.stop()
        await link.channel.close()
        if worker is not None:
            await worker.close()
    assert set(map(tuple, link.wire.calls)) == {("a",)}
    # Every attempt carried the same batch, in this order of answers, accepted once.
    assert [code for i, code in enumerate(link.wire.codes)
            if i == 0 or link.wire.codes[i - 1] != code] == [UNAVAILABLE, FAILED_PRECONDITION, OK]
    assert link.wire.codes.count(OK) == 1
    assert (reporter.sent, reporter.refused, reporter.pending) == (1, 0, 0)


async def test_a_refused_batch_is_dropped_and_batches_never_mix_versions(
    served: tuple[RunningCoordinator, Link],
) -> None:
    coord, link = served  # w1 serves version 3 only
    reporter = RolloutReporter(link, worker_id="w1", flush_ms=60_000)
    for rollout_id, version in [("a", 3), ("b", 3), ("c", 7), ("d", 3)]:
        reporter.add(rollout(rollout_id, version))
    await reporter.stop()  # not started: stop alone flushes
    assert link.wire.calls == [["a", "b"], ["c"], ["d"]]
    assert link.wire.codes == [OK, FAILED_PRECONDITION, OK]
    assert await arrived(coord) == ["a", "b", "d"]
    assert (reporter.sent, reporter.refused, reporter.pending) == (3, 1, 0)


async def test_the_queue_is_bounded_and_drops_the_oldest(
    served: tuple[RunningCoordinator, Link],
) -> None:
    coord, link = served
    link.up = False
    reporter = RolloutReporter(link, worker_id="w1", batch_size=2, max_pending=3)
    for i in range(5):
        reporter.add(rollout(str(i)))
    assert (reporter.dropped, reporter.pending) == (2, 3)
    await reporter.stop()  # no link: nothing can go, and stop does not wait for one
    assert link.wire.calls == [] and reporter.pending == 3
    link.up = True
    await reporter.stop()
    assert link.wire.calls == [["2", "3"], ["4"]]
    assert await arrived(coord) == ["2", "3", "4"]
    assert (reporter.sent, reporter.dropped, reporter.pending) == (3, 2, 0)


# ---------------------------------------------------------------- worker: servicer -> reporter


@pytest.fixture
def servicer_and_reports() -> tuple[WorkerServicer, list[Rollout]]:
    runtime = WorkerRuntime(model=ModelConfig(), pages=16, page_size=16, hash_config=DEV_HASH)
    reports: list[Rollout] = []
    gate = GenerationGate()
    generations = GenerationRunner(runtime, gate, WorkerMetrics(),
                                   lambda: SyncState("w1", 2, True), report=reports.append)
    servicer = WorkerServicer(generations, gate, model="default", device="cpu")
    return servicer, reports


async def test_each_answered_generate_is_reported_under_its_rollout_id(
    servicer_and_reports: tuple[WorkerServicer, list[Rollout]],
) -> None:
    servicer, reports = servicer_and_reports
    acting_as(ANONYMOUS)  # called directly, not through a server's guard
    prompt = list(range(1, 21))  # one full page of 16 and a partial one
    first = await servicer.Generate(wpb.GenerateRequest(token_ids=prompt, max_new_tokens=3), None)
    second = await servicer.Generate(
        wpb.GenerateRequest(token_ids=prompt, max_new_tokens=2, rollout_id="grpo-7-1"), None,
    )
    assert len(first.rollout_id) == 32 and second.rollout_id == "grpo-7-1"
    assert reports == [
        Rollout(first.rollout_id, 0, "w1", prompt_tokens=20, cached_tokens=0,
                completion_tokens=3),
        Rollout("grpo-7-1", 0, "w1", prompt_tokens=20, cached_tokens=16, completion_tokens=2),
    ]


async def test_an_over_long_rollout_id_is_refused_and_nothing_is_reported(
    servicer_and_reports: tuple[WorkerServicer, list[Rollout]],
) -> None:
    servicer, reports = servicer_and_reports
    request = wpb.GenerateRequest(token_ids=[1, 2], max_new_tokens=1, rollout_id="r" * 257)
    with pytest.raises(InvalidArgument, match=r"^rollout_id is 257 characters; at most 256$"):
        await servicer.Generate(request, None)
    assert reports == []


# ---------------------------------------------------------------- end to end through the agent


async def test_a_worker_reports_through_its_agent_and_a_trainer_reads_the_records_back() -> None:
    async with running_coordinator(page_size=4) as coord:
        worker = await start_worker(WorkerConfig(
            coordinator=target(coord), listen="127.0.0.1:0", pages=16, page_size=4,
            device="cpu", worker_id="w1",
        ))
        reporter, stopped = worker.agent.rollouts, False
        try:
            await asyncio.wait_for(worker.agent.synced.wait(), WAIT_S)
            reporter.add(rollout("r1", 0))
            reporter.add(rollout("never-served", 7))  # refused by the coordinator, dropped
            reporter.add(rollout("r2", 0))
            async with AsyncCoordinatorClient(target(coord)) as client:
                stream = client.rollouts(follow=True)
                got = [await asyncio.wait_for(anext(stream), WAIT_S) for _ in range(2)]
                await stream.aclose()
                reporter.add(rollout("r3", 0))
                stopped = True
                await worker.stop(grace=0.5)  # flushes r3 before deregistering
                after = [r async for r in client.rollouts(since=got[-1].cursor)]
        finally:
            if not stopped:
                await worker.stop(grace=0.5)
    assert [(r.rollout_id, r.policy_version, r.worker_id, r.prompt_tokens, r.cached_tokens,
             r.completion_tokens) for r in got] == [("r1", 0, "w1", 40, 32, 8),
                                                   ("r2", 0, "w1", 40, 32, 8)]
    assert [r.rollout_id for r in after] == ["r3"]
    assert (reporter.sent, reporter.refused, reporter.pending) == (3, 1, 0)


async def test_rollouts_tail_prints_one_line_per_record_from_a_cursor(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with running_coordinator() as coord:
        await coord.service.rollouts.append("w1", {0}, [rollout("a", 0), rollout("b", 0)])
        tail = ["rollouts", "tail", "--coordinator", target(coord)]
        capsys.readouterr()  # the coordinator's start-up logs
        assert await asyncio.to_thread(cli.main, [*tail, "--json"]) == 0
        lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert await asyncio.to_thread(cli.main, [*tail, "--since", lines[0]["cursor"]]) == 0
        text = capsys.readouterr().out
        assert await asyncio.to_thread(cli.main, [*tail, "--since", "nope"]) == 1
        error = capsys.readouterr().err
    assert [{k: v for k, v in line.items() if k != "cursor"} for line in lines] == [
        {"rollout_id": rollout_id, "policy_version": 0, "worker_id": "w1", "prompt_tokens": 40,
         "cached_tokens": 32, "completion_tokens": 8} for rollout_id in ("a", "b")
    ]
    assert text == f"{lines[1]['cursor']}  b  v0  w1  prompt=40 cached=32 completion=8\n"
    assert "cursor" in error and "'nope'" in error
