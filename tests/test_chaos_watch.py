"""The chaos bench's judgement of its samples (``bench/chaos_watch.py``): which routes were stale
and which Lookup disagreements outlasted the lag bound. Pure functions over synthetic samples, so
a bench reporting zero is known to be able to report more."""

from __future__ import annotations

from bench.chaos_watch import (
    STALE_SLACK_S,
    Episode,
    LookupSample,
    RouteSample,
    Window,
    at_stake,
    disagreements,
    stale_routes,
)
from tests.multihost_cluster import LEASE_S, Holdings

LATE = LEASE_S + STALE_SLACK_S  # from the fault to the first moment a route to it is stale
SAME: Holdings = {"w1": {"w1": 12}}
OTHER: Holdings = {"w1": {}}


def test_a_route_is_stale_only_past_the_lease_and_before_the_repair() -> None:
    down = {"w1": [Window(10.0, 15.0)]}
    routes = [
        RouteSample(10.0 + LATE - 0.01, "c1", "w1"),  # within the lease (and slack): fine
        RouteSample(10.0 + LATE, "c1", "w1"),  # stale
        RouteSample(10.0 + LATE + 0.5, "c2", "w1"),  # stale, on the other replica too
        RouteSample(10.0 + LATE + 0.5, "c1", "w2"),  # another worker
        RouteSample(10.0 + LATE + 0.6, "c1", None, "UNAVAILABLE"),  # refused: no worker named
        RouteSample(15.0, "c1", "w1"),  # repaired
    ]
    assert stale_routes(routes, down, 0.0, 100.0) == routes[1:3]
    assert at_stake(routes, down, 0.0, 100.0) == routes[1:4]  # answered while w1 was stale
    assert stale_routes(routes, down, 0.0, 10.0 + LATE + 0.1) == routes[1:2]  # the round's own


def test_an_unrepaired_worker_stays_stale_and_each_spell_counts_from_its_own_fault() -> None:
    down = {"w1": [Window(10.0, 11.0), Window(20.0)]}  # back before its lease ran out, then down
    routes = [RouteSample(10.9, "c1", "w1"), RouteSample(12.5, "c1", "w1"),
              RouteSample(20.0 + LATE - 0.01, "c1", "w1"), RouteSample(99.0, "c1", "w1")]
    assert stale_routes(routes, down, 0.0, 100.0) == [routes[3]]


def lookups(*spec: tuple[float, bool]) -> list[LookupSample]:
    """Samples at the given times; True where the two replicas differ."""
    return [LookupSample(t, {"c1": SAME, "c2": OTHER if differ else SAME}) for t, differ in spec]


def test_disagreement_counts_once_per_episode_longer_than_the_bound() -> None:
    samples = lookups((0.0, False), (1.0, True), (2.5, True), (3.0, False),  # 1.5 s: fine
                      (4.0, True), (5.0, True), (6.5, True), (7.0, True), (8.0, False))
    episodes = disagreements(samples, [], 0.0, 100.0, bound=2.0)
    assert episodes == [Episode(since=4.0, lasted_s=3.0, answers={"c1": SAME, "c2": OTHER})]


def test_disagreement_during_a_replication_outage_is_not_counted_and_restarts_the_clock() -> None:
    samples = lookups((1.0, True), (2.0, True), (4.0, True), (5.0, True), (6.5, True))
    outage = [Window(1.5, 4.5)]
    # 1.0 alone before the outage; after it, 5.0 .. 6.5 is 1.5 s: below the bound.
    assert disagreements(samples, outage, 0.0, 100.0, bound=2.0) == []
    assert [e.since for e in disagreements(samples, outage, 0.0, 100.0, bound=1.0)] == [5.0]
