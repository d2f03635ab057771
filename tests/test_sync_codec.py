"""coordinator.sync_codec: the Sync stream's page events, typed <-> protobuf, for both sides."""

from __future__ import annotations

import typing

import pytest

from coordinator import sync_codec as codec
from coordinator.core.errors import InvalidArgument
from coordinator.core.index import PAGE_EVENT_TYPES, PageEvent, Tier
from coordinator.core.index.page_events import PagesRemoved, PagesStored, WorkerCleared
from coordinator.v1 import coordinator_pb2 as pb

K = [bytes([i]) * 16 for i in range(4)]

EVENTS: list[PageEvent] = [
    PagesStored(tuple(K[:2])), PagesStored((K[2],), Tier.CPU), PagesStored((K[3],), Tier.DISK),
    PagesRemoved((K[0], K[2])), WorkerCleared(),
]


def test_every_variant_round_trips_through_one_batch() -> None:
    batch = pb.EventBatch(seq=7, events=[codec.event_to_pb(e) for e in EVENTS])
    decoded = codec.events_from_pb(pb.EventBatch.FromString(batch.SerializeToString()))
    assert [(type(e), tuple(e.keys), getattr(e, "tier", None)) for e in decoded] == [
        (type(e), tuple(e.keys), getattr(e, "tier", None)) for e in EVENTS]


def test_the_wire_form_is_the_protocols() -> None:
    assert codec.event_to_pb(PagesStored((K[1], K[2]), Tier.CPU)) == pb.PageEvent(
        kind=pb.PageEvent.KIND_STORED, page_keys=K[1] + K[2], tier=pb.TIER_CPU)
    assert codec.event_to_pb(PagesRemoved((K[0],))) == pb.PageEvent(
        kind=pb.PageEvent.KIND_REMOVED, page_keys=K[0], tier=pb.TIER_GPU)
    assert codec.event_to_pb(WorkerCleared()) == pb.PageEvent(kind=pb.PageEvent.KIND_CLEARED,
                                                        tier=pb.TIER_GPU)
    assert set(codec.KIND_TO_PB) == {PagesStored, PagesRemoved, WorkerCleared}
    assert set(codec.TIER_TO_PB) == set(Tier)
    assert codec.tier_to_pb(PagesRemoved(())) == pb.TIER_GPU


def test_the_kind_map_covers_every_variant_and_reads_both_ways() -> None:
    assert typing.get_args(PageEvent) == PAGE_EVENT_TYPES
    assert set(codec.KIND_TO_PB) == set(PAGE_EVENT_TYPES)
    assert {kind: variant for variant, kind in codec.KIND_TO_PB.items()} == dict(
        codec.KIND_FROM_PB)
    assert set(codec.KIND_FROM_PB) == set(pb.PageEvent.Kind.values()) - {
        pb.PageEvent.KIND_UNSPECIFIED}


def test_each_variant_is_built_from_its_wire_parts() -> None:
    assert PagesStored.of((K[0],), Tier.DISK) == PagesStored((K[0],), Tier.DISK)
    assert PagesRemoved.of((K[0],), Tier.CPU) == PagesRemoved((K[0],))
    assert WorkerCleared.of((), Tier.GPU) == WorkerCleared()


def test_an_unset_tier_reads_as_gpu() -> None:
    batch = pb.EventBatch(seq=1, events=[pb.PageEvent(kind=pb.PageEvent.KIND_STORED,
                                                      page_keys=K[0])])
    assert codec.events_from_pb(batch) == [PagesStored((K[0],), Tier.GPU)]
    assert codec.tier_from_pb(pb.TIER_UNSPECIFIED, "x") is Tier.GPU


@pytest.mark.parametrize(("event", "message"), [
    (pb.PageEvent(kind=9, page_keys=K[0]), "event batch 4: unknown event kind 9"),
    (pb.PageEvent(kind=pb.PageEvent.KIND_STORED, page_keys=K[0], tier=9),
     "event batch 4: unknown tier 9"),
    (pb.PageEvent(kind=pb.PageEvent.KIND_STORED, page_keys=b"y" * 20),
     "event batch 4: 20 bytes of page keys is not a multiple of 16"),
    (pb.PageEvent(kind=pb.PageEvent.KIND_CLEARED, page_keys=K[0]),
     "event batch 4: a CLEARED event carries no page keys"),
])
def test_a_bad_event_refuses_the_whole_batch_by_name(event: pb.PageEvent, message: str) -> None:
    good = pb.PageEvent(kind=pb.PageEvent.KIND_STORED, page_keys=K[1])
    with pytest.raises(InvalidArgument) as refused:
        codec.events_from_pb(pb.EventBatch(seq=4, events=[good, event]))
    assert str(refused.value) == message
