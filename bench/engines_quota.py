"""CPU quotas for the engines bench's ``quota`` rig: each engine in a cgroup of its own, capped
at a share of a core, so that engines are independent servers (as GPUs are) instead of
processes slowing each other on a shared core.

Linux's cgroup v1 ``cpu`` controller (``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``) at
``$KVCOORD_CGROUP_CPU`` (default ``/sys/fs/cgroup/cpu``), written as root. A run's groups live
under ``kvcoord-bench-<pid>/``; they are removed when the run ends, and a later run removes the
empty groups of runs that died (a cgroup folder holds no data: only its processes keep it).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

CGROUP_VAR = "KVCOORD_CGROUP_CPU"
PERIOD_US = 100_000
PREFIX = "kvcoord-bench-"


def cgroup_root() -> Path:
    return Path(os.environ.get(CGROUP_VAR) or "/sys/fs/cgroup/cpu")


def quota_problem(root: Path | None = None) -> str | None:
    """Why CPU quotas cannot be set here (one line), or None when they can: the ``cpu``
    controller's folder must exist, have the quota files and take a new group."""
    root = root or cgroup_root()
    if not (root / "cpu.cfs_quota_us").exists():
        return (f"no cgroup v1 cpu controller at {root} (set {CGROUP_VAR} to where it is "
                "mounted)")
    probe = root / f"{PREFIX}probe-{os.getpid()}"
    try:
        probe.mkdir()
        (probe / "cpu.cfs_quota_us").write_text(str(PERIOD_US))
    except OSError as exc:
        return f"cannot write the cgroup cpu controller at {root} ({exc.strerror}; run as root)"
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()
    return None


def remove_stale(root: Path | None = None) -> list[Path]:
    """Remove the groups of runs whose process is gone (only empty groups can go: one that
    still holds a process is left, and listed by ``kvcoord.leftovers`` when it is ours)."""
    root = root or cgroup_root()
    removed = []
    for run in sorted(root.glob(f"{PREFIX}*")):
        pid = run.name.removeprefix(PREFIX)
        if pid.isdigit() and Path(f"/proc/{pid}").exists():
            continue
        with contextlib.suppress(OSError):
            for group in run.iterdir():
                if group.is_dir():
                    group.rmdir()
            run.rmdir()
            removed.append(run)
    return removed


class CpuQuotas:
    """This run's groups: ``group(name, cores)`` makes one capped at ``cores`` (a share of one
    core per period) and returns the argv prefix that starts a process in it; ``close``
    removes them all once their processes are gone."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or cgroup_root()
        self.run = self.root / f"{PREFIX}{os.getpid()}"
        self._caps: dict[Path, float] = {}

    def group(self, name: str, cores: float, *, capped: bool = True) -> list[str]:
        """A group capped at ``cores`` (or, with ``capped`` False, uncapped until ``cap``:
        a process's start-up, imports and compilation, is not what the cap models); the argv
        prefix that starts a process inside it (a shell that moves itself in, then execs the
        process: nothing it forks escapes)."""
        if not cores > 0:
            raise ValueError(f"a CPU quota must be > 0 cores, got {cores}")
        path = self.run / name
        path.mkdir(parents=True, exist_ok=True)
        (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        self._caps[path] = cores
        (path / "cpu.cfs_quota_us").write_text(
            str(round(cores * PERIOD_US)) if capped else "-1")
        return ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(path)]

    def cap(self) -> None:
        """Apply every group's cap now (those made uncapped included)."""
        for path, cores in self._caps.items():
            (path / "cpu.cfs_quota_us").write_text(str(round(cores * PERIOD_US)))

    def close(self, wait_s: float = 10.0) -> None:
        """Remove every group once empty (a stopped process leaves its group within moments);
        what is still busy after ``wait_s`` is left for ``remove_stale``."""
        deadline = time.monotonic() + wait_s
        for group in sorted(self.run.glob("*")) if self.run.exists() else []:
            while group.exists():
                try:
                    group.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
        with contextlib.suppress(OSError):
            self.run.rmdir()


@contextlib.contextmanager
def cpu_quotas(root: Path | None = None) -> Iterator[CpuQuotas]:
    """``CpuQuotas`` for one run, stale groups of dead runs removed first, its own after."""
    remove_stale(root)
    quotas = CpuQuotas(root)
    try:
        yield quotas
    finally:
        quotas.close()
