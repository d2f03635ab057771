"""Route ends that come before their route, and routes handed to a replica that joins (pure
core, no network): an ended id is remembered for the routes' TTL, within a fixed bound, so a
route held under it later is settled at once; a worker's in-flight routes travel as one
``InFlight`` event that only the replica that asked takes, keeping each awaited route's
remaining time."""

from __future__ import annotations

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.core.fleet import RegisteredWorker, WorkerLoad
from coordinator.core.routing import HeldRoute, InFlightRoutes, RouteReservation
from coordinator.core.routing.awaited_routes import MAX_ROUTE_ID_LENGTH, AwaitedRoutes
from coordinator.replica import CoordinatorReplica
from coordinator.replication.apply import ReplicaApplier
from coordinator.replication.events import (
    Attached,
    InFlight,
    MalformedEvent,
    Registered,
    Routed,
    RoutesEnded,
    State,
    decode,
    encode,
)
from coordinator.store.memory import MemoryStore
from tests.conftest import FakeClock


def worker(incarnation: int = 1) -> RegisteredWorker:
    return RegisteredWorker("w1", incarnation, "10.0.0.1:7000", "default", 0, True, 64,
                            lease_deadline=1e9)


def load(session: RegisteredWorker) -> tuple[int, int, int]:
    view = session.current_load()
    return view.inflight_routes, view.inflight_tokens, view.active_tokens


def test_a_route_held_after_its_end_is_settled_at_once() -> None:
    books, session = AwaitedRoutes(ttl_s=60.0), worker()
    ended = books.end(["c2-1"], now=0.0)
    assert (ended.ended, ended.unknown) == (0, 1)  # unknown here, as before
    assert books.hold(session, 100, 2, now=0.5, route_id="c2-1") == "c2-1"
    assert (len(books), load(session), books.settled_on_arrival) == (0, (0, 0, 0), 1)
    # Remembered, not consumed: the same route again (a snapshot of it) is settled too.
    books.hold(session, 100, 2, now=0.6, route_id="c2-1")
    assert (len(books), books.settled_on_arrival) == (0, 2)
    # An end of a route held here is remembered as well, and a new id is never taken for one.
    books.hold(session, 100, 1, now=1.0, route_id="c2-2")
    books.end(["c2-2"], now=1.0)
    books.hold(session, 100, 1, now=1.1, route_id="c2-2")
    assert (len(books), load(session), books.ends_remembered) == (0, (0, 0, 0), 2)


def test_an_end_is_forgotten_after_the_ttl_and_a_route_held_then_counts() -> None:
    books, session = AwaitedRoutes(ttl_s=10.0), worker()
    books.end(["c2-1", "c2-2"], now=0.0)
    books.end(["c2-2"], now=5.0)  # ended again: remembered from then on
    books.hold(session, 100, 1, now=10.0, route_id="c2-1")
    books.hold(session, 100, 1, now=10.0, route_id="c2-2")
    assert (len(books), books.ends_remembered, load(session)[0]) == (1, 1, 1)
    books.expire(15.0)
    assert books.ends_remembered == 0


def test_a_flood_of_unknown_ids_is_remembered_within_the_bound() -> None:
    books, session = AwaitedRoutes(ttl_s=60.0, capacity=100), worker()
    books.end([f"flood-{i}" for i in range(300)], now=0.0)
    assert books.ends_remembered == 100  # the newest 100; the older are forgotten
    books.hold(session, 10, 1, now=1.0, route_id="flood-299")
    assert len(books) == 0
    books.hold(session, 10, 1, now=1.0, route_id="flood-0")
    assert len(books) == 1
    # Ids no replica issues are never remembered; "" still asks for a new id.
    books.end(["", "x" * (MAX_ROUTE_ID_LENGTH + 1)], now=1.0)
    assert books.ends_remembered == 100
    new_id = books.hold(session, 10, 1, now=1.0)
    assert new_id and len(books) == 2


def test_restored_routes_keep_their_time_left_and_expire_in_deadline_order() -> None:
    books, session = AwaitedRoutes(ttl_s=60.0), worker()
    books.hold(session, 100, 1, now=0.0, route_id="here-1")  # due at 60
    books.end(["c2-ended"], now=0.0)
    restored = books.restore(session, [
        HeldRoute("c2-1", 50, 2, 70, expires_in_s=5.0),  # due at 5
        HeldRoute("here-1", 100, 1, 0, expires_in_s=1.0),  # held already
        HeldRoute("c2-ended", 50, 1, 0, expires_in_s=30.0),  # ended already
        HeldRoute("c2-old", 50, 1, 0, expires_in_s=0.0),  # due already
        HeldRoute("c2-2", 30, 1, 0, expires_in_s=600.0),  # capped at the TTL: due at 60
    ], now=0.0)
    assert restored == 2
    assert load(session) == (4, 100 + 100 + 30, 140)
    by_id = {"w1": session}
    assert books.held_for(by_id, 4.0) == {"w1": [
        HeldRoute("c2-1", 50, 2, 70, 1.0), HeldRoute("here-1", 100, 1, 0, 56.0),
        HeldRoute("c2-2", 30, 1, 0, 56.0)]}
    books.expire(5.0)  # the restored route is due before the one held here first
    assert (len(books), load(session)) == ((2, (2, 130, 0)))
    # A newer incarnation's session is not the one these routes were held for.
    assert books.held_for({"w1": worker(incarnation=2)}, 5.0) == {}


class Replica:
    """A replica ("here") that shares routes: its applier takes others' routes."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.service = CoordinatorReplica(
            CoordinatorConfig(replica_id="here", route_end_ttl_ms=60_000),
            MemoryStore(clock=self.clock), clock=self.clock, replicate=True)
        self.applier = ReplicaApplier(
            config=self.service.config, fleet=self.service.fleet, index=self.service.index,
            sessions=self.service.worker_sync, streams=self.service.streams, clock=self.clock,
            want_snapshot=lambda worker_id: None, router=self.service.router)
        self.applier.apply("c2", Registered("w1", 1, "10.0.0.1:7000", "default", 0, True, 64))
        self.applier.apply("c2", Attached("w1", 1, 1))

    def inflight(self) -> tuple[int, int]:
        session = self.service.fleet.get("w1")
        assert session is not None
        view = session.current_load()
        return view.inflight_routes, view.inflight_tokens


def test_routed_after_routes_ended_settles_at_once_on_a_replica() -> None:
    r = Replica()
    r.applier.apply("c3", RoutesEnded(("c2-1",)))
    r.applier.apply("c2", Routed(RouteReservation("w1", 1, "c2-1", (), 100, 4, True)))
    r.applier.apply("c2", Routed(RouteReservation("w1", 1, "c2-2", (), 100, 1, True)))
    assert r.inflight() == (1, 100)


def test_in_flight_routes_are_taken_only_by_the_replica_that_asked() -> None:
    r = Replica()
    r.applier.apply("c2", Routed(RouteReservation("w1", 1, "c2-1", (), 100, 3, False)))
    r.applier.apply("c2", Routed(RouteReservation("w1", 1, "c2-2", (), 40, 1, True)))
    r.applier.apply("c2", RoutesEnded(("c2-9",)))
    snapshot = InFlightRoutes("w1", 1, ((10, 20), (10, 20), (7, 9)), (
        HeldRoute("c2-2", 40, 1, 0, 30.0), HeldRoute("c2-5", 50, 2, 0, 30.0),
        HeldRoute("c2-9", 60, 1, 0, 30.0)))
    r.applier.apply("c2", InFlight("elsewhere", snapshot))
    assert r.inflight() == (4, 340)
    # For us: the heartbeat-settled routes become the snapshot's, awaited ones join by id
    # ("c2-2" is held already, "c2-9" was ended here).
    r.applier.apply("c2", InFlight("here", snapshot))
    assert r.inflight() == (3 + 1 + 2, 27 + 40 + 100)
    # A heartbeat then settles the oldest as on the owner; another incarnation changes nothing.
    r.applier.apply("c2", State("w1", 1, 0, WorkerLoad(), 2, False, False))
    assert r.inflight() == (4, 147)
    r.applier.apply("c2", InFlight("here", InFlightRoutes("w1", 2, ((1, 1),), ())))
    assert r.inflight() == (4, 147)
    assert r.applier.counters.ignored == 2
    # Ended through this replica: the restored routes end like the others.
    assert r.service.router.end_routes(["c2-2", "c2-5"]).ended == 2
    assert r.inflight() == (1, 7)


def test_in_flight_routes_round_trip() -> None:
    event = InFlight("c9", InFlightRoutes("w1", 3, ((512, 530), (0, 16)), (
        HeldRoute("ab12-f", 4096, 16, 4100, 599.875), HeldRoute("ab12-10", 0, 1, 0, 0.001))))
    assert decode(encode("c1", 7, event)).event == event
    empty = InFlight("c9", InFlightRoutes("w1", 3, (), ()))
    assert decode(encode("c1", 7, empty)).event == empty


@pytest.mark.parametrize("body", [
    '{"q":"c","w":"w","i":1,"h":[[1]],"a":[]}',
    '{"q":"c","w":"w","i":1,"h":[[-1,0]],"a":[]}',
    '{"q":"c","w":"w","i":1,"h":[],"a":[["x",1,0,0,1.0]]}',
    '{"q":"c","w":"w","i":1,"h":[],"a":[["",1,1,0,1.0]]}',
    '{"q":"c","w":"w","i":1,"h":[]}',
])
def test_a_malformed_in_flight_event_is_refused(body: str) -> None:
    with pytest.raises(MalformedEvent):
        decode({"e": "\x1f".join(("c1", "1", "inflight", body, ""))})
