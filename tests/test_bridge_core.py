"""The bridge's pure core: engine events in both encodings decode alike; engine blocks map to
exactly the page keys a reference worker computes; media and removals resolve to the fastest
tier still held; what cannot be chained or understood is refused by kind."""

from __future__ import annotations

import msgspec
import pytest

from coordinator.core.hash_config import DEV_HASH_KEY, HashConfig, Namespace
from coordinator.core.hashing import PageHasher
from coordinator.core.index_types import Tier
from worker.bridge.block_map import BlockMap
from worker.bridge.engine_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    MalformedInput,
    decode_payload,
)

PAGE = 4
HASH = HashConfig(key=DEV_HASH_KEY, page_size=PAGE)
TOKENS = list(range(100, 124))


def payload(*events: object, rank: object = 0) -> bytes:
    return msgspec.msgpack.encode([1.5, list(events), rank])


def test_both_encodings_decode_to_the_same_events() -> None:
    array = payload(["BlockStored", [1, 2], None, TOKENS[:16], 8, None, "GPU", None],
                    ["BlockRemoved", [b"\x01" * 32], "CPU"], ["AllBlocksCleared"])
    named = payload({"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
                     "token_ids": TOKENS[:16], "block_size": 8, "medium": "GPU",
                     "group_idx": 0, "kv_cache_spec_kind": "full"},  # newer fields: ignored
                    {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": "CPU"},
                    {"type": "AllBlocksCleared"})
    expected = (BlockStored((1, 2), None, tuple(TOKENS[:16]), 8, None, "GPU", None),
                BlockRemoved((b"\x01" * 32,), "CPU"), AllBlocksCleared())
    assert decode_payload(array).events == expected
    assert decode_payload(named).events == expected


def test_omitted_trailing_fields_take_their_defaults() -> None:
    batch = decode_payload(msgspec.msgpack.encode(
        [1.0, [["BlockStored", [7], None, TOKENS[:4], 4], ["BlockRemoved", [7]]]]))
    assert batch.dp_rank is None
    assert batch.events == (BlockStored((7,), None, tuple(TOKENS[:4]), 4),
                            BlockRemoved((7,)))


@pytest.mark.parametrize(("raw", "kind"), [
    (b"\xc1", "msgpack"),
    (msgspec.msgpack.encode({"ts": 1}), "batch"),
    (msgspec.msgpack.encode(["now", []]), "batch"),
])
def test_a_bad_payload_is_refused_whole_by_kind(raw: bytes, kind: str) -> None:
    with pytest.raises(MalformedInput) as refused:
        decode_payload(raw)
    assert refused.value.kind == kind


def test_bad_events_are_skipped_by_kind_and_the_rest_of_the_batch_stands() -> None:
    batch = decode_payload(payload(
        ["Teleported", 1],
        ["BlockStored", [1], None, TOKENS[:3], 4],  # 3 tokens for one block of 4
        ["BlockStored", [True], None, TOKENS[:4], 4],
        {"type": "BlockRemoved", "block_hashes": "nope"},
        "a string",
        ["AllBlocksCleared"],
    ))
    assert batch.events == (AllBlocksCleared(),)
    assert [kind for kind, _ in batch.skipped] == [
        "unknown_event", "event", "event", "event", "event"]


def _map() -> BlockMap:
    return BlockMap(PageHasher(HASH), model="m", policy_version=3, page_size=PAGE)


def test_chained_blocks_give_the_keys_a_reference_worker_computes() -> None:
    blocks = _map()
    first, _ = blocks.stored(BlockStored((10,), None, tuple(TOKENS[:8]), 8))
    rest, _ = blocks.stored(BlockStored((11, 12), 10, tuple(TOKENS[8:24]), 8))
    keys = [k for e in (*first, *rest) for k in e.keys]
    assert keys == PageHasher(HASH).page_keys(TOKENS, Namespace(model="m", policy_version=3,
                                                                page_size=PAGE))
    lora, _ = blocks.stored(BlockStored((20,), None, tuple(TOKENS[:4]), 4, lora_name="sql"))
    assert list(lora[0].keys) == PageHasher(HASH).page_keys(
        TOKENS[:4], Namespace(model="m", adapter="sql", policy_version=3, page_size=PAGE))


def test_a_block_held_in_two_media_is_reported_in_the_fastest_still_held() -> None:
    blocks = _map()
    gpu, _ = blocks.stored(BlockStored((10,), None, tuple(TOKENS[:4]), 4, medium="GPU"))
    assert [(e.kind, e.tier) for e in gpu] == [("stored", Tier.GPU)]
    cpu, _ = blocks.stored(BlockStored((10,), None, tuple(TOKENS[:4]), 4, medium="CPU"))
    assert [(e.kind, e.tier) for e in cpu] == [("stored", Tier.GPU)]  # still in GPU too
    events, unknown = blocks.removed(BlockRemoved((10, 99), "GPU"))
    assert ([(e.kind, e.tier) for e in events], unknown) == ([("stored", Tier.CPU)], 1)
    events, _ = blocks.removed(BlockRemoved((10,), "cpu"))
    assert [(e.kind, e.keys) for e in events] == [("removed", gpu[0].keys)]
    assert len(blocks) == 0


@pytest.mark.parametrize(("event", "kind"), [
    (BlockStored((1,), None, tuple(TOKENS[:6]), 6), "block_size"),
    (BlockStored((1,), 77, tuple(TOKENS[:4]), 4), "unknown_parent"),
    (BlockStored((1,), None, tuple(TOKENS[:4]), 4, medium="NVMe-oF"), "event"),
])
def test_what_cannot_be_mapped_is_refused_by_kind(event: BlockStored, kind: str) -> None:
    blocks = _map()
    with pytest.raises(MalformedInput) as refused:
        blocks.stored(event)
    assert refused.value.kind == kind
    assert len(blocks) == 0


def test_blocks_keyed_on_more_than_tokens_are_skipped_never_merged() -> None:
    plain, images, salted = (decode_payload(payload(event)).events[0] for event in (
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
         "token_ids": TOKENS[:4], "block_size": 4, "extra_keys": [None]},
        ["BlockStored", [2], None, TOKENS[:4], 4, None, "GPU", None, [["img-sha", 0]]],
        {"type": "BlockStored", "block_hashes": [3], "parent_block_hash": None,
         "token_ids": TOKENS[:4], "block_size": 4, "cache_salt": "tenant-a"},
    ))
    blocks = _map()
    assert blocks.stored(plain)[0]  # extra_keys of None only: plain text
    for event in (images, salted):
        with pytest.raises(MalformedInput) as refused:
            blocks.stored(event)
        assert refused.value.kind == "salted"
    assert len(blocks) == 1


@pytest.mark.parametrize("key", [None, ""])
def test_an_unset_or_empty_hash_key_is_the_development_key_as_everywhere_else(
    key: str | None,
) -> None:
    from worker.bridge.bridge import BridgeConfig

    config = BridgeConfig(events="tcp://127.0.0.1:1", coordinator="127.0.0.1:1",
                          worker_id="e0", worker_address="127.0.0.1:8000", hash_key=key)
    assert config.hash_config().key == DEV_HASH_KEY
    with pytest.raises(ValueError, match=r"16\.\.64 bytes"):
        BridgeConfig(events="tcp://127.0.0.1:1", coordinator="127.0.0.1:1", worker_id="e0",
                     worker_address="127.0.0.1:8000", hash_key="abcd").hash_config()
