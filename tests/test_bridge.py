"""The vLLM/SGLang bridge against a real coordinator: a hand-encoded engine publisher
(``tests/engine_publisher.py``) sends the engines' wire frames, a real ``Bridge`` follows them,
and every assertion is what a scheduler's ``Lookup`` (or ``Route``) sees. Covers both event
encodings, int and bytes hashes, omitted and unknown fields, LoRA, the CPU medium, engine blocks
of several pages, gaps filled by replay in both reply styles, rebuilds without replay, and
garbage of every kind (the bridge counts it, skips it and applies the next good batch)."""

from __future__ import annotations

import asyncio
import hashlib
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import pytest

from coordinator.client import AsyncCoordinatorClient
from coordinator.core.hashing import DEV_HASH_KEY, HashConfig, Namespace, PageHasher
from coordinator.core.index import Tier
from coordinator.server.main import RunningCoordinator
from kvcoord import child_process
from kvcoord.child_process import stop_process
from kvcoord.fleet_procs import free_port, spawn
from tests.coordinator_fixtures import eventually, running_coordinator, target
from tests.engine_publisher import (
    SEQ,
    TOPIC,
    Cleared,
    Encoding,
    EnginePublisher,
    Removed,
    ReplayStyle,
    Stored,
    encode_batch,
)
from worker.bridge.bridge import Bridge, BridgeConfig

P = 4  # our page size: prompts stay readable
MODEL = "m"
WORKER = "engine-0"
ADDRESS = "10.0.0.7:8000"
HASHER = PageHasher(HashConfig(key=DEV_HASH_KEY, page_size=P))

PROMPT = list(range(100, 120))  # 5 pages
OTHER = list(range(500, 508))  # 2 pages


def h(label: str, kind: str = "int") -> int | bytes:
    """An engine block hash: vLLM's int form (the low 64 bits of a SHA-256, so often >= 2**63,
    a msgpack uint64), its bytes form (the whole 32-byte digest, vLLM with
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), or SGLang's (a signed int64, often negative)."""
    digest = hashlib.sha256(label.encode()).digest()
    if kind == "bytes":
        return digest
    if kind == "sglang":
        return int.from_bytes(digest[:8], "big", signed=True)
    return int.from_bytes(digest, "big") & (2**64 - 1)


def keys(tokens: Sequence[int], adapter: str = "", version: int = 0) -> list[bytes]:
    """The page keys a reference worker computes for ``tokens`` (what the bridge must send)."""
    return HASHER.page_keys(tokens, Namespace(model=MODEL, adapter=adapter,
                                              policy_version=version, page_size=P))


async def lookup(coord: RunningCoordinator, tokens: Sequence[int], **scope: Any) -> dict[str, int]:
    async with AsyncCoordinatorClient(target(coord)) as client:
        return (await client.lookup(list(tokens), model=MODEL, **scope)).matches


async def shows(coord: RunningCoordinator, tokens: Sequence[int], expected: dict[str, int],
                timeout: float = 5.0, **scope: Any) -> None:
    """Wait until Lookup of ``tokens`` answers ``expected`` (the bridge applies asynchronously)."""
    seen: list[dict[str, int]] = []

    async def matches() -> bool:
        seen[:] = [await lookup(coord, tokens, **scope)]
        return seen[0] == expected

    try:
        await eventually(matches, timeout=timeout, what=f"lookup == {expected}")
    except AssertionError:
        raise AssertionError(f"lookup {tokens[:4]}... is {seen[0]}, expected {expected}") from None


def tier(coord: RunningCoordinator, key: bytes) -> Tier | None:
    return coord.service.index.tier_of(WORKER, key)


@asynccontextmanager
async def bridged(coord: RunningCoordinator, publisher: EnginePublisher,
                  **overrides: Any) -> AsyncIterator[Bridge]:
    """A started bridge following ``publisher``, subscribed before the test publishes."""
    settings: dict[str, Any] = {
        "events": publisher.events, "replay": publisher.replay, "coordinator": target(coord),
        "worker_id": WORKER, "worker_address": ADDRESS, "model": MODEL, "page_size": P,
        **overrides,
    }
    bridge = Bridge(BridgeConfig(**settings))
    await bridge.start()
    try:
        await publisher.wait_subscribed()
        yield bridge
    finally:
        await bridge.stop()


@asynccontextmanager
async def setup(*, encoding: Encoding = Encoding.VLLM_MAP,
                replay: ReplayStyle | None = ReplayStyle.CURRENT, buffer_steps: int = 10_000,
                **overrides: Any) -> AsyncIterator[tuple[RunningCoordinator, EnginePublisher,
                                                         Bridge]]:
    engine = EnginePublisher(encoding=encoding, replay=replay, buffer_steps=buffer_steps)
    try:
        async with running_coordinator(page_size=P) as coord, bridged(coord, engine,
                                                                      **overrides) as bridge:
            yield coord, engine, bridge
    finally:
        engine.close()


ENCODINGS = [
    pytest.param(Encoding.VLLM_MAP, "int", id="vllm-map-int"),
    pytest.param(Encoding.VLLM_MAP, "bytes", id="vllm-map-bytes"),
    pytest.param(Encoding.VLLM_ARRAY, "int", id="vllm-array-int"),
    pytest.param(Encoding.VLLM_ARRAY, "bytes", id="vllm-array-bytes"),
    pytest.param(Encoding.SGLANG_ARRAY, "sglang", id="sglang-array-int"),
]


# ---------------------------------------------------------------------- the event stream


@pytest.mark.parametrize(("encoding", "hash_kind"), ENCODINGS)
async def test_stored_removed_and_cleared_reach_lookup_in_every_encoding(
    encoding: Encoding, hash_kind: str,
) -> None:
    engine_name = "sglang" if encoding is Encoding.SGLANG_ARRAY else "vllm"
    b = [h(f"{hash_kind}-{i}", hash_kind) for i in range(5)]
    async with setup(encoding=encoding, engine=engine_name) as (coord, engine, bridge):
        # One request's first three blocks, then two more chained on the third.
        engine.publish(Stored(b[:3], None, PROMPT[:12], P))
        await shows(coord, PROMPT, {WORKER: 12})
        engine.publish(Stored(b[3:], b[2], PROMPT[12:], P))
        await shows(coord, PROMPT, {WORKER: 20})
        assert (await lookup(coord, [*PROMPT, 1, 2])) == {WORKER: 20}  # a partial last page
        assert (await lookup(coord, PROMPT[:8])) == {WORKER: 8}
        assert all(tier(coord, k) is Tier.GPU for k in keys(PROMPT))

        engine.publish(Removed([b[4]]))  # the tail block evicted
        await shows(coord, PROMPT, {WORKER: 16})
        engine.publish(Removed([b[1]]))  # a middle one: the leading run is one page
        await shows(coord, PROMPT, {WORKER: 4})

        engine.publish(Cleared())
        await shows(coord, PROMPT, {})
        # Events after the clear apply again, from the root.
        engine.publish(Stored([h("after", hash_kind)], None, OTHER[:4], P))
        await shows(coord, OTHER, {WORKER: 4})
        assert (bridge.last_seq, bridge.malformed, bridge.replays, bridge.rebuilds) == (
            5, {}, 0, 0)


async def test_an_engine_block_of_two_pages_becomes_two_keys() -> None:
    b = [h(f"two-{i}") for i in range(3)]
    async with setup(engine_block_size=2 * P) as (coord, engine, bridge):
        engine.publish(Stored(b[:2], None, PROMPT[:16], 2 * P))
        await shows(coord, PROMPT, {WORKER: 16})
        assert coord.service.index.worker_keys(WORKER) == frozenset(keys(PROMPT[:16]))
        engine.publish(Stored(b[2:], b[1], [*PROMPT[16:], 1, 2, 3, 4], 2 * P))
        await shows(coord, [*PROMPT, 1, 2, 3, 4], {WORKER: 24})
        engine.publish(Removed([b[1], b[2]]))  # both of a block's pages go with it
        await shows(coord, PROMPT, {WORKER: 8})
        assert coord.service.index.worker_keys(WORKER) == frozenset(keys(PROMPT[:8]))
        assert bridge.malformed == {}


@pytest.mark.parametrize("encoding", [Encoding.VLLM_MAP, Encoding.VLLM_ARRAY],
                         ids=lambda e: e.value)
async def test_a_lora_name_is_the_adapter_namespace(encoding: Encoding) -> None:
    # vLLM 0.32 (the map encoding) also names the adapter in each block's extra_keys
    # (to_event_extra_keys); the bridge once took that for a salt and dropped every LoRA block.
    extra = {"extra_keys": [["sql"], ["sql"]]} if encoding is Encoding.VLLM_MAP else {}
    async with setup(encoding=encoding) as (coord, engine, bridge):
        engine.publish(Stored([h("lora-0"), h("lora-1")], None, PROMPT[:8], P, lora_id=1,
                              lora_name="sql", extra=extra))
        await shows(coord, PROMPT, {WORKER: 8}, adapter="sql")
        assert (await lookup(coord, PROMPT)) == {}  # the base model has none of it
        assert (await lookup(coord, PROMPT, adapter="other")) == {}
        # The same tokens without the adapter are other blocks, other keys.
        engine.publish(Stored([h("base-0")], None, PROMPT[:4], P))
        await shows(coord, PROMPT, {WORKER: 4})
        engine.publish(Removed([h("lora-0"), h("lora-1")]))
        await shows(coord, PROMPT, {}, adapter="sql")
        assert (await lookup(coord, PROMPT)) == {WORKER: 4}
        assert coord.service.index.worker_keys(WORKER) == frozenset(keys(PROMPT[:4]))
        assert bridge.malformed == {}


async def test_a_lora_block_without_its_name_is_never_a_base_model_hit() -> None:
    """vLLM before lora_name (PR #27577) names a LoRA only by ``lora_id``: its blocks hold the
    adapter's KV, so they must not be indexed as the base model's. They go to the adapter
    namespace ``lora-id:<id>``."""
    async with setup(encoding=Encoding.VLLM_ARRAY) as (coord, engine, bridge):
        engine.publish(Stored([h("id-only")], None, PROMPT[:4], P, lora_id=3),
                       Stored([h("base")], None, OTHER[:4], P))
        await shows(coord, OTHER, {WORKER: 4})  # the batch was applied
        assert (await lookup(coord, PROMPT)) == {}
        assert (await lookup(coord, PROMPT, adapter="lora-id:3")) == {WORKER: 4}
        assert bridge.malformed == {}


async def test_the_cpu_medium_is_the_cpu_tier_and_the_fastest_medium_wins() -> None:
    async with setup() as (coord, engine, bridge):
        engine.publish(Stored([h("cpu-0"), h("cpu-1")], None, OTHER, P, medium="CPU"))
        await shows(coord, OTHER, {WORKER: 8})  # a CPU copy is still a hit
        assert [tier(coord, k) for k in keys(OTHER)] == [Tier.CPU, Tier.CPU]

        # A GPU block offloaded to CPU (vLLM's CPU offloading): GPU while both hold it, CPU
        # after the GPU copy is evicted, gone after the CPU copy is.
        first = keys(PROMPT)[0]
        engine.publish(Stored([h("gpu")], None, PROMPT[:4], P))
        await shows(coord, PROMPT, {WORKER: 4})
        engine.publish(Stored([h("gpu")], None, PROMPT[:4], P, medium="CPU"))
        engine.publish(Removed([h("gpu")], medium="GPU"))
        await eventually(lambda: _tier_is(coord, first, Tier.CPU), what="demoted to CPU")
        assert (await lookup(coord, PROMPT)) == {WORKER: 4}
        engine.publish(Removed([h("gpu")], medium="CPU"))
        await shows(coord, PROMPT, {})
        assert tier(coord, first) is None
        assert bridge.malformed == {}


async def _tier_is(coord: RunningCoordinator, key: bytes, expected: Tier) -> bool:
    return tier(coord, key) is expected


@pytest.mark.parametrize("encoding", [Encoding.VLLM_MAP, Encoding.VLLM_ARRAY,
                                      Encoding.SGLANG_ARRAY], ids=lambda e: e.value)
async def test_omitted_fields_take_their_defaults(encoding: Encoding) -> None:
    """The shortest forms: an array of tag + the four fields every release sent; a map without
    parent_block_hash (a root block), lora_*, medium; a removal without medium; a batch without
    the data-parallel rank (vLLM before PR #18925)."""
    engine_name = "sglang" if encoding is Encoding.SGLANG_ARRAY else "vllm"
    async with setup(encoding=encoding, engine=engine_name) as (coord, engine, bridge):
        engine.publish(Stored([h("o-0")], None, PROMPT[:4], P, omit=True),
                       Stored([h("o-1")], h("o-0"), PROMPT[4:8], P, omit=True), dp_rank=None)
        await shows(coord, PROMPT, {WORKER: 8})
        assert [tier(coord, k) for k in keys(PROMPT[:8])] == [Tier.GPU, Tier.GPU]
        engine.publish(Removed([h("o-1")], omit=True), dp_rank=None)
        await shows(coord, PROMPT, {WORKER: 4})
        assert bridge.malformed == {}


NEWER_STORED_FIELDS = {  # what vLLM added after lora_name, in declaration order, then a future one
    "extra_keys": [None], "group_idx": 0, "kv_cache_spec_kind": "full_attention",
    "kv_cache_spec_sliding_window": None, "locality": "LOCAL", "ownership": None,
    "session_id": "req-7", "a_field_from_the_future": {"nested": [1, b"\x00"]},
}


@pytest.mark.parametrize("encoding", [Encoding.VLLM_MAP, Encoding.VLLM_ARRAY],
                         ids=lambda e: e.value)
async def test_unknown_fields_and_unknown_event_types_are_ignored(encoding: Encoding) -> None:
    unknown_array = ["BlockMigrated", [h("m-0")], "peer"]
    unknown_map = {"type": "CacheLevelUpdated", "block_hashes": [h("m-0")], "level": 2}
    async with setup(encoding=encoding) as (coord, engine, bridge):
        stored = encode_batch([Stored([h("n-0")], None, PROMPT[:4], P,
                                      extra=NEWER_STORED_FIELDS)], encoding)
        # An unknown event type between two known ones: skipped, the rest of the batch applies.
        raw = msgspec.msgpack.decode(stored)
        second = encode_batch([Stored([h("n-1")], h("n-0"), PROMPT[4:8], P,
                                      extra=NEWER_STORED_FIELDS)], encoding)
        raw[1] += [unknown_array, unknown_map, *msgspec.msgpack.decode(second)[1]]
        engine.publish_payload(msgspec.msgpack.encode(raw))
        await shows(coord, PROMPT, {WORKER: 8})
        engine.publish(Removed([h("n-1")], extra={"group_idx": 0, "locality": "LOCAL"}))
        await shows(coord, PROMPT, {WORKER: 4})
        assert bridge.malformed == {"unknown_event": 2}


# ---------------------------------------------------------------------- bad input


def garbage_events() -> list[Any]:
    """Events of known types with the wrong fields (each counted "event"), one unknown type,
    one block size that is not a multiple of the page size."""
    return [
        ["BlockStored", "not-a-list", None, [1, 2, 3, 4], P],
        {"type": "BlockStored", "block_hashes": [h("g-1")], "parent_block_hash": None,
         "token_ids": ["a", "b", "c", "d"], "block_size": P},
        {"type": "BlockStored", "token_ids": [1, 2, 3, 4], "block_size": P},  # no hashes
        ["BlockStored", [h("g-3")], None, [1, 2, 3], P],  # 3 tokens for one block of 4
        {"type": "BlockStored", "block_hashes": [h("g-4")], "token_ids": [1, 2, 3, 4],
         "block_size": "four"},
        ["BlockRemoved", 7],
        ["BlockMigrated", [h("g-5")], "peer"],  # unknown_event
        ["BlockStored", [h("g-6")], None, list(range(6)), 6],  # block_size
    ]


async def test_garbage_of_every_kind_is_counted_skipped_and_survived() -> None:
    async with setup() as (coord, engine, bridge):
        engine.publish(Stored([h("ok-0")], None, PROMPT[:4], P))
        await shows(coord, PROMPT, {WORKER: 4})
        seq = SEQ.pack(engine.next_seq)
        good = encode_batch([Cleared()], Encoding.VLLM_MAP)  # never applied: the frames are bad
        for frames in ([TOPIC, seq], [TOPIC, seq, good, b"extra"], [TOPIC, seq[:7], good],
                       [b"just one frame"]):
            engine.send_frames(frames)
        for payload in (b"\xc1", b"\x93\x01"):  # never-used byte; array of 3 with 1 element
            engine.publish_payload(payload)
        for batch in (42, [1.0], ["yesterday", []], [1.0, "events"]):
            engine.publish_payload(msgspec.msgpack.encode(batch))
        payload = msgspec.msgpack.decode(encode_batch(
            [Stored([h("ok-1")], h("ok-0"), PROMPT[4:8], P)], Encoding.VLLM_MAP))
        payload[1] = [*garbage_events(), *payload[1]]  # the good event after the bad ones
        engine.publish_payload(msgspec.msgpack.encode(payload))
        await shows(coord, PROMPT, {WORKER: 8})
        engine.publish(Stored([h("ok-2")], h("ok-1"), PROMPT[8:12], P))
        await shows(coord, PROMPT, {WORKER: 12})
        assert bridge.malformed == {"frame": 4, "msgpack": 2, "batch": 4, "event": 6,
                                    "unknown_event": 1, "block_size": 1}
        assert (bridge.last_seq, bridge.replays, bridge.rebuilds) == (engine.next_seq - 1, 0, 0)
        assert (await lookup(coord, list(range(6)))) == {}


async def test_an_unknown_parent_is_skipped_with_its_descendants() -> None:
    """A block chained on a hash the bridge never saw cannot get its keys: it and its children
    are skipped, a miss, never stored as if they started a prompt."""
    async with setup() as (coord, engine, bridge):
        engine.publish(Stored([h("orphan-0")], h("never-seen"), PROMPT[4:8], P),
                       Stored([h("orphan-1")], h("orphan-0"), PROMPT[8:12], P),
                       Stored([h("root")], None, OTHER[:4], P))
        await shows(coord, OTHER, {WORKER: 4})
        assert (await lookup(coord, PROMPT[4:12])) == {}
        assert coord.service.index.worker_keys(WORKER) == frozenset(keys(OTHER[:4]))
        assert bridge.malformed == {"unknown_parent": 2}


async def test_an_engine_hash_collision_is_skipped_never_a_wrong_hit() -> None:
    """SGLang's early radix cache hashed each page's tokens alone, so one page after two
    different prefixes has one engine hash. The second store of the hash (other keys) is
    skipped; the removal then takes the first one's keys, which it named: no key is left behind
    that the engine no longer holds."""
    a, b, shared = [1, 1, 1, 1], [2, 2, 2, 2], [9, 9, 9, 9]
    page = h("page-9999", "sglang")
    async with setup(encoding=Encoding.SGLANG_ARRAY, engine="sglang") as (coord, engine,
                                                                          bridge):
        engine.publish(Stored([h("a", "sglang"), page], None, [*a, *shared], P))
        await shows(coord, [*a, *shared], {WORKER: 8})
        engine.publish(Stored([h("b", "sglang"), page], None, [*b, *shared], P))
        await eventually(lambda: _lookup_nonempty(coord, [*b, *shared]), what="b stored")
        assert (await lookup(coord, [*b, *shared])) == {WORKER: 4}
        assert bridge.malformed == {"hash_collision": 1}
        engine.publish(Removed([page]))
        await shows(coord, [*a, *shared], {WORKER: 4})
        assert coord.service.index.worker_keys(WORKER) == frozenset(
            [keys(a)[0], keys(b)[0]])


async def _lookup_nonempty(coord: RunningCoordinator, tokens: Sequence[int]) -> bool:
    return bool(await lookup(coord, tokens))


async def test_removing_blocks_never_stored_is_counted_and_harmless() -> None:
    async with setup() as (coord, engine, bridge):
        engine.publish(Stored([h("kept")], None, PROMPT[:4], P))
        engine.publish(Removed([h("never")]))
        engine.publish(Stored([h("kept-2")], h("kept"), PROMPT[4:8], P))
        await shows(coord, PROMPT, {WORKER: 8})
        assert bridge.malformed == {"unknown_block": 1}


# ---------------------------------------------------------------------- gaps, replay, rebuild


@pytest.mark.parametrize("style", list(ReplayStyle), ids=lambda s: s.value)
async def test_a_gap_is_filled_by_replay_in_both_reply_styles(style: ReplayStyle) -> None:
    async with setup(replay=style) as (coord, engine, bridge):
        engine.publish(Stored([h("r-0")], None, PROMPT[:4], P))
        await shows(coord, PROMPT, {WORKER: 4})
        engine.publish(Stored([h("r-1")], h("r-0"), PROMPT[4:8], P), deliver=False)  # lost
        engine.publish(Stored([h("r-2")], h("r-1"), PROMPT[8:12], P))
        await shows(coord, PROMPT, {WORKER: 12})
        assert engine.replay_requests == [1]
        assert engine.bad_replay_requests == []
        assert (bridge.last_seq, bridge.replays, bridge.rebuilds, bridge.malformed) == (
            2, 1, 0, {})
        # The stream goes on after the replay.
        engine.publish(Removed([h("r-2")]))
        await shows(coord, PROMPT, {WORKER: 8})


async def test_a_first_sequence_number_above_zero_replays_from_zero() -> None:
    engine = EnginePublisher(replay=ReplayStyle.LEGACY)
    try:
        async with running_coordinator(page_size=P) as coord:
            # Published before the bridge started: only the replay buffer has them.
            engine.publish(Stored([h("s-0")], None, PROMPT[:4], P), deliver=False)
            engine.publish(Stored([h("s-1")], h("s-0"), PROMPT[4:8], P), deliver=False)
            async with bridged(coord, engine) as bridge:
                engine.publish(Stored([h("s-2")], h("s-1"), PROMPT[8:12], P))
                await shows(coord, PROMPT, {WORKER: 12})
                assert engine.replay_requests == [0]
                assert (bridge.last_seq, bridge.replays, bridge.rebuilds) == (2, 1, 0)
    finally:
        engine.close()


async def test_without_replay_a_gap_drops_the_workers_entries_and_rebuilds() -> None:
    async with setup(replay=None) as (coord, engine, bridge):
        engine.publish(Stored([h("x-0"), h("x-1")], None, PROMPT[:8], P))
        await shows(coord, PROMPT, {WORKER: 8})
        engine.publish(Removed([h("x-1")]), deliver=False)  # lost: what else was lost?
        engine.publish(Stored([h("y-0")], None, OTHER[:4], P))  # shows the gap
        await shows(coord, PROMPT, {})  # nothing the bridge said before the gap is trusted
        await shows(coord, OTHER, {WORKER: 4})  # the batch after the gap applies
        assert (bridge.last_seq, bridge.replays, bridge.rebuilds) == (2, 0, 1)
        assert coord.service.index.worker_keys(WORKER) == frozenset(keys(OTHER[:4]))
        engine.publish(Stored([h("x-0b")], None, PROMPT[:4], P))  # later events apply again
        await shows(coord, PROMPT, {WORKER: 4})


async def test_a_replay_that_no_longer_holds_the_gap_rebuilds() -> None:
    """The engine keeps only its last ``buffer_steps`` batches: a gap older than that cannot be
    replayed, so the bridge rebuilds as if there were no replay."""
    async with setup(buffer_steps=1) as (coord, engine, bridge):
        engine.publish(Stored([h("t-0")], None, PROMPT[:4], P))
        await shows(coord, PROMPT, {WORKER: 4})
        engine.publish(Removed([h("t-0")]), deliver=False)
        engine.publish(Stored([h("t-1")], None, OTHER[:4], P), deliver=False)
        engine.publish(Stored([h("t-2")], h("t-1"), OTHER[4:8], P))  # the buffer holds only this
        await shows(coord, PROMPT, {})
        assert engine.replay_requests == [1]
        assert (bridge.last_seq, bridge.rebuilds) == (3, 1)
        assert (await lookup(coord, OTHER)) == {}  # chained on t-1, which never arrived
        assert bridge.malformed == {"unknown_parent": 1}


async def test_a_replay_socket_that_never_answers_rebuilds() -> None:
    silent = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    engine = EnginePublisher(replay=None)
    try:
        async with running_coordinator(page_size=P) as coord, bridged(
                coord, engine, replay=silent) as bridge:
            engine.publish(Stored([h("u-0")], None, PROMPT[:4], P))
            await shows(coord, PROMPT, {WORKER: 4})
            engine.publish(Stored([h("u-1")], h("u-0"), PROMPT[4:8], P), deliver=False)
            engine.publish(Stored([h("u-2")], None, OTHER[:4], P))
            await shows(coord, OTHER, {WORKER: 4}, timeout=10)
            assert (await lookup(coord, PROMPT)) == {}
            assert (bridge.replays, bridge.rebuilds) == (0, 1)
    finally:
        engine.close()


async def test_an_engine_restart_starts_again_at_sequence_zero() -> None:
    """A restarted engine publishes from sequence 0 with an empty cache: the bridge must drop
    what the old process held and follow the new stream, not wait for it to pass the old
    sequence numbers."""
    async with setup() as (coord, engine, bridge):
        for i in range(3):
            engine.publish(Stored([h(f"old-{i}")], h(f"old-{i - 1}") if i else None,
                                  PROMPT[4 * i:4 * i + 4], P))
        await shows(coord, PROMPT, {WORKER: 12})
        engine.restart()
        await engine.wait_subscribed()
        engine.publish(Stored([h("new-0")], None, OTHER[:4], P))
        await shows(coord, OTHER, {WORKER: 4}, timeout=3)
        await shows(coord, PROMPT, {})
        assert bridge.last_seq == 0


# ---------------------------------------------------------------------- the external worker


async def test_the_bridge_is_an_external_worker_outside_policy_barriers() -> None:
    engine = EnginePublisher()
    later = EnginePublisher()
    try:
        async with running_coordinator(page_size=P) as coord, \
                bridged(coord, engine, engine_url="http://engine.local:8000") as _, \
                AsyncCoordinatorClient(target(coord)) as client:
            [info] = await client.workers()
            assert (info.worker_id, info.address, info.external, info.policy_version,
                    info.state, info.http_url) == (WORKER, ADDRESS, True, 0, "ready",
                                                   "http://engine.local:8000")
            engine.publish(Stored([h("v-0"), h("v-1")], None, PROMPT[:8], P))
            await shows(coord, PROMPT, {WORKER: 8})
            route = await client.route(PROMPT, model=MODEL)
            assert (route.worker_id, route.address, route.matched_tokens, route.http_url) == (
                WORKER, ADDRESS, 8, "http://engine.local:8000")  # where gateways forward

            # A sync update has no member to wait for: the external worker is not fenced.
            async with client.policy_update(0) as update:
                pass
            assert update.result is not None
            assert (update.result.version, update.result.acked_workers,
                    update.result.fenced_workers) == (1, (), ())
            [info] = await client.workers()
            assert (info.external, info.policy_version, info.state) == (True, 0, "ready")
            # It serves version 0 still: found there, not under the new version.
            assert (await lookup(coord, PROMPT, policy_version=0)) == {WORKER: 8}
            assert (await lookup(coord, PROMPT)) == {}

            # After the engine reloads, a bridge given the new version serves it.
            async with bridged(coord, later, worker_id="engine-1",
                               policy_version=1) as second:
                later.publish(Stored([h("w-0")], None, PROMPT[:4], P))
                await shows(coord, PROMPT, {"engine-1": 4})
                assert {w.worker_id: (w.external, w.policy_version)
                        for w in await client.workers()} == {
                    WORKER: (True, 0), "engine-1": (True, 1)}
                assert second.malformed == {}
    finally:
        engine.close()
        later.close()


# ---------------------------------------------------------------------- the command line


async def test_kvcoord_bridge_vllm_follows_an_engine_and_stops_on_sigterm() -> None:
    engine = EnginePublisher(encoding=Encoding.VLLM_MAP, replay=ReplayStyle.CURRENT)
    metrics = free_port()
    try:
        async with running_coordinator(page_size=P) as coord:
            process = spawn(["bridge", "vllm", *EXTERNAL, "--events", engine.events, "--replay",
                             str(engine.replay), "--coordinator", target(coord), "--worker-id",
                             WORKER, "--worker-address", ADDRESS, "--model", MODEL,
                             "--page-size", str(P), "--metrics-port", str(metrics),
                             "--log-level", "warning"])
            try:
                async with AsyncCoordinatorClient(target(coord)) as client:
                    async def registered() -> bool:
                        assert process.poll() is None, process.stderr and process.stderr.read()
                        return [w.worker_id for w in await client.workers()] == [WORKER]

                    await eventually(registered, timeout=20, what="the bridge registered")
                    await engine.wait_subscribed(timeout=20)
                    engine.publish(Stored([h("c-0")], None, PROMPT[:4], P))
                    engine.publish(Stored([h("c-1")], h("c-0"), PROMPT[4:8], P), deliver=False)
                    engine.publish(Stored([h("c-2")], h("c-1"), PROMPT[8:12], P))
                    await shows(coord, PROMPT, {WORKER: 12})
                    engine.send_frames([b"garbage"])
                    engine.publish(Removed([h("c-2")]))
                    await shows(coord, PROMPT, {WORKER: 8})
                    body = await asyncio.to_thread(_scrape, metrics)
                    # No --http-listen, no --metrics-host: /metrics is on loopback only.
                    assert not await asyncio.to_thread(_answers, "127.0.0.2", metrics)
                    for line in ('kvcoord_bridge_malformed_total{kind="frame"} 1.0',
                                 "kvcoord_bridge_replays_total 1.0",
                                 "kvcoord_bridge_rebuilds_total 0.0",
                                 "kvcoord_bridge_last_seq 3.0"):
                        assert line in body, body
                    process.send_signal(signal.SIGTERM)
                    assert await asyncio.to_thread(process.wait, 15) == 0
                    assert await client.workers() == []  # it deregistered on the way out
            finally:
                stop_process(process)
    finally:
        engine.close()


def _scrape(port: int, host: str = "127.0.0.1") -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def _answers(host: str, port: int) -> bool:
    """Whether ``host:port`` serves the bridge's ``/metrics`` (False: connection refused)."""
    try:
        return "kvcoord_bridge_last_seq" in _scrape(port, host)
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ConnectionRefusedError):
            return False
        raise


async def test_kvcoord_bridge_serves_metrics_on_the_metrics_host_alone() -> None:
    """127.0.0.2 is this machine's loopback too (Linux routes 127/8 to lo), but a socket bound
    to it does not answer on 127.0.0.1. No coordinator answers: /metrics is up before the
    bridge registers."""
    metrics = free_port()
    process = spawn(["bridge", "vllm", *BRIDGE_ARGS, *EXTERNAL, "--metrics-port", str(metrics),
                     "--metrics-host", "127.0.0.2", "--log-level", "error"])
    try:
        async def serving() -> bool:
            assert process.poll() is None, process.stderr and process.stderr.read()
            return await asyncio.to_thread(_answers, "127.0.0.2", metrics)

        await eventually(serving, timeout=20, what="the bridge's /metrics on 127.0.0.2")
        assert not await asyncio.to_thread(_answers, "127.0.0.1", metrics)
    finally:
        stop_process(process)


@pytest.mark.parametrize(("settings", "host"), [
    ({}, "127.0.0.1"),
    ({"policy_control": False, "http_listen": "0.0.0.0:8100"}, "0.0.0.0"),
    ({"policy_control": True, "engine_url": "http://127.0.0.1:8000",
      "http_listen": "10.0.0.7:8100"}, "10.0.0.7"),
    ({"policy_control": True, "engine_url": "http://127.0.0.1:8000",
      "http_listen": "[::1]:8100"}, "::1"),
    ({"http_listen": "0.0.0.0:8100", "metrics_host": "127.0.0.1"}, "127.0.0.1"),
], ids=["loopback", "http-listen", "policy-control", "ipv6", "metrics-host"])
def test_bridge_metrics_bind_http_listens_host_else_loopback(
    settings: dict[str, Any], host: str,
) -> None:
    config = BridgeConfig(events="tcp://127.0.0.1:1", coordinator="127.0.0.1:1",
                          worker_id=WORKER, worker_address=ADDRESS, **settings)
    assert config.metrics_bind_host() == host


BRIDGE_ARGS = ["--events", "tcp://127.0.0.1:5557", "--coordinator", "127.0.0.1:1",
               "--worker-id", "w", "--worker-address", "10.0.0.1:8000", "--page-size", "16"]
EXTERNAL = ["--no-policy-control"]


@pytest.mark.parametrize(("extra", "env", "message"), [
    ([*EXTERNAL, "--engine-block-size", "24"], {},
     "kvcoord bridge: engine block size 24 is not a multiple of the page size 16"),
    ([*EXTERNAL, "--worker-address", "nocolon"], {}, "HOST:PORT"),
    ([*EXTERNAL, "--events", "127.0.0.1:5557"], {}, "tcp://"),
    (EXTERNAL, {"KVCOORD_HASH_KEY": "not-hex"}, "hash key"),
    ([*EXTERNAL, "--engine-url", "engine:8000"], {},
     "--engine-url must be an http:// or https:// URL"),
    ([], {}, "policy control needs --engine-url"),
    (["--engine-url", "http://127.0.0.1:8000"], {}, "policy control needs --http-listen"),
    (["--engine-url", "http://127.0.0.1:8000", "--http-listen", "127.0.0.1:0"], {},
     "policy control needs --http-listen HOST:PORT"),
    ([*EXTERNAL, "--metrics-port", "70000"], {}, "--metrics-port must be 0..65535, got 70000"),
    ([*EXTERNAL, "--metrics-host", ""], {}, "--metrics-host must not be empty"),
    ([*EXTERNAL, "--metrics-port", "0", "--metrics-host", "203.0.113.5"], {},
     "kvcoord bridge: cannot serve /metrics on 203.0.113.5:0 (--metrics-host, --metrics-port): "
     "Cannot assign requested address"),
], ids=["block-size", "worker-address", "events-endpoint", "hash-key", "engine-url",
        "no-engine-url", "no-http-listen", "http-listen-port-0", "metrics-port",
        "empty-metrics-host", "metrics-host-not-here"])
def test_kvcoord_bridge_refuses_bad_config_with_one_line(
    extra: list[str], env: dict[str, str], message: str,
) -> None:
    import os

    result = child_process.run(
        [sys.executable, "-m", "kvcoord.cli", "bridge", "vllm", *BRIDGE_ARGS, *extra],
        capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL,
        env={**os.environ, "KVCOORD_LOG_LEVEL": "warning", **env},
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr[-2000:]
    assert message in result.stderr
