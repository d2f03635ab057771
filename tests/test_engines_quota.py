"""The quota rig's CPU caps (bench/engines_quota.py), on the machine's real cgroup v1 ``cpu``
controller: a process started in a group capped at 0.3 core uses no more than that, and what
it forks stays in the group; the groups go when the run ends, and a dead run's are removed."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from bench.engines_quota import PREFIX, cgroup_root, cpu_quotas, quota_problem, remove_stale
from kvcoord import child_process, proc_table

PROBLEM = quota_problem()
pytestmark = pytest.mark.skipif(PROBLEM is not None and os.environ.get("CI") != "true",
                                reason=f"no writable cgroup here: {PROBLEM}")
BURN = "import os; os.fork(); [None for _ in iter(int, 1)]"  # parent and child both burn


def cores_used(pids: list[int], window_s: float = 1.5) -> float:
    before = {pid: proc_table.read(pid) for pid in pids}
    time.sleep(window_s)
    used = 0
    for pid, info in before.items():
        after = proc_table.read(pid)
        if info is not None and after is not None:
            used += after.cpu_ticks - info.cpu_ticks
    return used / proc_table.CLOCK_TICKS / window_s


def burner_and_fork(pid: int) -> list[int]:
    """The burner's pid and its fork's, once it has forked (within 10 s)."""
    deadline = time.monotonic() + 10
    while not (children := [p for p in proc_table.snapshot().values() if p.ppid == pid]):
        assert time.monotonic() < deadline, "the burner did not fork"
        time.sleep(0.05)
    return [pid, children[0].pid]


def test_a_capped_process_and_what_it_forks_use_no_more_than_the_cap() -> None:
    assert PROBLEM is None, PROBLEM
    with cpu_quotas() as quotas:
        inside = quotas.group("burner", 0.3)
        burner = child_process.start([*inside, sys.executable, "-c", BURN])
        try:
            pids = burner_and_fork(burner.pid)
            procs = (quotas.run / "burner" / "cgroup.procs").read_text().split()
            assert sorted(map(int, procs)) == sorted(pids)  # the fork stayed inside
            assert cores_used(pids) < 0.36  # two busy loops, one cap of 0.3 core
        finally:
            child_process.stop_processes([burner], grace=1.0)
        run = quotas.run
        assert run.is_dir()
    assert not run.exists()  # removed with the run


def test_a_group_started_uncapped_is_capped_by_cap() -> None:
    # Engines start uncapped (their imports are not what the cap models) and are capped once
    # up: before cap() the two loops take more than the cap, after it no more.
    assert PROBLEM is None, PROBLEM
    with cpu_quotas() as quotas:
        inside = quotas.group("starter", 0.3, capped=False)
        burner = child_process.start([*inside, sys.executable, "-c", BURN])
        try:
            pids = burner_and_fork(burner.pid)
            assert cores_used(pids) > 0.6  # two loops on two cores, no cap yet
            quotas.cap()
            time.sleep(0.2)
            assert cores_used(pids) < 0.36
        finally:
            child_process.stop_processes([burner], grace=1.0)


def test_a_dead_runs_empty_groups_are_removed() -> None:
    stale = cgroup_root() / f"{PREFIX}999999999"  # no such process
    (stale / "vllm-0").mkdir(parents=True)
    assert stale in remove_stale()
    assert not stale.exists()


def test_a_cap_must_be_positive(tmp_path: Path) -> None:
    with cpu_quotas() as quotas, pytest.raises(ValueError, match="must be > 0 cores"):
        quotas.group("none", 0.0)
