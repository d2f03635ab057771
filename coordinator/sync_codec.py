"""The ``Sync`` stream's page events, protobuf <-> domain, once for both sides of the stream.

The worker (the reference worker and the engine bridge) encodes its typed page events
(``coordinator.core.index.page_events``) with :func:`event_to_pb` and :data:`TIER_TO_PB`; the
coordinator decodes a batch with :func:`events_from_pb`, which validates every event before
any is applied (a batch is all or nothing). It lives beside ``coordinator.wire`` rather than in
``coordinator.server`` so that the worker, which may not import the server, shares it.

No grpc: protobuf messages and the core's types only.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from coordinator.core.errors import InvalidArgument
from coordinator.core.hashing import PAGE_KEY_BYTES, PageKeys, split_page_keys
from coordinator.core.index import (
    PAGE_EVENT_TYPES,
    PageEvent,
    PagesRemoved,
    PagesStored,
    Tier,
    WorkerCleared,
)
from coordinator.v1 import coordinator_pb2 as pb

TIER_TO_PB = MappingProxyType(
    {Tier.GPU: pb.TIER_GPU, Tier.CPU: pb.TIER_CPU, Tier.DISK: pb.TIER_DISK})
TIER_FROM_PB = MappingProxyType({
    pb.TIER_UNSPECIFIED: Tier.GPU, pb.TIER_GPU: Tier.GPU, pb.TIER_CPU: Tier.CPU,
    pb.TIER_DISK: Tier.DISK,
})
"""An unset tier reads as GPU (what a worker without tiers means)."""


KIND_TO_PB: Mapping[type[PageEvent], pb.PageEvent.Kind] = MappingProxyType({
    PagesStored: pb.PageEvent.KIND_STORED, PagesRemoved: pb.PageEvent.KIND_REMOVED,
    WorkerCleared: pb.PageEvent.KIND_CLEARED,
})
"""A page event's kind on the stream, by the event's type."""
KIND_FROM_PB: Mapping[int, type[PageEvent]] = MappingProxyType(
    {KIND_TO_PB[variant]: variant for variant in PAGE_EVENT_TYPES})
"""The event type a kind on the stream names (built from ``KIND_TO_PB``: one mapping, read
both ways)."""


def tier_to_pb(event: PageEvent) -> pb.Tier:
    """The tier ``event`` is sent with: a Stored event's own; GPU for the others, which name
    none (the coordinator ignores it there)."""
    return TIER_TO_PB[event.tier] if type(event) is PagesStored else pb.TIER_GPU


def event_to_pb(event: PageEvent) -> pb.PageEvent:
    """``event`` as the ``Sync`` stream carries it, keys concatenated. (The worker's event log
    batches the parts, ``KIND_TO_PB`` and ``tier_to_pb``, rather than whole messages.)"""
    return pb.PageEvent(kind=KIND_TO_PB[type(event)], page_keys=b"".join(event.keys),
                        tier=tier_to_pb(event))


def page_keys_from(blob: bytes, what: str) -> PageKeys:
    """``blob`` split into 16-byte page keys.

    Raises:
        InvalidArgument: naming ``what``, when the length is not a multiple of 16.
    """
    if len(blob) % PAGE_KEY_BYTES:
        raise InvalidArgument(
            f"{what}: {len(blob)} bytes of page keys is not a multiple of {PAGE_KEY_BYTES}"
        )
    return split_page_keys(blob)


def tier_from_pb(tier: int, what: str) -> Tier:
    """The tier a ``pb.Tier`` names. Raises InvalidArgument naming ``what`` for an unknown one."""
    found: Tier | None = TIER_FROM_PB.get(tier)  # type: ignore[call-overload]
    if found is None:
        raise InvalidArgument(f"{what}: unknown tier {tier}")
    return found


def events_from_pb(batch: pb.EventBatch) -> list[PageEvent]:
    """A batch's page events, typed, in order.

    Raises:
        InvalidArgument: naming the batch, for an unknown kind or tier, page keys that are not
            a multiple of 16 bytes, or a CLEARED event carrying keys. Every event is checked
            before the caller applies any.
    """
    events: list[PageEvent] = []
    what = f"event batch {batch.seq}"
    for event in batch.events:
        kind = event.kind
        if kind not in KIND_FROM_PB:
            raise InvalidArgument(f"{what}: unknown event kind {kind}")
        tier = tier_from_pb(event.tier, what)
        keys = page_keys_from(event.page_keys, what)
        # NOTE: the variants are built inline rather than through ``KIND_FROM_PB[kind].of``:
        # every batch the coordinator ingests is decoded here, and a call per event costs
        # about 8% of the decode. ``KIND_FROM_PB`` still says which kinds exist.
        if kind == pb.PageEvent.KIND_STORED:
            events.append(PagesStored(keys, tier))
        elif kind == pb.PageEvent.KIND_REMOVED:
            events.append(PagesRemoved(keys))
        elif keys:
            raise InvalidArgument(f"{what}: a CLEARED event carries no page keys")
        else:
            events.append(WorkerCleared())
    return events
