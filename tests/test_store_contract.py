"""The MetadataStore contract, run against MemoryStore and a real redis-server alike."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis
from structlog.testing import capture_logs

from coordinator.core.policy_state import PolicyPhase, PolicyRecord
from coordinator.store import open_store
from coordinator.store.memory import MemoryStore
from coordinator.store.protocol import (
    MetadataStore,
    StoreUnavailable,
    StreamBounds,
    WorkerRecord,
    events_stream,
    parse_entry_id,
)
from coordinator.store.redis_store import RedisStore, redact_url
from tests.conftest import NAMESPACE, FakeClock, OpenPeer, skip_without_redis
from tests.redis_server import RedisServer, free_port

LEASE_MS = 60_000
SHORT_LEASE_MS = 150
# Redis trims a stream by whole nodes (stream-node-max-entries, 100 by default).
REDIS_STREAM_SLACK = 100


async def register(
    store: MetadataStore, worker_id: str = "w1", *, lease_ms: int = LEASE_MS, **kwargs: Any
) -> WorkerRecord:
    kwargs.setdefault("policy_version", 0)
    return await store.register_worker(
        worker_id, address="10.0.0.1:50051", lease_ms=lease_ms, **kwargs
    )


async def expire_lease(store: MetadataStore, clock: FakeClock, worker_id: str) -> None:
    """Let a SHORT_LEASE_MS lease run out: move the fake clock, or wait for Redis to drop it."""
    if isinstance(store, MemoryStore):
        clock.advance(SHORT_LEASE_MS / 1000)
        return
    deadline = time.monotonic() + 3.0
    while await store.get_worker(worker_id) is not None:
        assert time.monotonic() < deadline, "the lease did not expire"
        await asyncio.sleep(0.01)


# --- worker registry ----------------------------------------------------------------------


async def test_register_returns_the_stored_record(store: MetadataStore) -> None:
    before_ms = int(time.time() * 1000)
    record = await register(store, policy_version=3, external=True, info={"model": "llama"})
    assert record.worker_id == "w1"
    assert record.incarnation == 1
    assert (record.address, record.policy_version, record.external) == ("10.0.0.1:50051", 3, True)
    assert dict(record.info) == {"model": "llama"}
    assert before_ms - 5_000 <= record.registered_at_ms <= before_ms + 5_000
    assert await store.get_worker("w1") == record
    assert await store.list_workers() == [record]
    assert await store.get_worker("nobody") is None


async def test_reregistering_gives_incarnations_1_2_3(store: MetadataStore) -> None:
    assert await store.current_incarnation("w1") == 0
    incarnations = [(await register(store)).incarnation for _ in range(3)]
    assert incarnations == [1, 2, 3]
    assert await store.current_incarnation("w1") == 3
    assert [w.incarnation for w in await store.list_workers()] == [3]


async def test_renew_lease_refuses_a_stale_incarnation(store: MetadataStore) -> None:
    await register(store)
    current = await register(store)
    assert await store.renew_lease("w1", 1, LEASE_MS) is False
    assert await store.renew_lease("w1", 2, LEASE_MS) is True
    assert await store.renew_lease("nobody", 1, LEASE_MS) is False
    assert await store.get_worker("w1") == current


async def test_renewal_extends_the_lease(store: MetadataStore, clock: FakeClock) -> None:
    renewed = await register(store, "renewed", lease_ms=SHORT_LEASE_MS)
    await register(store, "lapsed", lease_ms=SHORT_LEASE_MS)
    assert await store.renew_lease("renewed", 1, LEASE_MS) is True
    await expire_lease(store, clock, "lapsed")
    assert await store.get_worker("renewed") == renewed
    assert await store.list_workers() == [renewed]


async def test_an_expired_lease_hides_the_worker_and_fences_it(
    store: MetadataStore, clock: FakeClock
) -> None:
    await register(store, "w1", lease_ms=SHORT_LEASE_MS)
    await expire_lease(store, clock, "w1")
    assert await store.get_worker("w1") is None
    assert await store.list_workers() == []
    assert await store.renew_lease("w1", 1, LEASE_MS) is False
    assert await store.update_worker("w1", 1, policy_version="2") is False
    assert await store.deregister_worker("w1", 1) is False
    assert await store.current_incarnation("w1") == 1
    assert (await register(store)).incarnation == 2


async def test_deregister_refuses_a_stale_incarnation(store: MetadataStore) -> None:
    await register(store)
    current = await register(store)
    assert await store.deregister_worker("w1", 1) is False
    assert await store.get_worker("w1") == current
    assert await store.deregister_worker("w1", 2) is True
    assert await store.get_worker("w1") is None
    assert await store.list_workers() == []
    assert await store.deregister_worker("w1", 2) is False
    assert await store.current_incarnation("w1") == 2
    assert (await register(store)).incarnation == 3


async def test_update_worker_changes_fields_for_the_live_incarnation_only(
    store: MetadataStore,
) -> None:
    await register(store, info={"model": "llama"})
    await register(store)
    await register(store, info={"model": "llama"})
    assert await store.update_worker("w1", 2, policy_version="7") is False
    assert await store.update_worker("w1", 3, policy_version="7", zone="eu") is True
    record = await store.get_worker("w1")
    assert record is not None
    assert (record.incarnation, record.policy_version) == (3, 7)
    assert dict(record.info) == {"model": "llama", "zone": "eu"}
    with pytest.raises(ValueError, match="external"):
        await store.update_worker("w1", 3, external="0")
    with pytest.raises(ValueError, match="decimal"):
        await store.update_worker("w1", 3, policy_version="seven")
    assert await store.get_worker("w1") == record


async def test_list_workers_is_sorted_by_id(store: MetadataStore) -> None:
    for worker_id in ("b", "c", "a"):
        await register(store, worker_id)
    assert [w.worker_id for w in await store.list_workers()] == ["a", "b", "c"]


# --- policy -------------------------------------------------------------------------------


async def test_policy_defaults_before_any_write(store: MetadataStore) -> None:
    assert await store.get_policy() == PolicyRecord()


async def test_cas_policy_writes_the_new_state_and_bumps_epoch(store: MetadataStore) -> None:
    draining = PolicyRecord(
        version=0,
        phase=PolicyPhase.DRAINING,
        target_version=1,
        epoch=99,
        target_weights_uri="s3://ckpt/step-1",
    )
    assert await store.cas_policy(PolicyRecord(), draining) is True
    assert await store.get_policy() == dataclasses.replace(draining, epoch=1)
    serving = PolicyRecord(
        version=1, phase=PolicyPhase.SERVING, mode="async", weights_uri="s3://ckpt/step-1"
    )
    assert await store.cas_policy(await store.get_policy(), serving) is True
    assert await store.get_policy() == dataclasses.replace(serving, epoch=2)


async def test_cas_policy_refuses_a_stale_expected_record(store: MetadataStore) -> None:
    first = PolicyRecord(version=1, weights_uri="s3://ckpt/step-1")
    assert await store.cas_policy(PolicyRecord(), first) is True
    stored = await store.get_policy()
    stale_records = (
        PolicyRecord(),
        first,  # epoch 0: stale
        dataclasses.replace(stored, phase=PolicyPhase.DRAINING),
        dataclasses.replace(stored, weights_uri="s3://ckpt/step-0"),
        dataclasses.replace(stored, target_weights_uri="s3://ckpt/step-2"),
    )
    for stale in stale_records:
        assert await store.cas_policy(stale, PolicyRecord(version=2)) is False
    assert await store.get_policy() == stored == dataclasses.replace(first, epoch=1)


async def test_cas_policy_raises_on_a_decreasing_version(store: MetadataStore) -> None:
    assert await store.cas_policy(PolicyRecord(), PolicyRecord(version=5)) is True
    stored = await store.get_policy()
    with pytest.raises(ValueError, match="never decreases"):
        await store.cas_policy(stored, PolicyRecord(version=4))
    assert await store.get_policy() == stored


async def test_concurrent_cas_from_the_same_expected_lets_exactly_one_win(
    store: MetadataStore, open_peer: OpenPeer
) -> None:
    assert await store.cas_policy(PolicyRecord(), PolicyRecord(version=3)) is True
    start = await store.get_policy()
    handles = [await open_peer() for _ in range(5)]  # separate connections on Redis
    bumped = dataclasses.replace(start, version=4)
    results = await asyncio.gather(*(handles[i % 5].cas_policy(start, bumped) for i in range(20)))
    assert results.count(True) == 1
    assert await store.get_policy() == PolicyRecord(version=4, epoch=start.epoch + 1)


# --- acks ---------------------------------------------------------------------------------


async def test_acks_keep_the_last_stage_per_worker_and_version(store: MetadataStore) -> None:
    await store.record_ack(5, "w1", "drained")
    await store.record_ack(5, "w2", "drained")
    await store.record_ack(5, "w1", "applied")
    await store.record_ack(6, "w3", "applied")
    assert await store.get_acks(5) == {"w1": "applied", "w2": "drained"}
    assert await store.get_acks(6) == {"w3": "applied"}
    assert await store.get_acks(7) == {}


# --- streams ------------------------------------------------------------------------------


async def test_read_returns_entries_oldest_first_after_the_cursor(store: MetadataStore) -> None:
    ids = [await store.append("rollouts", {"n": str(i)}, maxlen=100) for i in range(5)]
    assert [parse_entry_id(i) for i in ids] == sorted(set(map(parse_entry_id, ids)))
    everything = await store.read("rollouts", after=None, count=100)
    assert [(e.entry_id, dict(e.fields)) for e in everything] == [
        (entry_id, {"n": str(i)}) for i, entry_id in enumerate(ids)
    ]
    assert [e.entry_id for e in await store.read("rollouts", after=ids[1], count=2)] == ids[2:4]
    assert await store.read("rollouts", after=ids[-1], count=10) == []
    assert await store.read("events", after=None, count=10) == []


async def test_streams_refuse_bad_arguments(store: MetadataStore) -> None:
    with pytest.raises(ValueError, match="unknown stream"):
        await store.append("other", {"a": "b"}, maxlen=10)
    with pytest.raises(ValueError, match="at least one field"):
        await store.append("events", {}, maxlen=10)
    with pytest.raises(ValueError, match="<ms>-<seq>"):
        await store.read("events", after="yesterday", count=10)


async def test_each_shard_has_an_events_stream_of_its_own(store: MetadataStore) -> None:
    assert (events_stream(""), events_stream("a")) == ("events", "events:a")
    first = await store.append(events_stream("a"), {"n": "a1"}, maxlen=10)
    await store.append(events_stream("b"), {"n": "b1"}, maxlen=10)
    assert [dict(e.fields) for e in await store.read("events:a", after=None, count=10)] == [
        {"n": "a1"}]
    assert [dict(e.fields) for e in await store.read("events:b", after=None, count=10)] == [
        {"n": "b1"}]
    assert await store.read("events", after=None, count=10) == []
    assert (await store.stream_bounds("events:a")).last_id == first
    for bad in ("events:", "events:A", "rollouts:a", f"events:{'a' * 33}"):
        with pytest.raises(ValueError, match="unknown stream"):
            await store.append(bad, {"n": "1"}, maxlen=10)
    with pytest.raises(ValueError, match="shard"):
        events_stream("Shard A")


async def test_append_keeps_the_stream_bounded(store: MetadataStore) -> None:
    maxlen = 50
    ids = [await store.append("events", {"n": str(i)}, maxlen=maxlen) for i in range(300)]
    kept = [e.entry_id for e in await store.read("events", after=None, count=1000)]
    slack = 0 if isinstance(store, MemoryStore) else REDIS_STREAM_SLACK
    assert maxlen <= len(kept) <= maxlen + slack
    assert kept == ids[-len(kept) :]


async def test_append_many_appends_in_order_in_one_call(store: MetadataStore) -> None:
    ids = await store.append_many("events", [{"n": str(i)} for i in range(5)], maxlen=100)
    assert [parse_entry_id(i) for i in ids] == sorted(set(map(parse_entry_id, ids)))
    kept = await store.read("events", after=None, count=10)
    assert [(e.entry_id, dict(e.fields)) for e in kept] == [
        (entry_id, {"n": str(i)}) for i, entry_id in enumerate(ids)
    ]
    assert await store.append_many("events", [], maxlen=100) == []
    with pytest.raises(ValueError, match="at least one field"):
        await store.append_many("events", [{"a": "1"}, {}], maxlen=100)


async def test_tail_waits_for_the_next_entry_and_returns_empty_on_timeout(
    store: MetadataStore, open_peer: OpenPeer,
) -> None:
    peer = await open_peer()
    first = await store.append("events", {"n": "0"}, maxlen=100)
    assert [e.entry_id for e in await store.tail("events", after="0-0", count=10,
                                                 block_ms=50)] == [first]
    started = time.monotonic()
    assert await store.tail("events", after=first, count=10, block_ms=100) == []
    assert time.monotonic() - started >= 0.09

    async def append_later() -> str:
        await asyncio.sleep(0.05)
        return await peer.append("events", {"n": "1"}, maxlen=100)

    appending = asyncio.create_task(append_later())
    found = await store.tail("events", after=first, count=10, block_ms=2_000)
    assert [(e.entry_id, dict(e.fields)) for e in found] == [(await appending, {"n": "1"})]


async def test_stream_bounds_give_the_first_kept_and_last_generated_ids(
    store: MetadataStore,
) -> None:
    assert await store.stream_bounds("events") == StreamBounds(None, None)
    ids = [await store.append("events", {"n": str(i)}, maxlen=1) for i in range(3)]
    bounds = await store.stream_bounds("events")
    assert bounds.last_id == ids[-1]
    assert bounds.first_id in ids  # Redis trims whole nodes: maybe not the very last one
    with pytest.raises(ValueError, match="unknown stream"):
        await store.stream_bounds("other")


async def test_replicas_are_live_until_their_announcement_runs_out(
    store: MetadataStore, clock: FakeClock, open_peer: OpenPeer,
) -> None:
    peer = await open_peer()
    assert await store.live_replicas() == []
    await store.announce_replica("c2", LEASE_MS)
    await peer.announce_replica("c1", SHORT_LEASE_MS)
    assert await peer.live_replicas() == ["c1", "c2"]
    if isinstance(store, MemoryStore):
        clock.advance(SHORT_LEASE_MS / 1000)
    else:
        await asyncio.sleep(SHORT_LEASE_MS / 1000 + 0.05)
    assert await store.live_replicas() == ["c2"]
    with pytest.raises(ValueError, match="replica id"):
        await store.announce_replica("", LEASE_MS)


async def test_each_shard_lists_its_own_replicas(store: MetadataStore) -> None:
    await store.announce_replica("c1", LEASE_MS)
    await store.announce_replica("a1", LEASE_MS, shard="a")
    await store.announce_replica("a2", LEASE_MS, shard="a")
    await store.announce_replica("b1", LEASE_MS, shard="b")
    assert await store.live_replicas() == ["c1"]
    assert await store.live_replicas(shard="a") == ["a1", "a2"]
    assert await store.live_replicas(shard="b") == ["b1"]
    assert await store.live_replicas(shard="c") == []
    with pytest.raises(ValueError, match="shard"):
        await store.announce_replica("x1", LEASE_MS, shard="{a}")


async def test_memory_stream_ids_increase_when_the_wall_clock_steps_back() -> None:
    wall = FakeClock(start=2_000.0)
    store = MemoryStore(namespace=NAMESPACE, wall_clock=wall)
    first = await store.append("events", {"a": "1"}, maxlen=10)
    wall.advance(-1.0)
    second = await store.append("events", {"a": "2"}, maxlen=10)
    assert (first, second) == ("2000000-0", "2000000-1")


# --- construction -------------------------------------------------------------------------


async def test_memory_store_warns_it_is_embedded() -> None:
    with capture_logs() as logs:
        MemoryStore(namespace=NAMESPACE)
    assert [(e["event"], e["log_level"]) for e in logs] == [("store.embedded", "warning")]


async def test_open_store_picks_the_implementation_from_the_url() -> None:
    assert isinstance(await open_store(None, namespace=NAMESPACE), MemoryStore)
    with pytest.raises(ValueError, match=r"redis://, rediss://, unix://"):
        await open_store("http://127.0.0.1:6379", namespace=NAMESPACE)
    with pytest.raises(ValueError, match="braces"):
        MemoryStore(namespace="a{b}")


@pytest.mark.redis
async def test_open_store_connects_to_redis(redis_url: str) -> None:
    store = await open_store(redis_url, namespace=NAMESPACE)
    try:
        assert isinstance(store, RedisStore)
        assert await store.ping() is True
    finally:
        await store.close()


# --- Redis specifics ----------------------------------------------------------------------


@pytest.mark.redis
async def test_redis_keys_live_under_the_namespace_hash_tag(redis_url: str) -> None:
    store = await RedisStore.connect(redis_url, namespace=NAMESPACE)
    try:
        await register(store)
        await store.cas_policy(PolicyRecord(), PolicyRecord(version=1))
        await store.record_ack(1, "w1", "applied")
        await store.append("events", {"a": "b"}, maxlen=10)
        await store.append("rollouts", {"a": "b"}, maxlen=10)
    finally:
        await store.close()
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        keys = set(client.keys("*"))
        assert client.pttl("kvcoord:{test}:worker:w1") > 0
    assert keys == {
        f"kvcoord:{{test}}:{name}"
        for name in ("policy", "workers", "worker:w1", "incarnation:w1", "acks:1", "events")
    } | {"kvcoord:{test}:rollouts"}


@pytest.mark.redis
async def test_redis_policy_hash_missing_the_weights_fields_reads_them_as_empty(
    redis_url: str,
) -> None:
    # A hash written before weights_uri/target_weights_uri existed: CAS compares them as "".
    legacy = {"version": 4, "phase": "serving", "target_version": "", "mode": "sync", "epoch": 7}
    with redis.Redis.from_url(redis_url) as client:
        client.hset("kvcoord:{test}:policy", mapping=legacy)
    store = await RedisStore.connect(redis_url, namespace=NAMESPACE)
    try:
        old = await store.get_policy()
        assert old == PolicyRecord(version=4, epoch=7)
        new = dataclasses.replace(old, version=5, weights_uri="s3://ckpt/step-5")
        assert await store.cas_policy(old, new) is True
        assert await store.get_policy() == dataclasses.replace(new, epoch=8)
    finally:
        await store.close()


@pytest.mark.redis
async def test_redis_list_workers_prunes_expired_ids_from_the_set(
    redis_url: str, clock: FakeClock
) -> None:
    store = await RedisStore.connect(redis_url, namespace=NAMESPACE)
    try:
        await register(store, "gone", lease_ms=SHORT_LEASE_MS)
        await register(store, "kept")
        await expire_lease(store, clock, "gone")
        assert [w.worker_id for w in await store.list_workers()] == ["kept"]
    finally:
        await store.close()
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        assert client.smembers("kvcoord:{test}:workers") == {"kept"}


@pytest.mark.redis
async def test_a_stopped_redis_raises_store_unavailable() -> None:
    skip_without_redis()
    with RedisServer() as server:
        store = await RedisStore.connect(server.url, namespace=NAMESPACE)
        try:
            await register(store)
            server.stop()
            assert await store.ping() is False
            calls: list[Callable[[], Awaitable[object]]] = [
                store.get_policy,
                lambda: store.get_worker("w1"),
                store.list_workers,
                lambda: store.renew_lease("w1", 1, LEASE_MS),
                lambda: store.cas_policy(PolicyRecord(), PolicyRecord(version=1)),
                lambda: store.append("events", {"a": "b"}, maxlen=10),
            ]
            for call in calls:
                with pytest.raises(StoreUnavailable, match=f"127.0.0.1:{server.port}"):
                    await call()
        finally:
            await store.close()


async def test_connecting_to_a_dead_redis_raises_with_the_password_redacted() -> None:
    url = f"redis://admin:hunter2@127.0.0.1:{free_port()}/0"
    with pytest.raises(StoreUnavailable) as raised:
        await RedisStore.connect(url, namespace=NAMESPACE, timeout_s=1.0)
    assert "hunter2" not in str(raised.value)
    assert "redis://admin:***@127.0.0.1:" in str(raised.value)
    assert redact_url("unix:///run/redis.sock?db=1&password=hunter2") == (
        "unix:///run/redis.sock?db=1&password=***"
    )


@pytest.mark.redis
async def test_redis_state_survives_a_crash_restart_with_aof() -> None:
    skip_without_redis()
    with RedisServer(appendonly=True, appendfsync="always") as server:
        store = await RedisStore.connect(server.url, namespace=NAMESPACE)
        try:
            worker = await register(store, info={"model": "llama"})
            policy = PolicyRecord(version=1, phase=PolicyPhase.DRAINING, target_version=2)
            assert await store.cas_policy(PolicyRecord(), policy) is True
            await store.record_ack(2, "w1", "applied")
            ids = [await store.append("rollouts", {"n": str(i)}, maxlen=100) for i in range(3)]

            # SIGKILL: only what reached the AOF survives. The event loop runs between the crash
            # and the restart, so it sees the old connection close, as it would in a running
            # coordinator. (Started from this, the main, thread: a child's death signal follows
            # the thread that started it; kvcoord.child_process.)
            server.stop(hard=True)
            await asyncio.sleep(0.2)
            server.start()

            assert await store.get_policy() == dataclasses.replace(policy, epoch=1)
            assert await store.get_worker("w1") == worker
            assert await store.get_acks(2) == {"w1": "applied"}
            rollouts = await store.read("rollouts", after=None, count=10)
            assert [e.entry_id for e in rollouts] == ids
            assert (await register(store)).incarnation == 2
        finally:
            await store.close()
