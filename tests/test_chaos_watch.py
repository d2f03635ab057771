"""The chaos bench's judgement of its samples (``bench/chaos_watch.py``, ``bench/chaos_load.py``,
``bench/chaos_report.py``): stale routes, version violations, what was at stake, availability,
the rollout reconciliation and generations overlapping an update. Pure functions over synthetic
samples, so a bench reporting zero is known to be able to report more, and "-" where nothing
was at stake."""

from __future__ import annotations

import pytest

from bench.chaos_faults import FAULTS, schedule
from bench.chaos_load import ANSWER_SLACK_S, Generation, overlaps, reconcile
from bench.chaos_report import verdict
from bench.chaos_watch import (
    STALE_SLACK_S,
    UNSERVED_GAP_S,
    Availability,
    Commit,
    RouteSample,
    Window,
    availability,
    critical_samples,
    failover_spell,
    lapse_spells,
    policy_stake,
    stale_routes,
    stale_stake,
    version_violations,
)
from coordinator.client import RolloutRecord
from tests.multihost_cluster import LEASE_S

LATE = LEASE_S + STALE_SLACK_S  # from the fault to the first moment a route to it is stale
STALE = 1.5  # policy_stale_s in these tests


def test_a_route_is_stale_only_past_the_lease_and_before_the_repair() -> None:
    down = {"w1": [Window(10.0, 15.0)]}
    routes = [
        RouteSample(10.0 + LATE - 0.01, "c1", "w1", 0),  # within the lease (and slack): fine
        RouteSample(10.0 + LATE, "c1", "w1", 0),  # stale
        RouteSample(10.0 + LATE + 0.5, "c2", "w1", 0),  # stale, on the other replica too
        RouteSample(10.0 + LATE + 0.5, "c1", "w2", 0),  # another worker
        RouteSample(10.0 + LATE + 0.6, "c1", None, None, "UNAVAILABLE"),  # refused: no worker
        RouteSample(15.0, "c1", "w1", 0),  # repaired
    ]
    assert stale_routes(routes, down, 0.0, 100.0) == routes[1:3]
    assert stale_stake(routes, down, 0.0, 100.0) == routes[1:4]
    assert stale_routes(routes, down, 0.0, 10.0 + LATE + 0.1) == routes[1:2]  # the round's own


def test_an_unrepaired_worker_stays_stale_and_each_spell_counts_from_its_own_fault() -> None:
    down = {"w1": [Window(10.0, 11.0), Window(20.0)]}  # back before its lease ran out, then down
    routes = [RouteSample(10.9, "c1", "w1"), RouteSample(12.5, "c1", "w1"),
              RouteSample(20.0 + LATE - 0.01, "c1", "w1"), RouteSample(99.0, "c1", "w1")]
    assert stale_routes(routes, down, 0.0, 100.0) == [routes[3]]


def test_a_lapsed_lease_is_a_spell_from_the_lapse_to_the_last_poll_before_ready_again() -> None:
    """Packet loss: seen not READY at 12.0 (its lease ran out by then), READY again at 12.9."""
    polls = [(11.8, True), (12.0, False), (12.4, False), (12.8, False), (12.9, True),
             (13.0, False), (13.1, False)]
    spells = lapse_spells(polls, healed=14.0)
    assert spells == [Window(12.0 - LEASE_S, 12.8), Window(13.0 - LEASE_S, 14.0)]
    routes = [RouteSample(12.0 + STALE_SLACK_S - 0.01, "c1", "w1"),  # the lapse just seen
              RouteSample(12.0 + STALE_SLACK_S, "c1", "w1"),  # stale
              RouteSample(12.85, "c1", "w1"),  # between the polls: it may be READY, not judged
              RouteSample(13.0 + STALE_SLACK_S, "c2", "w1"),  # the second lapse: stale
              RouteSample(14.0, "c2", "w1")]  # healed
    down = {"w1": spells}
    assert stale_routes(routes, down, 0.0, 100.0) == [routes[1], routes[3]]
    assert lapse_spells([(t, True) for t in (1.0, 2.0)], healed=3.0) == []  # nothing at stake


def test_a_worker_cut_from_its_owner_is_unreachable_until_ready_on_the_other_replica() -> None:
    polls = [(10.1, False), (10.9, False), (11.0, True)]
    assert failover_spell(polls, fault_at=10.0, healed=12.5) == Window(10.0, 10.9)
    assert failover_spell(polls[:2], fault_at=10.0, healed=12.5) == Window(10.0, 12.5)
    late = RouteSample(10.0 + LATE + 0.1, "c1", "w1")  # past the lease, never failed over
    assert stale_routes([late], {"w1": [Window(10.0, 12.5)]}, 0.0, 100.0) == [late]
    assert stale_routes([late], {"w1": [Window(10.0, 10.9)]}, 0.0, 100.0) == []


def test_a_route_under_the_old_version_past_policy_stale_after_the_commit_violates() -> None:
    commits = [Commit(version=2, begun=9.0, returned=10.0)]
    routes = [
        RouteSample(10.0 + STALE - 0.01, "c2", "w1", 1),  # within policy_stale: allowed
        RouteSample(10.0 + STALE + 0.01, "c2", "w1", 1),  # violation
        RouteSample(10.0 + STALE + 0.02, "c1", "w2", 2),  # the new version: fine
        RouteSample(10.0 + STALE + 0.03, "c2", None, None, "UNAVAILABLE"),  # refused: fine
    ]
    assert version_violations(routes, commits, STALE, 0.0, 100.0) == routes[1:2]
    # Both answered routes past policy_stale were at stake; the one before it was not.
    assert policy_stake(routes, commits, STALE, 0.0, 100.0) == routes[1:3]
    assert policy_stake(routes, [], STALE, 0.0, 100.0) == []


def test_each_rule_has_its_own_stake_and_a_commit_puts_nothing_at_stake_for_stale_routes(
) -> None:
    """After the warm-up update every route is at stake for the version rule; only a worker
    past its lease unreachable puts a route at stake for the stale-route rule."""
    commits = [Commit(version=1, begun=0.5, returned=1.0)]  # the warm-up update
    routes = [RouteSample(t, "c1", "w2", 1) for t in (20.0, 21.0, 22.0, 23.0)]
    assert stale_stake(routes, {}, 0.0, 100.0) == []  # no worker unreachable: nothing
    assert policy_stake(routes, commits, STALE, 0.0, 100.0) == routes
    down = {"w1": [Window(20.5, 22.5)]}  # w1 down; stale from 20.5 + LATE to its repair
    assert stale_stake(routes, down, 0.0, 100.0) == [
        r for r in routes if 20.5 + LATE <= r.sent < 22.5]
    assert policy_stake(routes, commits, STALE, 0.0, 21.5) == routes[:2]  # the round's own


def test_the_critical_window_holds_every_route_from_policy_stale_after_the_commit_to_the_end(
) -> None:
    commits = [Commit(version=1, begun=0.5, returned=1.0),  # an earlier round's
               Commit(version=2, begun=9.0, returned=10.0)]
    routes = [
        RouteSample(10.0 + STALE - 0.01, "c2", "w1", 1),  # not yet judged
        RouteSample(10.0 + STALE + 0.01, "c2", None, None, "DEADLINE_EXCEEDED"),  # refused
        RouteSample(10.0 + STALE + 0.02, "c1", "w2", 2),
        RouteSample(13.0, "c2", "w1", 2),  # after the fault ended
    ]
    assert critical_samples(routes, commits, STALE, 5.0, 13.0) == routes[1:3]
    assert critical_samples(routes, commits, STALE, 11.0, 13.0) == []  # no commit in the round


def test_availability_counts_errors_and_stretches_without_any_replicas_answer() -> None:
    ok = [RouteSample(t, "c1", "w1", 0) for t in (10.0, 10.1, 10.2, 11.5, 11.6)]
    refused = [RouteSample(t, "c2", None, None, "UNAVAILABLE") for t in (10.5, 11.0)]
    got = availability(ok + refused, 10.0, 12.0)
    assert got.errors == 2
    assert got.unserved_s == pytest.approx(1.3)  # 10.2 -> 11.5; 11.6 -> 12.0 is under the gap
    assert availability([], 10.0, 12.0) == Availability(0, 2.0)  # no answer at all
    assert UNSERVED_GAP_S < 0.6


def gen(rollout_id: str, worker: str, version: int, sent: float, answered: float,
        route_version: int | None = None) -> Generation:
    return Generation(sent, answered, "c1", rollout_id, worker,
                      version if route_version is None else route_version, version)


def record(rollout_id: str, worker: str, version: int) -> RolloutRecord:
    return RolloutRecord(rollout_id, version, worker, 5, 0, 2, "")


def test_reconcile_finds_missing_and_changed_records_and_sets_apart_a_killed_workers() -> None:
    gens = [gen("a", "w1", 1, 1.0, 1.1), gen("b", "w1", 1, 2.0, 2.1), gen("c", "w2", 1, 2.0, 2.2),
            gen("d", "w2", 1, 3.0, 3.1), gen("e", "w3", 1, 3.0, 3.5),
            Generation(3.0, 3.2, "c2", "f", error="route UNAVAILABLE")]  # never answered
    records = {"a": record("a", "w1", 1), "c": record("c", "w2", 0), "d": record("d", "w2", 1)}
    kills = [("w1", 2.5), ("w3", 9.0)]  # b died with w1 (0.4 s later); e was long reported
    found = reconcile(gens, records, kills, 0.0, 100.0)
    assert found.checked == 5
    assert found.lost == ["c", "e"]  # c read back under another version; e missing
    assert found.died_with_worker == ["b"]


def test_a_generation_under_the_old_version_overlapping_the_update_violates() -> None:
    commit = Commit(version=2, begun=9.0, returned=10.0, fenced=("w3",))
    gens = [
        gen("ok-before", "w1", 1, 8.0, 9.5),  # drained before the commit
        gen("late-answer", "w1", 1, 8.0, 10.0 + ANSWER_SLACK_S + 0.1),  # ran across it
        gen("late-route", "w2", 1, 10.0 + STALE + 0.1, 11.7),  # routed to old weights
        gen("new", "w2", 2, 10.0 + STALE + 0.1, 11.7),
        gen("fenced", "w3", 1, 12.0, 12.1),  # took no part in the update
    ]
    assert [g.rollout_id for g in overlaps(gens, [commit], STALE, 0.0, 100.0)] == [
        "late-answer", "late-route"]


def test_nothing_at_stake_reads_a_dash_never_met() -> None:
    assert verdict(True, at_stake=0) == "-"
    assert verdict(False, at_stake=0) == "-"
    assert verdict(True, at_stake=3) == "met"
    assert verdict(False, at_stake=3) == "MISSED"


def test_the_schedule_runs_each_kind_in_turn_and_restarts_each_killed_replica() -> None:
    plan = schedule(2, ["kill_worker", "kill_replica", "restart_replica", "packet_loss"])
    assert plan == [("kill_worker", 0), ("kill_worker", 1), ("kill_replica", 0),
                    ("restart_replica", 0), ("kill_replica", 1), ("restart_replica", 1),
                    ("packet_loss", 0), ("packet_loss", 1)]
    assert {kind for kind, _ in schedule(1)} == set(FAULTS)  # one round of each: --quick
