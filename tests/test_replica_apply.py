"""ReplicaApplier's rules on a real fleet, index and sessions (pure core, no network):
incarnations order registrations, page batches apply in sequence order, a gap asks the owner
once, a worker whose stream is here is ours to describe, fencing never reverts."""

from __future__ import annotations

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.control.sessions.sync_messages import Outbound, RegistrationRequest
from coordinator.core.errors import DomainError
from coordinator.core.fleet import WorkerLoad
from coordinator.core.index import PagesStored
from coordinator.core.routing import PromptInput, RouteReservation, Scope
from coordinator.replica import CoordinatorReplica
from coordinator.replication.apply import ReplicaApplier
from coordinator.replication.events import (
    Attached,
    Detached,
    Dropped,
    Pages,
    Registered,
    Replaced,
    Routed,
    RoutesEnded,
    State,
)
from coordinator.store.memory import MemoryStore
from tests.conftest import FakeClock

K = [bytes([i]) * 16 for i in range(8)]


class Replica:
    def __init__(self) -> None:
        self.clock = FakeClock()
        self.service = CoordinatorReplica(
            CoordinatorConfig(replica_id="here"), MemoryStore(clock=self.clock),
            clock=self.clock,
        )
        self.wanted: list[str] = []
        self.applier = ReplicaApplier(
            config=self.service.config, fleet=self.service.fleet, index=self.service.index,
            sessions=self.service.worker_sync, streams=self.service.streams, clock=self.clock,
            want_snapshot=self.wanted.append,
        )

    def held(self, worker_id: str = "w1") -> set[bytes]:
        return set(self.service.index.worker_keys(worker_id))


def registered(incarnation: int = 1) -> Registered:
    return Registered("w1", incarnation, "10.0.0.1:7000", "default", 0, False, 64)


def stored(seq: int, *keys: bytes, incarnation: int = 1) -> Pages:
    return Pages("w1", incarnation, seq, (PagesStored(keys),))


def test_an_older_registration_is_ignored_and_a_newer_one_replaces_the_session() -> None:
    r = Replica()
    r.applier.apply("c2", registered(2))
    r.applier.apply("c2", Attached("w1", 2, 1))
    r.applier.apply("c2", stored(1, K[0], incarnation=2))
    r.applier.apply("c2", registered(1))  # late, from an older life
    session = r.service.fleet.get("w1")
    assert session is not None and (session.incarnation, session.owner) == (2, "c2")
    assert r.held() == {K[0]}
    r.applier.apply("c3", registered(3))
    session = r.service.fleet.get("w1")
    assert session is not None and (session.incarnation, session.owner) == (3, "c3")
    assert r.held() == set()  # the old incarnation's pages went with it
    r.applier.apply("c2", stored(2, K[1], incarnation=2))  # stale incarnation: ignored
    assert r.held() == set()


def test_batches_apply_in_order_and_a_gap_asks_the_owner_once() -> None:
    r = Replica()
    r.applier.apply("c2", registered())
    r.applier.apply("c2", Attached("w1", 1, 1))
    r.applier.apply("c2", stored(1, K[0]))
    r.applier.apply("c2", stored(1, K[0]))  # a duplicate: skipped
    r.applier.apply("c2", stored(3, K[2]))  # batch 2 never arrived
    r.applier.apply("c2", stored(4, K[3]))
    assert (r.held(), r.wanted) == ({K[0]}, ["w1"])
    r.applier.apply("c2", Replaced("w1", 1, 4, {"gpu": (K[0], K[1], K[2], K[3])}))
    r.applier.apply("c2", stored(5, K[4]))
    assert r.held() == {K[0], K[1], K[2], K[3], K[4]}
    assert r.applier.counters.gaps == 2  # two batches past the gap, one request


def test_an_unknown_worker_is_asked_for_and_a_departure_is_not() -> None:
    r = Replica()
    r.applier.apply("c2", stored(4, K[0]))
    r.applier.apply("c2", Detached("w2", 1))
    r.applier.apply("c2", Dropped("w3", 1, "deregistered"))
    assert r.wanted == ["w1"]


def test_state_from_a_former_owner_is_ignored_and_fencing_never_reverts() -> None:
    r = Replica()
    r.applier.apply("c2", registered())
    r.applier.apply("c2", Attached("w1", 1, 1))
    r.applier.apply("c2", State("w1", 1, 0, WorkerLoad(running_requests=3), 0, False, True))
    r.applier.apply("c3", Attached("w1", 1, 1))  # the worker moved to c3
    r.applier.apply("c2", State("w1", 1, 5, WorkerLoad(running_requests=9), 0, False, False))
    r.applier.apply("c3", State("w1", 1, 0, WorkerLoad(running_requests=4), 0, False, False))
    session = r.service.fleet.get("w1")
    assert session is not None
    assert (session.owner, session.policy_version, session.load.running_requests,
            session.fenced) == ("c3", 0, 4, True)
    r.applier.apply("c2", Detached("w1", 1))  # not the owner any more: ignored
    assert session.connected
    r.applier.apply("c3", Detached("w1", 1))
    assert not session.connected


async def test_a_worker_streaming_here_is_ours_until_another_replica_says_it_moved() -> None:
    r = Replica()
    registration = await r.service.worker_sync.register(RegistrationRequest(
        "w1", "10.0.0.1:7000", "blake2b-128", 16, r.service.hash_config.fingerprint(), 64, 0,
        False, "default"))
    closed: list[DomainError] = []
    sent: list[Outbound] = []
    session, stream, _ = r.service.worker_sync.hello(
        "w1", registration.incarnation, 0, close=closed.append, send=sent.append)
    r.service.worker_sync.events(session, 1, [PagesStored((K[0],))])
    r.applier.apply("c2", stored(2, K[1], incarnation=registration.incarnation))
    r.applier.apply("c2", Replaced("w1", registration.incarnation, 9, {}))
    assert r.held() == {K[0]} and closed == []
    r.applier.apply("c2", Attached("w1", registration.incarnation, 2))
    assert len(closed) == 1
    assert "attached to coordinator replica c2" in str(closed[0])
    assert session.owner == "c2"
    assert not r.service.worker_sync.owns(session, stream)  # the servicer stops reading it


class RoutingReplica(Replica):
    """A replica whose router publishes its decisions to its outbox and takes others'."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.service = CoordinatorReplica(
            CoordinatorConfig(replica_id="here"), MemoryStore(clock=self.clock),
            clock=self.clock, replicate=True,
        )
        self.wanted = []
        self.applier = ReplicaApplier(
            config=self.service.config, fleet=self.service.fleet, index=self.service.index,
            sessions=self.service.worker_sync, streams=self.service.streams, clock=self.clock,
            want_snapshot=self.wanted.append, router=self.service.router,
        )

    def published(self) -> list[object]:
        assert self.service.outbox is not None
        return list(self.service.outbox.events)

    def inflight(self, worker_id: str = "w1") -> tuple[int, int]:
        session = self.service.fleet.get(worker_id)
        assert session is not None
        load = session.current_load()
        return load.inflight_routes, load.inflight_tokens


def remote_worker(r: Replica, incarnation: int = 1, external: bool = False) -> None:
    r.applier.apply("c2", Registered("w1", incarnation, "10.0.0.1:7000", "default", 0,
                                     external, 64))
    r.applier.apply("c2", Attached("w1", incarnation, 1))


def test_a_route_chosen_here_is_published_with_the_keys_its_worker_lacks() -> None:
    r = RoutingReplica()
    remote_worker(r)
    r.applier.apply("c2", stored(1, K[0]))
    keys = [K[0], K[1], K[2]]
    route = r.service.router.route(PromptInput(48, page_keys=tuple(keys)), Scope())
    (event,) = [e for e in r.published() if isinstance(e, Routed)]
    # 2 of the 3 pages to compute: 32 tokens of prefill on w1's backlog, here and elsewhere;
    # the 48-token prompt pins its KV there while in flight.
    assert event.reservation == RouteReservation("w1", 1, route.route_id, (K[1], K[2]), 32, 1,
                                                 False, 32, 48)
    r.service.router.end_routes(["x-1", route.route_id])
    assert [e for e in r.published() if isinstance(e, RoutesEnded)] == [
        RoutesEnded(("x-1", route.route_id))]


def test_another_replicas_route_counts_here_even_for_a_worker_streaming_here() -> None:
    r = RoutingReplica()
    remote_worker(r)
    reservation = RouteReservation("w1", 1, "c2-1", (K[3], K[4]), 100, 16, False)
    r.applier.apply("c2", Routed(reservation))
    assert r.inflight() == (16, 1600)
    detail = r.service.index.match_detail([K[3], K[4]], include_pending=True)
    assert detail["w1"].pages == 2 and detail["w1"].confirmed_pages == 0
    # The owner's heartbeat settles routes whoever chose them.
    r.applier.apply("c2", State("w1", 1, 0, WorkerLoad(), 10, False, False))
    assert r.inflight() == (6, 600)
    # A route to an incarnation not known here changes nothing.
    r.applier.apply("c2", Routed(RouteReservation("w1", 2, "c2-2", (K[5],), 1, 1, False)))
    assert r.inflight() == (6, 600)
    assert r.applier.counters.ignored == 1
    assert not r.published()  # nothing taken from another replica is published again


def test_another_replicas_route_adds_the_prefill_it_counted_to_the_backlog_here() -> None:
    r = RoutingReplica()
    remote_worker(r)
    session = r.service.fleet.get("w1")
    assert session is not None
    now = r.service.clock()
    r.applier.apply("c2", Routed(RouteReservation("w1", 1, "c2-1", (K[3],), 100, 16, False, 40,
                                                  120)))
    assert session.prefill_backlog(now) == pytest.approx(40.0, abs=1.0)
    assert session.current_load(now).active_tokens == 16 * 120
    # From a release that does not say: every copy's uncached tokens.
    r.applier.apply("c2", Routed(RouteReservation("w1", 1, "c2-2", (K[4],), 100, 2, False)))
    assert session.prefill_backlog(now) == pytest.approx(240.0, abs=2.0)


def test_an_awaited_route_ends_through_any_replica_once() -> None:
    r = RoutingReplica()
    remote_worker(r, external=True)
    r.applier.apply("c2", Routed(RouteReservation("w1", 1, "c2-7", (), 50, 2, True)))
    r.applier.apply("c2", Routed(RouteReservation("w1", 1, "c2-7", (), 50, 2, True)))  # again
    assert r.inflight() == (2, 100)
    r.applier.apply("c2", State("w1", 1, 0, WorkerLoad(), 5, False, False))
    assert r.inflight() == (2, 100)  # heartbeats do not settle awaited routes
    ended = r.service.router.end_routes(["c2-7"])  # the caller ends it here
    assert (ended.ended, ended.unknown, r.inflight()) == (1, 0, (0, 0))
    r.applier.apply("c2", Routed(RouteReservation("w1", 1, "c2-8", (), 50, 1, True)))
    r.applier.apply("c2", RoutesEnded(("c2-8", "c2-7")))  # ended through c2
    assert r.inflight() == (0, 0)
