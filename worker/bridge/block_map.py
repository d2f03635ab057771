"""Engine blocks -> our page keys: what the bridge tells the coordinator for each engine event.

An engine block of ``k * page_size`` tokens is ``k`` of our pages. Its keys continue the chain of
its parent block (the engine names it by hash), so they equal the keys a reference worker
computes for the same prompt: a scheduler's Lookup of the prompt finds the engine. A block
whose parent was never seen (the bridge started mid-stream, or lost events) cannot be chained
and is skipped: a miss, never a wrong hit.

What the engine keyed a block on besides its tokens is keyed here too, so two blocks share our
keys only when the engine would share its own: the LoRA name is the namespace's adapter; a
cache salt, images (``(identifier, offset)``) and prompt-embedding digests are bound into the
chain (``PageHasher.bind``) before the block's tokens.

A block is held as a set of *residencies*, ``(group, tier, ownership)``: the KV-cache group
(hybrid models keep full-attention and sliding-window or Mamba groups under the same block
hashes), the medium it is in (GPU, a CPU or disk offload copy), and which secondary offload tier
owns the copy. Only groups a prefix can be served from are held (``SERVABLE_KINDS``); each
group's kind is learned from its stored events, so a removal in a sliding-window group (which
carries only its group index) never drops what full attention still holds. The coordinator is
told the fastest tier a block is still in.

A residency counts its copies. Two requests that compute the same uncached prefix at once
each fill a block of it, and vLLM caches both under one hash (its hash-to-block map holds
several blocks per hash), publishing a BlockStored for each and, as each is evicted, a
BlockRemoved for each. The block is gone only when its last copy is: dropping it at the first
removal made the index forget blocks the engine still serves.

A page key counts the blocks that cover it. vLLM 0.32 also caches a prompt's tail that ends
inside a block as a *partial* entry (its own hash, a BlockStored of fewer tokens than a block),
so one engine can hold a page under two hashes: a partial entry and the full block another
request computed. A key is removed only when no block covers it any more: removing the partial
entry's page while the full block still held it made the index stop one block short of what
the engine serves. (A key another block still covers keeps the tier it is indexed in; the two
are one engine's GPU blocks in every case vLLM publishes.)

Pure: no zmq, no grpc.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from coordinator.core.hashing import Namespace, PageHasher
from coordinator.core.index import PageEvent, PagesRemoved, PagesStored, Tier
from worker.bridge.engine_events import (
    BlockExtras,
    BlockRemoved,
    BlockStored,
    EngineHash,
    MalformedInput,
)

# The ``medium`` strings engines publish, compared case-blind (tests/test_bridge_core.py feeds
# each, naming its source): vLLM's own KV cache "GPU" (kv_events.MEDIUM_GPU); vLLM's
# OffloadingConnector "CPU" and "STORAGE" (kv_events.MEDIUM_CPU, MEDIUM_STORAGE: its file-system
# and object-store tiers) and "Disk" where an older kv_offload had DiskLoadStoreSpec; LMCache
# "cpu" (LMCacheEngine.store's CacheStoreEvent, re-published by vLLM's LMCacheConnectorV1) and
# "CPU" (its MP connector). Anything else is refused as an unknown medium: a miss, never a
# wrong tier.
_MEDIA = {"gpu": Tier.GPU, "cpu": Tier.CPU, "disk": Tier.DISK, "storage": Tier.DISK}
_FASTEST_FIRST = (Tier.GPU, Tier.CPU, Tier.DISK)

# vLLM's KVCacheSpecKind values (v1/kv_cache_interface.py). A prefix is served from a group
# whose every block of the prefix is kept: full attention, MLA and sink-full attention. A
# sliding-window, chunked-local or Mamba group keeps only a recent window (or one state), an
# encoder-only or cross-attention group holds no prompt prefix: their blocks are not held.
SERVABLE_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
KNOWN_KINDS = SERVABLE_KINDS | {"sliding_window", "sliding_window_mla", "mamba",
                                "chunked_local_attention", "encoder_only_attention",
                                "cross_attention", "unknown"}
# Releases before vLLM PR #40984 publish no kind: they have one group, full attention.
_UNSTATED_KIND = "full_attention"
_LOCAL = (None, "LOCAL")

Residency = tuple[int | None, Tier, str | None]
"""(KV-cache group, tier, secondary-tier ownership) a block is held in."""


@dataclass(slots=True)
class _Block:
    keys: tuple[bytes, ...]
    held: dict[Residency, int] = field(default_factory=dict)
    """Copies held in each residency (the module docstring: an engine may hold several)."""

    def tier(self) -> Tier:
        tiers = {tier for _, tier, _ in self.held}
        return next(t for t in _FASTEST_FIRST if t in tiers)


class BlockMap:
    """The engine's blocks as the bridge knows them, and the page events each change means."""

    def __init__(self, hasher: PageHasher, *, model: str, policy_version: int,
                 page_size: int) -> None:
        self._hasher = hasher
        self._model = model
        self._version = policy_version
        self._page_size = page_size
        self._blocks: dict[EngineHash, _Block] = {}
        self._covers: dict[bytes, int] = {}  # page key -> blocks covering it (module doc)
        self.group_kinds: dict[int | None, str] = {}
        """Each KV-cache group's kind, as the engine's stored events state it."""

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def policy_version(self) -> int:
        return self._version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        """Key blocks stored from now on under ``version`` (the engine's weights changed; its
        cache was cleared, so no held block is keyed under the old one)."""
        self._version = version

    def stored(self, event: BlockStored) -> tuple[list[PageEvent], list[MalformedInput]]:
        """Stored events for the event's blocks, and the blocks skipped: a hash already held
        with other tokens (an engine whose hash does not chain, e.g. early SGLang hashing a
        page's tokens alone) keeps its first keys, which its removal will name.

        MalformedInput (the whole event skipped, by kind) for: a block size that is not a
        multiple of the page size (``block_size``); a medium we do not know (``medium``); a
        REMOTE copy, which this engine would fetch, not hold (``remote``), or another locality
        (``locality``); a group kind we do not know (``spec_kind``) or one a prefix is not
        served from (``group_not_servable``); a cache salt past the prompt's first block
        (``extra_keys``); a parent never seen (``unknown_parent``)."""
        if event.block_size % self._page_size:
            raise MalformedInput("block_size", f"engine block size {event.block_size} is not a "
                                               f"multiple of the page size {self._page_size}")
        self._check_locality(event.locality)
        self._check_group(event)
        residency = (event.group_idx, _tier(event.medium), event.ownership)
        parent = self._chain_start(event)
        out: dict[Tier, list[bytes]] = {}
        skipped: list[MalformedInput] = []
        size = event.block_size
        for i, block_hash in enumerate(event.block_hashes):
            extras = event.extras[i] if event.extras else None
            if extras is not None and extras.binds_content():
                parent = self._hasher.bind(parent, _content(extras))
            keys = tuple(self._hasher.extend(parent, event.token_ids[i * size:(i + 1) * size],
                                             self._page_size))
            parent = keys[-1]
            block = self._blocks.get(block_hash)
            if block is None:
                block = self._blocks[block_hash] = _Block(keys)
                for key in keys:
                    self._covers[key] = self._covers.get(key, 0) + 1
            elif block.keys != keys:
                skipped.append(MalformedInput(
                    "hash_collision", f"engine block {block_hash!r:.40} stored again with other "
                                      "tokens: the first is kept"))
                continue
            block.held[residency] = block.held.get(residency, 0) + 1
            out.setdefault(block.tier(), []).extend(keys)
        return [PagesStored(tuple(keys), t) for t, keys in out.items()], skipped

    def removed(self, event: BlockRemoved) -> tuple[list[PageEvent], int]:
        """Page events for the removal, and how many of its hashes were not held in that
        residency. A removal in a group whose kind is not servable changes nothing (those
        blocks were never held); MalformedInput ``medium`` for a medium we do not know."""
        kind = self.group_kinds.get(event.group_idx, _UNSTATED_KIND)
        if kind not in SERVABLE_KINDS:
            return [], 0
        residency = (event.group_idx, _tier(event.medium), event.ownership)
        gone: list[bytes] = []
        moved: dict[Tier, list[bytes]] = {}
        unknown = 0
        for block_hash in event.block_hashes:
            block = self._blocks.get(block_hash)
            if block is None or residency not in block.held:
                unknown += 1
                continue
            block.held[residency] -= 1
            if block.held[residency] > 0:
                continue  # another copy in the same residency: nothing changed
            del block.held[residency]
            if block.held:  # still in another group, medium or tier: held there
                moved.setdefault(block.tier(), []).extend(
                    k for k in block.keys if self._covers[k] == 1)
            else:
                del self._blocks[block_hash]
                gone.extend(self._uncover(block.keys))
        events: list[PageEvent] = [PagesStored(tuple(keys), t) for t, keys in moved.items()
                                   if keys]
        if gone:
            events.append(PagesRemoved(tuple(gone)))
        return events, unknown

    def _uncover(self, keys: tuple[bytes, ...]) -> list[bytes]:
        """A block covering ``keys`` is gone: the keys no block covers any more."""
        gone = []
        for key in keys:
            left = self._covers[key] - 1
            if left:
                self._covers[key] = left
            else:
                del self._covers[key]
                gone.append(key)
        return gone

    def clear(self) -> None:
        self._blocks.clear()
        self._covers.clear()

    def inventory(self) -> dict[Tier, list[bytes]]:
        """Every key held, by the fastest tier it is in (for a resync or a re-registration)."""
        out: dict[Tier, list[bytes]] = {}
        for block in self._blocks.values():
            out.setdefault(block.tier(), []).extend(block.keys)
        return out

    # ------------------------------------------------------------------ checks and chains

    def _check_locality(self, locality: str | None) -> None:
        if locality == "REMOTE":
            raise MalformedInput("remote", "a REMOTE copy is another host's: not credited to "
                                           "this engine")
        if locality not in _LOCAL:
            raise MalformedInput("locality", f"unknown locality {locality!r:.20}")

    def _check_group(self, event: BlockStored) -> None:
        kind = event.spec_kind
        if kind is not None:
            if kind not in KNOWN_KINDS:
                raise MalformedInput("spec_kind", f"unknown KV-cache spec kind {kind!r:.30}")
            self.group_kinds[event.group_idx] = kind
        else:
            kind = self.group_kinds.get(event.group_idx, _UNSTATED_KIND)
        if kind not in SERVABLE_KINDS:
            raise MalformedInput("group_not_servable", f"group {event.group_idx} is {kind}: "
                                                       "no prefix is served from it")

    def _chain_start(self, event: BlockStored) -> bytes:
        """The chain point the event's first block continues: its parent's last key, or the
        namespace's root (bound to the cache salt, when the prompt has one)."""
        salts = [e.cache_salt for e in event.extras if e is not None and e.cache_salt]
        if salts and (event.parent_block_hash is not None or event.extras[0] is None
                      or event.extras[0].cache_salt is None or len(salts) > 1):
            raise MalformedInput("extra_keys", "a cache salt keys only a prompt's first block")
        if event.parent_block_hash is not None:
            known = self._blocks.get(event.parent_block_hash)
            if known is None:
                raise MalformedInput(
                    "unknown_parent",
                    f"parent block {event.parent_block_hash!r:.40} was never stored: cannot chain",
                )
            return known.keys[-1]
        # The salt binds the root (Namespace.cache_salt), as vLLM binds it into the prompt's
        # first block: a gateway routing the request with its salt computes the same keys.
        return self._hasher.root(Namespace(
            model=self._model, adapter=_adapter(event), policy_version=self._version,
            page_size=self._page_size, cache_salt=(salts[0] if salts else event.cache_salt) or ""))


def _content(extras: BlockExtras) -> bytes:
    """A block's images and prompt-embedding digests, tagged by source as vLLM tags them in its
    own block hash (the salt is bound at the root: ``Namespace.cache_salt``)."""
    parts: list[object] = [["mm", ident, offset] for ident, offset in extras.media]
    parts += [["prompt_embeds", digest] for digest in extras.embeds]
    return msgspec.msgpack.encode(parts)


def _adapter(event: BlockStored) -> str:
    """The hash namespace's adapter: the LoRA's name; releases that name a LoRA only by id get
    ``lora-id:<id>``, so its KV is never taken for the base model's (a scheduler asking with
    that adapter name still finds it)."""
    if event.lora_name:
        return event.lora_name
    return f"lora-id:{event.lora_id}" if event.lora_id is not None else ""


def _tier(medium: str | None) -> Tier:
    if medium is None:
        return Tier.GPU
    tier = _MEDIA.get(medium.lower())
    if tier is None:
        raise MalformedInput("medium", f"unknown medium {medium!r:.20}")
    return tier
