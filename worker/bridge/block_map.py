"""Engine blocks -> our page keys: what the bridge tells the coordinator for each engine event.

An engine block of ``k * page_size`` tokens is ``k`` of our pages. Its keys continue the chain of
its parent block (the engine names it by hash), so they equal the keys a reference worker
computes for the same prompt: a scheduler's Lookup of the prompt finds the engine. A block
whose parent was never seen (the bridge started mid-stream, or lost events) cannot be chained
and is skipped: a miss, never a wrong hit. A block may sit in several media (GPU and a CPU
offload copy); the coordinator is told the fastest it is in.

Pure: no zmq, no grpc.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.core.hashing import Namespace, PageHasher
from coordinator.core.index import PageEvent, PagesRemoved, PagesStored, Tier
from worker.bridge.engine_events import BlockRemoved, BlockStored, EngineHash, MalformedInput

# The ``medium`` strings engines publish, compared case-blind (tests/test_bridge_core.py feeds
# each, naming its source): vLLM's own KV cache "GPU" (kv_events.MEDIUM_GPU); vLLM's
# OffloadingConnector "CPU" (kv_offload CPULoadStoreSpec.medium()) and "Disk" where a
# kv_offload release has DiskLoadStoreSpec; LMCache "cpu" (LMCacheEngine.store's
# CacheStoreEvent, re-published by vLLM's LMCacheConnectorV1) and "CPU" (its MP connector).
# Anything else is refused as an unknown medium: a miss, never a wrong tier.
_MEDIA = {"gpu": Tier.GPU, "cpu": Tier.CPU, "disk": Tier.DISK}
_FASTEST_FIRST = (Tier.GPU, Tier.CPU, Tier.DISK)


@dataclass(slots=True)
class _Block:
    keys: tuple[bytes, ...]
    media: set[Tier] = field(default_factory=set)

    def tier(self) -> Tier:
        return next(t for t in _FASTEST_FIRST if t in self.media)


class BlockMap:
    """The engine's blocks as the bridge knows them, and the page events each change means."""

    def __init__(self, hasher: PageHasher, *, model: str, policy_version: int,
                 page_size: int) -> None:
        self._hasher = hasher
        self._model = model
        self._version = policy_version
        self._page_size = page_size
        self._blocks: dict[EngineHash, _Block] = {}

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
        page's tokens alone) keeps its first keys, which its removal will name. MalformedInput
        for a block size that is not a multiple of the page size, a medium we do not know, or a
        parent never seen."""
        if event.block_size % self._page_size:
            raise MalformedInput("block_size", f"engine block size {event.block_size} is not a "
                                               f"multiple of the page size {self._page_size}")
        if event.salted:
            raise MalformedInput("salted", "the engine keyed these blocks on more than their "
                                           "tokens (extra_keys / cache_salt): skipped, a miss")
        tier = _tier(event.medium)
        if event.parent_block_hash is None:
            parent = self._hasher.root(Namespace(
                model=self._model, adapter=_adapter(event),
                policy_version=self._version, page_size=self._page_size))
        else:
            known = self._blocks.get(event.parent_block_hash)
            if known is None:
                raise MalformedInput(
                    "unknown_parent",
                    f"parent block {event.parent_block_hash!r:.40} was never stored: cannot chain",
                )
            parent = known.keys[-1]
        out: dict[Tier, list[bytes]] = {}
        skipped: list[MalformedInput] = []
        size = event.block_size
        for i, block_hash in enumerate(event.block_hashes):
            keys = tuple(self._hasher.extend(parent, event.token_ids[i * size:(i + 1) * size],
                                             self._page_size))
            parent = keys[-1]
            block = self._blocks.get(block_hash)
            if block is None:
                block = self._blocks[block_hash] = _Block(keys)
            elif block.keys != keys:
                skipped.append(MalformedInput(
                    "hash_collision", f"engine block {block_hash!r:.40} stored again with other "
                                      "tokens: the first is kept"))
                continue
            block.media.add(tier)
            out.setdefault(block.tier(), []).extend(keys)
        return [PagesStored(tuple(keys), t) for t, keys in out.items()], skipped

    def removed(self, event: BlockRemoved) -> tuple[list[PageEvent], int]:
        """Page events for the removal, and how many of its hashes were unknown."""
        tier = _tier(event.medium)
        gone: list[bytes] = []
        moved: dict[Tier, list[bytes]] = {}
        unknown = 0
        for block_hash in event.block_hashes:
            block = self._blocks.get(block_hash)
            if block is None:
                unknown += 1
                continue
            block.media.discard(tier)
            if block.media:  # still in another medium: now held there
                moved.setdefault(block.tier(), []).extend(block.keys)
            else:
                del self._blocks[block_hash]
                gone.extend(block.keys)
        events: list[PageEvent] = [PagesStored(tuple(keys), t) for t, keys in moved.items()]
        if gone:
            events.append(PagesRemoved(tuple(gone)))
        return events, unknown

    def clear(self) -> None:
        self._blocks.clear()

    def inventory(self) -> dict[Tier, list[bytes]]:
        """Every key held, by the fastest tier it is in (for a resync or a re-registration)."""
        out: dict[Tier, list[bytes]] = {}
        for block in self._blocks.values():
            out.setdefault(block.tier(), []).extend(block.keys)
        return out


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
        raise MalformedInput("event", f"unknown medium {medium!r:.20}")
    return tier
