"""Every field vLLM 0.32 publishes in a block event, handled on purpose (docs/BRIDGE.md's field
table names the test for each row): LoRA blocks keyed in their adapter's namespace; cache
salts, images and prompt embeddings bound into the keys, so the same tokens without them (or
with others) never share a key; hybrid models' groups held apart, so a sliding-window eviction
never drops what full attention holds; remote copies, offload tiers by ownership; and every
malformed shape skipped by its own kind, never misread."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from structlog.testing import capture_logs

from coordinator.core.hashing import DEV_HASH_KEY, HashConfig, Namespace, PageHasher
from coordinator.core.index import PagesRemoved, PagesStored, Tier
from worker.bridge.block_map import BlockMap
from worker.bridge.engine_events import BlockExtras, BlockStored, MalformedInput, decode_payload

PAGE = 4
HASH = HashConfig(key=DEV_HASH_KEY, page_size=PAGE)
TOKENS = list(range(200, 216))
MODEL = "m"
VERSION = 2


def stored(hashes: list[int], tokens: list[int], *, parent: int | None = None,
           **fields: Any) -> dict[str, Any]:
    """A BlockStored as vLLM 0.32 publishes it (the map encoding)."""
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": PAGE, "lora_id": None, "medium": "GPU",
            "lora_name": None, **fields}


def removed(hashes: list[int], **fields: Any) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", **fields}


def decoded(event: dict[str, Any] | list[Any]) -> Any:
    batch = decode_payload(msgspec.msgpack.encode([1.0, [event], 0]))
    if batch.skipped:
        raise MalformedInput(*batch.skipped[0])
    return batch.events[0]


def fresh_map() -> BlockMap:
    return BlockMap(PageHasher(HASH), model=MODEL, policy_version=VERSION, page_size=PAGE)


def keys_of(blocks: BlockMap, *events: dict[str, Any]) -> list[bytes]:
    out: list[bytes] = []
    for event in events:
        page_events, skipped = blocks.stored(decoded(event))
        assert skipped == []
        out += [k for e in page_events for k in e.keys]
    return out


def plain_keys(tokens: list[int], adapter: str = "") -> list[bytes]:
    return PageHasher(HASH).page_keys(tokens, Namespace(model=MODEL, adapter=adapter,
                                                       policy_version=VERSION, page_size=PAGE))


# ---------------------------------------------------------------------------------- LoRA


def test_a_lora_block_is_keyed_in_its_adapter_namespace_as_a_scheduler_hashes_it() -> None:
    # vLLM 0.32 puts the adapter's name in every LoRA block's extra_keys (to_event_extra_keys).
    lora = stored([1, 2], TOKENS[:8], lora_id=1, lora_name="sql",
                  extra_keys=[["sql"], ["sql"]])
    keys = keys_of(fresh_map(), lora)
    assert keys == plain_keys(TOKENS[:8], adapter="sql")
    assert set(keys).isdisjoint(plain_keys(TOKENS[:8]))  # never the base model's
    assert set(keys).isdisjoint(plain_keys(TOKENS[:8], adapter="chat"))


def test_extra_keys_naming_another_adapter_than_the_event_are_refused() -> None:
    event = stored([1], TOKENS[:4], lora_name="sql", extra_keys=[["chat"]])
    with pytest.raises(MalformedInput) as refused:
        decoded(event)
    assert refused.value.kind == "extra_keys"


# ---------------------------------------------------------------------------- cache salt


def test_a_salted_prompt_shares_keys_only_with_the_same_salt() -> None:
    def salted(salt: str) -> list[bytes]:
        return keys_of(fresh_map(), stored([1], TOKENS[:4], extra_keys=[[salt]]),
                       stored([2], TOKENS[4:8], parent=1))

    tenant_a, tenant_b = salted("tenant-a"), salted("tenant-b")
    assert tenant_a == salted("tenant-a")
    assert set(tenant_a).isdisjoint(tenant_b)
    assert set(tenant_a).isdisjoint(plain_keys(TOKENS[:8]))
    # What a scheduler routing the prompt with its salt computes (Scope.cache_salt).
    assert tenant_a == PageHasher(HASH).page_keys(TOKENS[:8], Namespace(
        model=MODEL, policy_version=VERSION, page_size=PAGE, cache_salt="tenant-a"))


def test_sglang_salts_its_blocks_as_vllm_does() -> None:
    vllm = keys_of(fresh_map(), stored([1], TOKENS[:4], extra_keys=[["s"]]))
    sglang_map = keys_of(fresh_map(), stored([1], TOKENS[:4], cache_salt="s"))
    # SGLang's array puts a metadata map where vLLM has lora_name.
    sglang_array = keys_of(fresh_map(), ["BlockStored", [1], None, TOKENS[:4], PAGE, None,
                                         "GPU", {"cache_salt": "s"}])
    assert vllm == sglang_map == sglang_array


def test_a_salt_past_the_first_block_is_refused() -> None:
    blocks = fresh_map()
    keys_of(blocks, stored([1], TOKENS[:4]))
    for event in (stored([2], TOKENS[4:8], parent=1, extra_keys=[["s"]]),
                  stored([3, 4], TOKENS[:8], extra_keys=[None, ["s"]])):
        with pytest.raises(MalformedInput) as refused:
            blocks.stored(decoded(event))
        assert refused.value.kind == "extra_keys"


# ------------------------------------------------------------------- images, embeddings


def test_images_are_bound_into_their_blocks_and_everything_after() -> None:
    # Block 1 is text; block 2 starts image "cat" at offset 1; block 3 is text after it.
    def prompt(image: str, offset: int = 1) -> list[bytes]:
        return keys_of(fresh_map(), stored([1, 2, 3], TOKENS[:12],
                                           extra_keys=[None, [[image, offset]], None]))

    cat = prompt("cat")
    assert cat == prompt("cat")  # the same image, named the same: a hit
    assert cat[0] == plain_keys(TOKENS[:4])[0]  # the text before it is plain text
    dog = prompt("dog")
    assert dog[0] == cat[0] and set(dog[1:]).isdisjoint(cat[1:])
    assert set(prompt("cat", offset=2)[1:]).isdisjoint(cat[1:])
    assert set(cat[1:]).isdisjoint(plain_keys(TOKENS[:12]))  # never the text alone


def test_prompt_embeddings_are_bound_by_their_digest() -> None:
    def prompt(digest: bytes) -> list[bytes]:
        return keys_of(fresh_map(), stored([1], TOKENS[:4], extra_keys=[[digest]]))

    assert prompt(b"\x01" * 32) == prompt(b"\x01" * 32)
    assert set(prompt(b"\x01" * 32)).isdisjoint(prompt(b"\x02" * 32) + plain_keys(TOKENS[:4]))


def test_every_extra_key_vllm_publishes_decodes_in_its_order() -> None:
    event = decoded(stored([1], TOKENS[:4], lora_name="sql",
                           extra_keys=[["sql", ["img", 0], ["vid", -3], "salt", b"\x09" * 32]]))
    assert event.extras == (BlockExtras("sql", (("img", 0), ("vid", -3)), "salt",
                                        (b"\x09" * 32,)),)
    assert decoded(stored([1], TOKENS[:4], extra_keys=[None])).extras == ()


@pytest.mark.parametrize("extra_keys", [
    "sql",  # not a list
    [None, None],  # two entries for one block
    [[["img"]]],  # a media pair without its offset
    [[["img", "zero"]]],  # an offset that is not an int
    [["salt", ["img", 0]]],  # a media pair after the salt: out of vLLM's order
    [[b"\x01", "salt"]],  # a salt after a digest
    [["salt", "salt-again"]],  # two salts
    [[3.5]],  # a float
    [{"mm": "img"}],  # an entry that is not a list
])
def test_malformed_extra_keys_are_skipped_by_kind_never_misread(extra_keys: Any) -> None:
    with pytest.raises(MalformedInput) as refused:
        decoded(stored([1], TOKENS[:4], extra_keys=extra_keys))
    assert refused.value.kind == "extra_keys"


# ------------------------------------------------------------------------ hybrid models


def test_a_sliding_window_eviction_never_drops_what_full_attention_holds() -> None:
    blocks = fresh_map()
    full = keys_of(blocks, stored([1, 2], TOKENS[:8], group_idx=0,
                                  kv_cache_spec_kind="full_attention"))
    with pytest.raises(MalformedInput) as refused:
        blocks.stored(decoded(stored([1, 2], TOKENS[:8], group_idx=1,
                                     kv_cache_spec_kind="sliding_window",
                                     kv_cache_spec_sliding_window=8)))
    assert refused.value.kind == "group_not_servable"
    assert blocks.group_kinds == {0: "full_attention", 1: "sliding_window"}
    # The window slides: group 1 frees block 1 (removals carry only the group's index).
    events, unknown = blocks.removed(decoded(removed([1], group_idx=1)))
    assert (events, unknown, len(blocks)) == ([], 0, 2)
    events, unknown = blocks.removed(decoded(removed([1], group_idx=0)))
    assert (events, unknown) == ([PagesRemoved(tuple(full[:1]))], 0)


def test_blocks_of_each_servable_kind_are_held() -> None:
    for group, kind in enumerate(("full_attention", "mla_attention", "sink_full_attention")):
        blocks = fresh_map()
        assert keys_of(blocks, stored([1], TOKENS[:4], group_idx=group,
                                      kv_cache_spec_kind=kind)) == plain_keys(TOKENS[:4])


@pytest.mark.parametrize("kind", ["mamba", "chunked_local_attention", "sliding_window_mla",
                                  "encoder_only_attention", "cross_attention", "unknown"])
def test_groups_no_prefix_is_served_from_are_not_held(kind: str) -> None:
    blocks = fresh_map()
    with pytest.raises(MalformedInput) as refused:
        blocks.stored(decoded(stored([1], TOKENS[:4], group_idx=1, kv_cache_spec_kind=kind)))
    assert (refused.value.kind, len(blocks)) == ("group_not_servable", 0)


def test_an_unknown_spec_kind_is_skipped_by_kind() -> None:
    with pytest.raises(MalformedInput) as refused:
        fresh_map().stored(decoded(stored([1], TOKENS[:4], kv_cache_spec_kind="quantum")))
    assert refused.value.kind == "spec_kind"


# ------------------------------------------------------------- locality, ownership, ids


def test_a_remote_copy_is_not_credited_as_this_engines() -> None:
    blocks = fresh_map()
    for locality, kind in (("REMOTE", "remote"), ("nearby", "locality")):
        with pytest.raises(MalformedInput) as refused:
            blocks.stored(decoded(stored([1], TOKENS[:4], medium="STORAGE", locality=locality)))
        assert refused.value.kind == kind
    assert keys_of(blocks, stored([1], TOKENS[:4], medium="STORAGE", locality="LOCAL"))
    assert blocks.inventory() == {Tier.DISK: plain_keys(TOKENS[:4])}


def test_a_block_cached_twice_is_held_until_its_last_copy_is_evicted() -> None:
    # Two requests computed the same prefix at once: vLLM caches both blocks under one hash,
    # publishing a BlockStored for each, then a BlockRemoved as each copy is evicted.
    blocks = fresh_map()
    keys = keys_of(blocks, stored([1, 2], TOKENS[:8]))
    assert keys_of(blocks, stored([1, 2], TOKENS[:8])) == keys  # the second copy
    events, unknown = blocks.removed(decoded(removed([2])))
    assert (events, unknown, len(blocks)) == ([], 0, 2)  # block 2's other copy still serves
    events, unknown = blocks.removed(decoded(removed([2])))
    assert (events, unknown) == ([PagesRemoved(tuple(keys[1:]))], 0)
    events, unknown = blocks.removed(decoded(removed([2])))  # no copy left
    assert (events, unknown) == ([], 1)
    assert blocks.inventory() == {Tier.GPU: keys[:1]}


def test_a_partial_entry_leaves_the_pages_the_full_block_still_covers() -> None:
    # vLLM 0.32 caches a prompt tail ending inside a block as a partial entry of its own hash
    # (a BlockStored of fewer tokens than a block); another request then computes the full
    # block under the full hash. The partial entry's removal must not drop the page the full
    # block still covers (the index stopped one block short of what the engine served).
    blocks = fresh_map()
    keys_of(blocks, stored([1], TOKENS[:8], block_size=8))
    partial = keys_of(blocks, stored([20], TOKENS[8:12], parent=1, block_size=4))
    full = keys_of(blocks, stored([2], TOKENS[8:16], parent=1, block_size=8))
    assert partial == full[:1] == plain_keys(TOKENS[:12])[2:]
    events, unknown = blocks.removed(decoded(removed([20])))
    assert (events, unknown) == ([], 0)  # the full block still covers that page
    events, unknown = blocks.removed(decoded(removed([2])))
    assert (events, unknown) == ([PagesRemoved(tuple(full))], 0)


def test_copies_in_two_secondary_tiers_are_held_apart_by_ownership() -> None:
    blocks = fresh_map()
    keys = keys_of(blocks, stored([1], TOKENS[:4], medium="STORAGE", ownership="fs"),
                   stored([1], TOKENS[:4], medium="STORAGE", ownership="kvcr"))
    events, _ = blocks.removed(decoded(removed([1], medium="STORAGE", ownership="fs")))
    assert events == [PagesStored(tuple(keys[:1]), Tier.DISK)]  # still in the kvcr tier
    events, _ = blocks.removed(decoded(removed([1], medium="STORAGE", ownership="kvcr")))
    assert events == [PagesRemoved(tuple(keys[:1]))]


def test_session_id_is_decoded_and_keys_nothing() -> None:
    event = decoded(stored([1], TOKENS[:4], session_id="conversation-7"))
    assert isinstance(event, BlockStored) and event.session_id == "conversation-7"
    assert keys_of(fresh_map(), stored([1], TOKENS[:4], session_id="x")) == plain_keys(
        TOKENS[:4])


# --------------------------------------------------------------------------- skip log


def test_a_kind_of_skip_is_logged_at_most_once_a_minute_and_always_counted() -> None:
    from worker.bridge.bridge import Bridge, BridgeConfig

    bridge = Bridge(BridgeConfig(events="tcp://127.0.0.1:1", coordinator="127.0.0.1:1",
                                 worker_id="w", worker_address="127.0.0.1:2"))
    now = [0.0]
    bridge.clock = lambda: now[0]
    with capture_logs() as logs:
        for second in (0, 1, 59, 60, 61):
            now[0] = float(second)
            bridge._skip("remote", "a remote copy")
        bridge._skip("medium", "unknown medium")
    lines = [(e["kind"], e["total"], e["since_last_line"]) for e in logs
             if e["event"] == "bridge.malformed"]
    assert lines == [("remote", 1, 1), ("remote", 4, 3), ("medium", 1, 1)]
    assert bridge.malformed == {"remote": 5, "medium": 1}
