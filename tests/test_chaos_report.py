"""The chaos bench's per-kind summary and table (``bench/chaos_report.py``) and what a round
counts as its own (``bench/chaos_round.own_records``), on synthetic rounds and samples: each
rule's verdict rests on its own stake, kill -9 worker's process start is judged apart from the
rejoin, the policy_stale window's sample count is shown, and a round checks its own records
only."""

from __future__ import annotations

from typing import Any

import pytest

from bench.chaos_faults import FAULTS, PROCESS_START_TARGET_S
from bench.chaos_load import Load
from bench.chaos_report import summarize, table_rows
from bench.chaos_round import POLICY_STALE_S, Round, own_records
from bench.chaos_watch import Commit, RouteSample, Watch, Window
from coordinator.client import RolloutRecord
from tests.multihost_cluster import LEASE_S


def record(rollout_id: str, worker: str = "w1") -> RolloutRecord:
    return RolloutRecord(rollout_id, 1, worker, 5, 0, 2, "")


def test_a_round_checks_only_the_probe_records_its_own_serving_added() -> None:
    earlier = {k: record(k) for k in ("probe-1", "probe-2", "chaos-c1-0")}
    now = {**earlier, "probe-3": record("probe-3"), "probe-4": record("probe-4", "w2"),
           "chaos-c1-1": record("chaos-c1-1")}  # a generation: reconciled by its own round
    assert own_records(earlier, now) == {"probe-3": record("probe-3"),
                                         "probe-4": record("probe-4", "w2")}
    assert own_records(now, now) == {}  # a second round with nothing new checks nothing old


def fleet(routes: list[RouteSample], commits: list[Commit],
          down: dict[str, list[Window]]) -> tuple[Watch, Load]:
    watch = Watch(None, frozenset())  # type: ignore[arg-type,unused-ignore]  # judged only
    watch.routes, watch.commits, watch.down = routes, commits, down
    return watch, Load(None, watch)  # type: ignore[arg-type,unused-ignore]


def rows_of(summary: dict[str, dict[str, Any]], kind: str) -> dict[str, list[str]]:
    label = FAULTS[kind].label
    return {row[1].split(" (")[0].split(",")[0]: row[2:] for row in table_rows(summary)
            if row[0] == label}


def test_the_stale_routes_row_reads_a_dash_when_only_the_policy_rule_had_a_stake() -> None:
    warmup = Commit(version=1, begun=0.5, returned=1.0)
    routes = [RouteSample(10.0 + i / 10, "c1", "w2", 1) for i in range(20)]
    rnd = Round("redis_restart", 0, "db", 9.0, fault_at=10.0, repaired_at=11.0,
                recovered_at=11.5, ended=13.0)
    summary = summarize([rnd], *fleet(routes, [warmup], {}), began=0.0)
    assert summary["redis_restart"]["stale_routes_at_stake"] == 0
    assert summary["redis_restart"]["policy_routes_at_stake"] == 20
    rows = rows_of(summary, "redis_restart")
    assert rows["stale routes"] == ["0 of 0", "0", "-"]
    assert rows["policy violations"] == ["0 (20 routes, 0 gens)", "0", "met"]


def test_a_worker_past_its_lease_puts_routes_at_stake_for_the_stale_rule_only() -> None:
    routes = [RouteSample(10.0 + i / 10, "c1", "w2", 0) for i in range(40)]
    rnd = Round("cut_worker", 0, "w1", 9.0, fault_at=10.0, repaired_at=13.0,
                recovered_at=13.5, ended=14.0)
    summary = summarize([rnd], *fleet(routes, [], {"w1": [Window(10.0, 13.0)]}), began=0.0)
    late = [r for r in routes if 10.0 + LEASE_S + 0.25 <= r.sent < 13.0]
    assert summary["cut_worker"]["stale_routes_at_stake"] == len(late) > 0
    assert rows_of(summary, "cut_worker")["policy violations"][-1] == "-"  # no commit


def test_the_policy_stale_windows_samples_are_counted_refused_ones_too() -> None:
    commit = Commit(version=2, begun=9.5, returned=10.0)
    routes = [RouteSample(10.0 + POLICY_STALE_S + 0.01 * i, "c2", None, None,
                          "DEADLINE_EXCEEDED") for i in range(1, 31)]
    routes.append(RouteSample(10.0 + POLICY_STALE_S + 0.5, "c1", "w1", 2))
    rnd = Round("redis_cut_update", 0, "c2", 9.0, fault_at=9.2, repaired_at=12.6,
                recovered_at=13.0, ended=14.0)
    summary = summarize([rnd], *fleet(routes, [commit], {}), began=0.0)
    assert summary["redis_cut_update"]["critical_samples"] == 31
    assert rows_of(summary, "redis_cut_update")["routes in the policy_stale window after a "
                                                "commit"] == ["31", "-", "-"]


def test_kill_worker_judges_the_process_start_and_the_rejoin_after_it_apart() -> None:
    rnd = Round("kill_worker", 0, "w1", 9.0, fault_at=10.0, repaired_at=12.5,
                recovered_at=18.0, ended=19.0, notes={"process_start_s": 5.2})
    summary = summarize([rnd], *fleet([], [], {}), began=0.0)
    kind = summary["kill_worker"]
    assert kind["recovery_s_max"] == pytest.approx(0.3)  # 5.5 s after the restart, less 5.2
    assert kind["recovery_target_s"] == LEASE_S
    assert kind["process_start_target_s"] == PROCESS_START_TARGET_S == 5.0
    rows = rows_of(summary, "kill_worker")
    assert rows["recovery s after the new process answered"] == ["0.30 / 0.30",
                                                                 f"max <= {LEASE_S:.1f}", "met"]
    assert rows["process start s"] == ["5.20 / 5.20", "max <= 5.0", "MISSED"]
