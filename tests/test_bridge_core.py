"""The bridge's pure core: engine events in both encodings decode alike; engine blocks map to
exactly the page keys a reference worker computes; media and removals resolve to the fastest
tier still held; what cannot be chained or understood is refused by kind."""

from __future__ import annotations

import msgspec
import pytest

from coordinator.core.hashing import DEV_HASH_KEY, HashConfig, Namespace, PageHasher
from coordinator.core.index import PrefixIndex, Tier
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
    array = payload(["BlockStored", [1, 2], None, TOKENS[:16], 8, None, "GPU", None, None, 0,
                     "full_attention"],
                    ["BlockRemoved", [b"\x01" * 32], "CPU", 0], ["AllBlocksCleared"])
    named = payload({"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
                     "token_ids": TOKENS[:16], "block_size": 8, "medium": "GPU",
                     "group_idx": 0, "kv_cache_spec_kind": "full_attention",
                     "a_field_of_a_later_release": 1},  # unknown fields: ignored
                    {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": "CPU",
                     "group_idx": 0},
                    {"type": "AllBlocksCleared"})
    expected = (BlockStored((1, 2), None, tuple(TOKENS[:16]), 8, None, "GPU", None,
                            group_idx=0, spec_kind="full_attention"),
                BlockRemoved((b"\x01" * 32,), "CPU", 0), AllBlocksCleared())
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
    (BlockStored((1,), None, tuple(TOKENS[:4]), 4, medium="NVMe-oF"), "medium"),
])
def test_what_cannot_be_mapped_is_refused_by_kind(event: BlockStored, kind: str) -> None:
    blocks = _map()
    with pytest.raises(MalformedInput) as refused:
        blocks.stored(event)
    assert refused.value.kind == kind
    assert len(blocks) == 0


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


# The medium strings engines publish, as they publish them (issue 18). Sources read for this
# test: vLLM main (vllm/distributed/kv_events.py MEDIUM_GPU = "GPU", published by the block
# pool since v0.10; vllm/v1/kv_offload/mediums.py CPULoadStoreSpec.medium() == "CPU", the
# OffloadingConnector of v0.11.0 on, and DiskLoadStoreSpec.medium() == "Disk" in the kv_offload
# tree that has a disk tier; MooncakeStoreConnector publishes "cpu"); LMCache dev
# (lmcache/v1/cache_engine.py LMCacheEngine.store: CacheStoreEvent(medium="cpu"), which vLLM's
# LMCacheConnectorV1.take_events re-publishes as BlockStored; the MP connector's events carry
# "CPU", LMCache PR #5076).
PUBLISHED_MEDIA = [
    ("GPU", Tier.GPU),  # vLLM's own KV cache
    ("CPU", Tier.CPU),  # vLLM OffloadingConnector (CPU backend); LMCache MP connector
    ("cpu", Tier.CPU),  # LMCache LMCacheEngine via LMCacheConnectorV1; vLLM Mooncake store
    ("Disk", Tier.DISK),  # vLLM kv_offload DiskLoadStoreSpec (older releases)
    ("STORAGE", Tier.DISK),  # vLLM 0.32 kv_events.MEDIUM_STORAGE: its fs and object tiers
]


def _index_fed(*payloads: bytes) -> tuple[PrefixIndex, list[bytes], list[tuple[str, str]]]:
    """Feed published payloads through the bridge's decoding and block map into an index, as
    the bridge does (its page events applied in order); the keys of TOKENS[:8] and the events
    skipped."""
    blocks, index = _map(), PrefixIndex(clock=lambda: 0.0)
    skipped: list[tuple[str, str]] = []
    for raw in payloads:
        batch = decode_payload(raw)
        skipped.extend(batch.skipped)
        for event in batch.events:
            try:
                if isinstance(event, BlockStored):
                    page_events, _ = blocks.stored(event)
                elif isinstance(event, BlockRemoved):
                    page_events, _ = blocks.removed(event)
                else:
                    continue
            except MalformedInput as exc:
                skipped.append((exc.kind, str(exc)))
                continue
            index.apply("engine", page_events)
    keys = PageHasher(HASH).page_keys(TOKENS[:8], Namespace(model="m", policy_version=3,
                                                            page_size=PAGE))
    return index, keys, skipped


def _stored_map(medium: str, hashes: list[int], tokens: list[int]) -> dict[str, object]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": tokens, "block_size": PAGE, "lora_id": None, "medium": medium,
            "lora_name": None}


@pytest.mark.parametrize(("medium", "tier"), PUBLISHED_MEDIA)
def test_each_published_medium_lands_in_its_tier(medium: str, tier: Tier) -> None:
    # The map encoding (vLLM 0.26 and later) and the tagged array (older vLLM, LMCache).
    as_map = payload(_stored_map(medium, [1, 2], TOKENS[:8]))
    as_array = payload(["BlockStored", [1, 2], None, TOKENS[:8], PAGE, None, medium, None])
    for raw in (as_map, as_array):
        index, keys, skipped = _index_fed(raw)
        assert skipped == []
        assert [index.tier_of("engine", k) for k in keys] == [tier, tier]


def test_an_offloaded_copy_takes_over_when_the_gpu_copy_goes() -> None:
    # vLLM frees the GPU block after the CPU offload (LMCache's "cpu" carries tokens): the
    # index holds the key in CPU, one tier per (worker, key).
    index, keys, skipped = _index_fed(
        payload(_stored_map("GPU", [1, 2], TOKENS[:8])),
        payload(_stored_map("cpu", [1, 2], TOKENS[:8])),
        payload({"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"}),
    )
    assert skipped == []
    assert [index.tier_of("engine", k) for k in keys] == [Tier.GPU, Tier.CPU]


def test_a_stored_event_without_token_ids_is_skipped_never_credited() -> None:
    # vLLM's OffloadingConnector announces CPU copies by hash alone (parent None, token_ids [],
    # block_size the offloaded block's or 0), its hashes the raw block-hash bytes where the GPU
    # events carry ints (maybe_convert_block_hash under VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES):
    # the bridge cannot chain them, so they are refused by kind and the GPU holding stands.
    offloaded = _stored_map("CPU", [b"\x07" * 32], [])
    index, keys, skipped = _index_fed(payload(_stored_map("GPU", [1], TOKENS[:4])),
                                      payload(offloaded))
    assert [kind for kind, _ in skipped] == ["event"]
    assert index.tier_of("engine", keys[0]) is Tier.GPU


@pytest.mark.parametrize("medium", ["LocalDiskBackend", "CXL", "NVMe-oF"])
def test_an_unknown_medium_is_refused_by_kind_and_named(medium: str) -> None:
    index, _, skipped = _index_fed(payload(_stored_map(medium, [1], TOKENS[:4])))
    assert [kind for kind, _ in skipped] == ["medium"]
    assert f"unknown medium {medium!r}" in skipped[0][1]
    assert index.held_count("engine") == 0
