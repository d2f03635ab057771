"""The KV-cache events vLLM and SGLang publish, decoded from their msgpack payload.

A payload is ``[ts, [event, ...], data_parallel_rank]`` (the rank may be missing). An event is
either a positional array tagged by its class name (older vLLM, SGLang):
``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name, ...]``, ``["BlockRemoved", block_hashes, medium, ...]``, ``["AllBlocksCleared"]``; or
a map with a ``"type"`` field and named fields (vLLM 0.26 and later; 0.32.0 is checked by
``make test-vllm``). Trailing fields may be missing (engines omit defaults), hashes are ints
or bytes. Every field vLLM 0.32 publishes is decoded (``extra_keys`` into typed ``BlockExtras``);
fields of later releases are ignored until a row of docs/BRIDGE.md's field table handles them.
docs/PROTOCOL.md §8 lists the formats and the releases they come from.

Pure: no zmq, no grpc. Anything that does not fit raises ``MalformedInput`` with a ``kind``
the bridge counts by.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

EngineHash = int | bytes


class MalformedInput(ValueError):
    """Input the bridge skips; ``kind`` names the counter it goes to."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class BlockExtras:
    """What the engine keyed one block on besides its tokens and its parent: vLLM's
    ``extra_keys`` entry for the block, published untagged (``to_event_extra_keys``) in this
    order: the LoRA name, ``(mm_identifier, offset)`` pairs, the cache salt, prompt-embedding
    digests. ``offset`` is where the item starts, counted from the block's first token (negative
    when it began in an earlier block)."""

    lora_name: str | None = None
    media: tuple[tuple[str, int], ...] = ()
    cache_salt: str | None = None
    embeds: tuple[bytes, ...] = ()

    def binds_content(self) -> bool:
        """True when the block's KV depends on more than its tokens and the chain before it
        (images, prompt embeddings): its keys must bind these too."""
        return bool(self.media or self.embeds)


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    # One entry per block (None: tokens alone), or () when the event carries none.
    extras: tuple[BlockExtras | None, ...] = ()
    # SGLang's request-wide salt (its metadata map, or the map encoding's field).
    cache_salt: str | None = None
    group_idx: int | None = None  # the KV-cache group (hybrid models have several)
    spec_kind: str | None = None  # that group's attention kind (vLLM KVCacheSpecKind)
    sliding_window: int | None = None
    locality: str | None = None  # LOCAL or REMOTE, relative to the engine
    ownership: str | None = None  # which secondary offload tier, when several
    session_id: str | None = None  # the request context that stored or reused the blocks


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


EngineEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EngineBatch:
    ts: float
    events: tuple[EngineEvent, ...]
    dp_rank: int | None
    # Events skipped inside an otherwise good batch: (kind, message) each.
    skipped: tuple[tuple[str, str], ...] = ()


# In vLLM's declaration order (the array encoding is positional). SGLang's arrays put a
# metadata map ({"cache_salt": ...}) at lora_name's position.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                  "kv_cache_spec_sliding_window", "locality", "ownership", "session_id")
_STORED_NAMED = (*_STORED_FIELDS, "cache_salt")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
_DECODER = msgspec.msgpack.Decoder()


def decode_payload(payload: bytes) -> EngineBatch:
    """The batch in one published (or replayed) payload."""
    try:
        raw = _DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise MalformedInput("msgpack", f"payload is not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise MalformedInput("batch", f"payload is not [ts, [events...], dp_rank]: {raw!r:.120}")
    ts, events = raw[0], raw[1]
    dp_rank = raw[2] if len(raw) > 2 else None
    if not _is_number(ts) or not (dp_rank is None or _is_int(dp_rank)):
        raise MalformedInput("batch", f"bad ts or dp_rank in batch header: {raw[:1]!r}, "
                                      f"{dp_rank!r}")
    decoded: list[EngineEvent] = []
    skipped: list[tuple[str, str]] = []
    for event in events:
        try:
            decoded.append(decode_event(event))
        except MalformedInput as exc:
            skipped.append((exc.kind, str(exc)))
    return EngineBatch(float(ts), tuple(decoded), dp_rank, tuple(skipped))


def decode_event(raw: Any) -> EngineEvent:
    """One event in either encoding."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        fields = raw
    elif isinstance(raw, list) and raw:
        tag = raw[0]
        fields = None
    else:
        raise MalformedInput("event", f"an event is a tagged array or a map, got {raw!r:.80}")
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if tag == "BlockStored":
        values = _named(fields, _STORED_NAMED) if fields is not None else _positional(
            raw[1:], _STORED_FIELDS)
        return _stored(values)
    if tag == "BlockRemoved":
        values = _named(fields, _REMOVED_FIELDS) if fields is not None else _positional(
            raw[1:], _REMOVED_FIELDS)
        return BlockRemoved(_hashes(values["block_hashes"]), _optional_str(values, "medium"),
                            _optional_int(values, "group_idx"),
                            _optional_str(values, "locality"), _optional_str(values, "ownership"))
    raise MalformedInput("unknown_event", f"unknown event type {tag!r:.40}")


def _named(fields: dict[Any, Any], names: Sequence[str]) -> dict[str, Any]:
    return {name: fields.get(name) for name in names}


def _positional(values: list[Any], names: Sequence[str]) -> dict[str, Any]:
    # Trailing fields may be omitted (defaults); extra trailing fields are newer releases'.
    return {name: values[i] if i < len(values) else None for i, name in enumerate(names)}


def _stored(values: dict[str, Any]) -> BlockStored:
    hashes = _hashes(values["block_hashes"])
    parent = values["parent_block_hash"]
    if parent is not None and not _is_hash(parent):
        raise MalformedInput("event", f"parent_block_hash must be an int or bytes: {parent!r}")
    tokens = values["token_ids"]
    if not isinstance(tokens, list) or not all(_is_int(t) and 0 <= t < 2**32 for t in tokens):
        raise MalformedInput("event", "token_ids must be a list of uint32 token ids")
    block_size = values["block_size"]
    if not _is_int(block_size) or block_size <= 0:
        raise MalformedInput("event", f"block_size must be a positive int: {block_size!r}")
    if len(tokens) != len(hashes) * block_size:
        raise MalformedInput("event", f"{len(tokens)} token ids for {len(hashes)} blocks of "
                                      f"{block_size}")
    lora_id = values["lora_id"]
    if lora_id is not None and not _is_int(lora_id):
        raise MalformedInput("event", f"lora_id must be an int: {lora_id!r}")
    salt = values.get("cache_salt")
    if isinstance(values["lora_name"], dict):  # SGLang's array: its metadata map is here
        salt = values["lora_name"].get("cache_salt")
        values = {**values, "lora_name": None}
    if salt is not None and not isinstance(salt, str):
        raise MalformedInput("event", f"cache_salt must be a string: {salt!r:.40}")
    lora_name = _optional_str(values, "lora_name")
    window = _optional_int(values, "kv_cache_spec_sliding_window")
    return BlockStored(
        hashes, parent, tuple(tokens), block_size, lora_id, _optional_str(values, "medium"),
        lora_name, extras_of(values["extra_keys"], len(hashes), lora_name), salt or None,
        _optional_int(values, "group_idx"), _optional_str(values, "kv_cache_spec_kind"), window,
        _optional_str(values, "locality"), _optional_str(values, "ownership"),
        _optional_str(values, "session_id"))


def extras_of(raw: Any, blocks: int, lora_name: str | None) -> tuple[BlockExtras | None, ...]:
    """vLLM's untagged ``extra_keys`` -> one ``BlockExtras`` (or None) per block; () for none.

    The entries are told apart by shape and order, as vLLM publishes them: the LoRA name
    first (exactly when ``lora_name`` is set, and equal to it), ``[identifier, offset]``
    pairs, one string (the cache salt), then bytes (prompt-embedding digests).
    MalformedInput ``extra_keys`` for anything else: the event is skipped, never misread."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) != blocks:
        raise MalformedInput("extra_keys", f"extra_keys must be a list with one entry per block "
                                           f"({blocks}), got {raw!r:.80}")
    out: list[BlockExtras | None] = []
    for entry in raw:
        if entry is None:
            out.append(None)
            continue
        if not isinstance(entry, list):
            raise MalformedInput("extra_keys", f"a block's extra keys are a list: {entry!r:.60}")
        out.append(_block_extras(entry, lora_name))
    return tuple(out) if any(e is not None for e in out) else ()


def _block_extras(entry: list[Any], lora_name: str | None) -> BlockExtras:
    items = list(entry)
    lora = None
    if lora_name is not None:
        if not items or items[0] != lora_name:
            raise MalformedInput("extra_keys", f"a LoRA block's extra keys start with its "
                                               f"lora_name {lora_name!r:.40}: {entry!r:.60}")
        lora = items.pop(0)
    media: list[tuple[str, int]] = []
    salt: str | None = None
    embeds: list[bytes] = []
    for item in items:
        if isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) \
                and _is_int(item[1]) and salt is None and not embeds:
            media.append((item[0], item[1]))
        elif isinstance(item, str) and salt is None and not embeds:
            salt = item
        elif isinstance(item, bytes):
            embeds.append(item)
        else:
            raise MalformedInput("extra_keys", f"extra key {item!r:.40} is not a LoRA name, "
                                               "[identifier, offset], a salt or a digest in "
                                               "vLLM's order")
    return BlockExtras(lora, tuple(media), salt, tuple(embeds))


def _hashes(raw: Any) -> tuple[EngineHash, ...]:
    if not isinstance(raw, list) or not raw or not all(_is_hash(h) for h in raw):
        raise MalformedInput("event", "block_hashes must be a non-empty list of ints or bytes")
    return tuple(raw)


def _optional_int(values: dict[str, Any], name: str) -> int | None:
    value = values.get(name)
    if value is not None and not _is_int(value):
        raise MalformedInput("event", f"{name} must be an int: {value!r:.40}")
    return value


def _optional_str(values: dict[str, Any], name: str) -> str | None:
    value = values.get(name)
    if value is not None and not isinstance(value, str):
        raise MalformedInput("event", f"{name} must be a string: {value!r:.40}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return _is_int(value) or isinstance(value, float)


def _is_hash(value: Any) -> bool:
    return _is_int(value) or isinstance(value, bytes)
