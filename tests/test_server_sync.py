"""Real coordinator server + scripted workers speaking Register/Sync through the generated stubs."""

from __future__ import annotations

import grpc
import pytest

from bench.scripted_worker import ScriptedWorker
from coordinator.client import AsyncCoordinatorClient, KvcoordError
from coordinator.client.outcomes import outcome_of
from coordinator.core.hashing import HashConfig
from coordinator.server.main import STORE_RETRY_MS
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from coordinator.wire import Reason
from tests.coordinator_fixtures import DEV_HASH, eventually, running_coordinator, target

PROMPT = list(range(1000, 1000 + 16 * 8 + 5))  # 8 full pages and a partial one


async def test_lookup_reports_each_workers_leading_depth_and_route_prefers_longest() -> None:
    async with running_coordinator() as coord:
        a = ScriptedWorker(target(coord), "a", hash_config=DEV_HASH)
        b = ScriptedWorker(target(coord), "b", hash_config=DEV_HASH)
        await a.start()
        await b.start()
        keys = a.keys(PROMPT)
        assert len(keys) == 8
        assert (await a.store(keys[:6])).ack.seq == 1
        assert (await b.store(keys[:2])).ack.seq == 1
        async with AsyncCoordinatorClient(target(coord)) as client:
            result = await client.lookup(PROMPT)
            assert result.matches == {"a": 96, "b": 32}
            assert result.policy_version == 0
            route = await client.route(PROMPT)
            assert (route.worker_id, route.matched_tokens) == ("a", 96)
            assert route.address == "a.local:7000"
            # A middle page evicted: a's depth is its leading run, not its page count.
            await a.remove([keys[3]])
            assert (await client.lookup(PROMPT)).matches == {"a": 48, "b": 32}
        await a.close()
        await b.close()


async def test_sequence_gap_triggers_resync_that_restores_the_exact_inventory() -> None:
    async with running_coordinator() as coord:
        w = ScriptedWorker(target(coord), "w", hash_config=DEV_HASH)
        await w.start()
        p_keys = w.keys(PROMPT)
        other = list(range(5000, 5000 + 64))
        q_keys = w.keys(other)
        await w.store(p_keys)
        # Batch 5 when 2 is expected: the coordinator must not apply it, and must ask.
        await w.send_events(
            [pb.PageEvent(kind=pb.PageEvent.KIND_STORED, page_keys=b"".join(q_keys))], seq=5
        )
        reply = await w.next_message()  # auto_resync answered the request with `held`
        assert reply.ack.seq == w.seq == 1
        async with AsyncCoordinatorClient(target(coord)) as client:
            assert (await client.lookup(other)).matches == {}
            assert (await client.lookup(PROMPT)).matches == {"w": 128}
            assert (await client.stats()).resyncs == 1
            # The stream continues from the inventory's sequence number.
            assert (await w.store(q_keys)).ack.seq == 2
            assert (await client.lookup(other)).matches == {"w": 64}
        await w.close()


async def test_sequence_regression_ends_the_stream_with_failed_precondition() -> None:
    async with running_coordinator() as coord:
        w = ScriptedWorker(target(coord), "w", hash_config=DEV_HASH)
        await w.start()
        await w.store(w.keys(PROMPT))
        await w.send_events([], seq=1)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await w.next_message()
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "sequence regression" in (err.value.details() or "")
        await w.close()


async def test_unknown_worker_and_stale_incarnation_are_refused() -> None:
    async with running_coordinator() as coord:
        ghost = ScriptedWorker(target(coord), "ghost", hash_config=DEV_HASH)
        await ghost.register()
        ghost.worker_id = "never-registered"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ghost.connect()
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert outcome_of(err.value).reason is Reason.REREGISTER
        assert "unknown worker" in (err.value.details() or "")
        await ghost.close()

        w = ScriptedWorker(target(coord), "w", hash_config=DEV_HASH)
        first = await w.register()
        second = await w.register()
        assert (first.incarnation, second.incarnation) == (1, 2)
        w.incarnation = first.incarnation
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await w.connect()
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert outcome_of(err.value).reason is Reason.REREGISTER
        assert "stale incarnation" in (err.value.details() or "")
        await w.close()


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        (HashConfig(key=b"k" * 32), "hash key mismatch"),
        (HashConfig(key=DEV_HASH.key, page_size=32), "page size mismatch"),
    ],
)
async def test_register_with_a_different_hash_config_is_refused(
    config: HashConfig, needle: str
) -> None:
    async with running_coordinator() as coord:
        w = ScriptedWorker(target(coord), "w", hash_config=config)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await w.register()
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert outcome_of(err.value).reason is Reason.HASH_CONFIG
        assert needle in (err.value.details() or "")
        await w.close()


async def test_closed_stream_makes_worker_unroutable_at_once_and_reconnect_restores_it() -> None:
    async with running_coordinator() as coord:
        w = ScriptedWorker(target(coord), "w", hash_config=DEV_HASH)
        await w.start()
        await w.store(w.keys(PROMPT))
        async with AsyncCoordinatorClient(target(coord)) as client:
            assert (await client.route(PROMPT)).worker_id == "w"
            await w.disconnect()

            async def unroutable() -> bool:
                return (await client.workers())[0].state == "disconnected"

            await eventually(unroutable, what="worker marked disconnected")
            with pytest.raises(KvcoordError) as err:  # a short deadline: the SDK retries
                await AsyncCoordinatorClient(target(coord), timeout=0.3).route(PROMPT)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            assert err.value.reason is Reason.NO_WORKER
            assert err.value.retry_after_ms == 500
            welcome = await w.connect()
            assert welcome.welcome.next_seq == 2
            route = await client.route(PROMPT)
            assert (route.worker_id, route.matched_tokens) == ("w", 128)
        await w.close()


async def test_lapsed_lease_makes_worker_unroutable_and_heartbeats_keep_it() -> None:
    async with running_coordinator(lease_ms=400, heartbeat_ms=100) as coord:
        quiet = ScriptedWorker(target(coord), "quiet", hash_config=DEV_HASH)
        busy = ScriptedWorker(target(coord), "busy", hash_config=DEV_HASH)
        await quiet.start()
        await busy.start()
        async with AsyncCoordinatorClient(target(coord)) as client:

            async def quiet_lapsed() -> bool:
                await busy.heartbeat(running_requests=1)
                states = {w.worker_id: w.state for w in await client.workers()}
                return states == {"quiet": "disconnected", "busy": "ready"}

            await eventually(quiet_lapsed, what="quiet worker's lease to lapse")
            for _ in range(5):
                assert (await client.route(PROMPT)).worker_id == "busy"
        await quiet.close()
        await busy.close()


async def test_entries_of_a_worker_gone_past_the_grace_period_are_dropped() -> None:
    async with running_coordinator(drop_grace_ms=100) as coord:
        w = ScriptedWorker(target(coord), "w", hash_config=DEV_HASH)
        await w.start()
        await w.store(w.keys(PROMPT))
        await w.disconnect()
        async with AsyncCoordinatorClient(target(coord)) as client:

            async def dropped() -> bool:
                stats = await client.stats()
                return stats.workers == 0 and stats.index_entries == 0

            await eventually(dropped, what="entries dropped after grace")
            assert (await client.lookup(PROMPT)).matches == {}
        await w.close()


async def test_route_batch_keeps_grpo_siblings_together_and_adjacent() -> None:
    async with running_coordinator() as coord:
        workers = [ScriptedWorker(target(coord), f"w{i}", hash_config=DEV_HASH) for i in range(3)]
        for w in workers:
            await w.start()
        prompts = [[p * 100 + t for t in range(64)] for p in range(3)]
        batch = [prompts[i % 3] for i in range(12)]  # 3 prompts x 4 samples, interleaved
        async with AsyncCoordinatorClient(target(coord)) as client:
            result = await client.route_batch(batch)
        assert sorted(result.order) == list(range(12))
        for p in range(3):
            members = [i for i in range(12) if i % 3 == p]
            assert len({result.routes[i].worker_id for i in members}) == 1
            positions = sorted(result.order.index(i) for i in members)
            assert positions == list(range(positions[0], positions[0] + 4))
        for w in workers:
            await w.close()


async def test_cordoned_worker_is_never_chosen() -> None:
    async with running_coordinator() as coord:
        a = ScriptedWorker(target(coord), "a", hash_config=DEV_HASH)
        b = ScriptedWorker(target(coord), "b", hash_config=DEV_HASH)
        await a.start()
        await b.start()
        await a.store(a.keys(PROMPT))
        async with AsyncCoordinatorClient(target(coord)) as client:
            info = await client.cordon("a")
            assert info.state == "cordoned"
            for _ in range(5):
                assert (await client.route(PROMPT)).worker_id == "b"
            with pytest.raises(KvcoordError) as err:
                await client.cordon("nobody")
            assert err.value.code == grpc.StatusCode.NOT_FOUND
        await a.close()
        await b.close()


async def test_deregister_removes_worker_and_its_entries() -> None:
    async with running_coordinator() as coord:
        w = ScriptedWorker(target(coord), "w", hash_config=DEV_HASH)
        await w.start()
        await w.store(w.keys(PROMPT))
        async with grpc.aio.insecure_channel(target(coord)) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Deregister(pb.DeregisterRequest(worker_id="w", incarnation=99))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            await stub.Deregister(pb.DeregisterRequest(worker_id="w", incarnation=w.incarnation))
        async with AsyncCoordinatorClient(target(coord)) as client:
            stats = await client.stats()
            assert (stats.workers, stats.index_entries) == (0, 0)
        await w.close()


@pytest.mark.redis
async def test_redis_backed_coordinator_serves_and_counts_incarnations(redis_url: str) -> None:
    async with running_coordinator(redis=redis_url) as coord:
        w = ScriptedWorker(target(coord), "w", hash_config=DEV_HASH)
        await w.start()
        await w.store(w.keys(PROMPT))
        async with AsyncCoordinatorClient(target(coord)) as client:
            assert (await client.lookup(PROMPT)).matches == {"w": 128}
            assert (await client.stats()).store == "RedisStore"
        await w.disconnect()
        assert (await w.register()).incarnation == 2
        await w.close()


async def test_resync_interrupted_by_a_reconnect_is_asked_again_on_the_new_stream() -> None:
    async with running_coordinator() as coord:
        w = ScriptedWorker(target(coord), "w", hash_config=DEV_HASH, auto_resync=False)
        await w.start()
        await w.store(w.keys(PROMPT))
        await w.send_events([], seq=9)  # a gap: the coordinator asks for a resync
        first = await w.next_message()
        assert first.resync.reason.startswith("sequence gap")
        await w.disconnect()  # ...and the stream dies before the worker answers
        welcome = await w.connect()
        assert welcome.welcome.next_seq == 2
        again = await w.next_message()
        assert again.resync.resync_id != first.resync.resync_id
        await w.send_inventory(again.resync.resync_id)
        assert (await w.next_message()).ack.seq == 1
        async with AsyncCoordinatorClient(target(coord)) as client:
            assert (await client.lookup(PROMPT)).matches == {"w": 128}
        await w.close()


async def test_lookup_leaves_out_workers_route_would_never_pick() -> None:
    async with running_coordinator() as coord:
        live = ScriptedWorker(target(coord), "live", hash_config=DEV_HASH)
        gone = ScriptedWorker(target(coord), "gone", hash_config=DEV_HASH)
        held = ScriptedWorker(target(coord), "held", hash_config=DEV_HASH)
        for w in (live, gone, held):
            await w.start()
            await w.store(w.keys(PROMPT))
        await gone.disconnect()
        async with AsyncCoordinatorClient(target(coord)) as client:
            await client.cordon("held")

            async def only_live() -> bool:
                return (await client.lookup(PROMPT)).matches == {"live": 128}

            await eventually(only_live, what="lookup to show only the routable worker")
            stats = await client.stats()
            assert stats.index_entries == 3 * 8  # the others' entries are kept for the grace
        for w in (live, gone, held):
            await w.close()


async def test_in_flight_routes_spread_a_burst_until_heartbeats_settle_them() -> None:
    async with running_coordinator() as coord:
        a = ScriptedWorker(target(coord), "a", hash_config=DEV_HASH)
        b = ScriptedWorker(target(coord), "b", hash_config=DEV_HASH)
        await a.start()
        await b.start()
        prompts = [[p * 1000 + t for t in range(64)] for p in range(6)]
        async with AsyncCoordinatorClient(target(coord)) as client:
            chosen = [(await client.route(p)).worker_id for p in prompts]
            assert sorted(chosen) == ["a", "a", "a", "b", "b", "b"]
            before = {w.worker_id: w.inflight_routes for w in await client.workers()}
            assert before == {"a": 3, "b": 3}
            await a.heartbeat(completed_routes=3)

            async def settled() -> bool:
                now = {w.worker_id: w.inflight_routes for w in await client.workers()}
                return now == {"a": 0, "b": 3}

            await eventually(settled, what="a's completions to settle")
            assert (await client.route([9] * 64)).worker_id == "a"
        await a.close()
        await b.close()


async def test_cleared_event_drops_everything_and_must_not_carry_keys() -> None:
    async with running_coordinator() as coord:
        w = ScriptedWorker(target(coord), "w", hash_config=DEV_HASH)
        await w.start()
        await w.store(w.keys(PROMPT))
        await w.send_events([pb.PageEvent(kind=pb.PageEvent.KIND_CLEARED)])
        assert (await w.next_message()).ack.seq == 2
        async with AsyncCoordinatorClient(target(coord)) as client:
            assert (await client.lookup(PROMPT)).matches == {}
        other = w.keys(list(range(500, 564)))
        await w.send_events([  # a valid event, then a bad one: the batch is all or nothing
            pb.PageEvent(kind=pb.PageEvent.KIND_STORED, page_keys=b"".join(other)),
            pb.PageEvent(kind=pb.PageEvent.KIND_CLEARED, page_keys=b"k" * 16),
        ])
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await w.next_message()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "CLEARED event carries no page keys" in (err.value.details() or "")
        welcome = await w.connect()
        assert welcome.welcome.next_seq == 3  # batch 3 was never applied
        async with AsyncCoordinatorClient(target(coord)) as client:
            assert (await client.lookup(list(range(500, 564)))).matches == {}
        await w.close()


async def test_register_without_capacity_is_refused() -> None:
    async with running_coordinator() as coord:
        w = ScriptedWorker(target(coord), "w", hash_config=DEV_HASH, total_pages=0)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await w.register()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "total_pages must be > 0" in (err.value.details() or "")
        await w.close()


@pytest.mark.redis
async def test_redis_outage_answers_unavailable_and_lookups_keep_serving() -> None:
    from tests.conftest import skip_without_redis
    from tests.redis_server import RedisServer

    skip_without_redis()
    with RedisServer() as redis_server:
        async with running_coordinator(redis=redis_server.url) as coord:
            w = ScriptedWorker(target(coord), "w", hash_config=DEV_HASH)
            await w.start()
            await w.store(w.keys(PROMPT))
            redis_server.stop()
            other = ScriptedWorker(target(coord), "other", hash_config=DEV_HASH)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await other.register()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            refusal = outcome_of(err.value)
            assert (refusal.reason, refusal.retry_after_ms) == (Reason.STORE_UNAVAILABLE,
                                                                STORE_RETRY_MS)
            assert "metadata store unavailable" in (err.value.details() or "")
            async with AsyncCoordinatorClient(target(coord)) as client:
                assert (await client.lookup(PROMPT)).matches == {"w": 128}
                # Heartbeats during the outage keep the worker's stream and its routes.
                await w.heartbeat(running_requests=0)
                assert (await w.store(w.keys(list(range(64))))).ack.seq == 2
                assert (await client.route(PROMPT)).worker_id == "w"
            await w.close()
            await other.close()


async def test_a_newer_stream_closes_the_older_one_at_once() -> None:
    async with running_coordinator() as coord:
        first = ScriptedWorker(target(coord), "w", hash_config=DEV_HASH)
        await first.start()
        await first.store(first.keys(PROMPT))
        second = ScriptedWorker(target(coord), "w", hash_config=DEV_HASH)
        second.incarnation, second.seq = first.incarnation, first.seq
        second._channel = grpc.aio.insecure_channel(target(coord))
        welcome = await second.connect()
        assert welcome.welcome.next_seq == 2
        # The old stream ends without having to send anything first.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await first.next_message()
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert outcome_of(err.value).reason is Reason.SUPERSEDED
        assert "superseded by a newer stream" in (err.value.details() or "")
        assert (await second.store(second.keys(list(range(64))))).ack.seq == 2
        async with AsyncCoordinatorClient(target(coord)) as client:
            assert (await client.workers())[0].state == "ready"
        await first.close()
        await second.close()


async def test_route_never_picks_an_excluded_worker_and_bounds_the_list() -> None:
    async with running_coordinator() as coord, AsyncCoordinatorClient(target(coord)) as client:
        workers = [ScriptedWorker(target(coord), name, hash_config=DEV_HASH) for name in "ab"]
        for worker in workers:
            await worker.start()
            await worker.heartbeat()
        prompt = list(range(64))
        await workers[0].store(workers[0].keys(prompt))  # a holds the whole prompt
        await eventually(lambda: _holds(client, prompt, "a"), what="a's pages indexed")
        assert (await client.route(prompt)).worker_id == "a"
        assert (await client.route(prompt, exclude_workers=["a"])).worker_id == "b"
        with pytest.raises(KvcoordError) as none_left:
            await client.as_caller(None).route(prompt, exclude_workers=["a", "b"])
        assert (none_left.value.code, none_left.value.reason) == (
            grpc.StatusCode.UNAVAILABLE, Reason.NO_WORKER)
        for bad in ([f"w{i}" for i in range(65)], [""]):
            with pytest.raises(KvcoordError) as refused:
                await client.route(prompt, exclude_workers=bad)
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "exclude_workers" in refused.value.details
        for worker in workers:
            await worker.close()


async def _holds(client: AsyncCoordinatorClient, prompt: list[int], worker: str) -> bool:
    return worker in (await client.lookup(prompt)).matches


async def test_a_prefill_end_in_a_stored_event_empties_the_backlog_and_teaches_the_rate() -> None:
    # prefill_tokens_per_s 100: a 1,600-token prompt books 16 s of prefill on its worker.
    async with running_coordinator(prefill_tokens_per_s=100.0) as coord:
        a = ScriptedWorker(target(coord), "a", hash_config=DEV_HASH)
        await a.start()
        prompt = list(range(5000, 5000 + 1600))
        async with AsyncCoordinatorClient(target(coord)) as client:
            assert (await client.route(prompt)).worker_id == "a"
            (info,) = await client.workers()
            assert info.prefill_tokens_per_s == 100.0
            assert 1500 < info.prefill_backlog_tokens <= 1600
            # The worker stores the prompt's pages: its prefill ended, far sooner than 16 s.
            await a.store(a.keys(prompt))
            (info,) = await client.workers()
            assert info.prefill_backlog_tokens == 0.0
            assert info.prefill_tokens_per_s > 1600  # 1,600 tokens in well under a second
            assert info.prefill_attention_tokens == 0.0  # one prefill shows no attention
        await a.close()
