"""What else the machine is doing when a benchmark starts.

A benchmark on a small machine measures whatever else runs beside it: on 2 cores one leftover
engine skews every figure after it. So each benchmark, before it starts, samples the other
processes' CPU over ``WINDOW_S`` (every process but itself and those above it, kernel threads
included), records that and the load average in its JSON, and refuses to start when the others
use more than ``BUSY_CORES`` unless told ``--allow-busy``; a result measured anyway says
``"busy": true`` and counts as void (``bench.engines_matrix`` leaves it out).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from kvcoord import proc_table

WINDOW_S = 1.0
BUSY_CORES = 0.5
"""Other processes' CPU, in cores, above which the machine is too busy to measure on."""
NAMED = 5  # the busiest processes named in the JSON and in a refusal


@dataclass(frozen=True, slots=True)
class BusyProcess:
    pid: int
    command: str
    cores: float


@dataclass(frozen=True, slots=True)
class MachineLoad:
    """The machine beside a benchmark at its start: ``others_cores`` is every other process's
    CPU over ``window_s``, in cores; ``busiest`` names the top ones."""

    load_average: tuple[float, float, float]
    others_cores: float
    busiest: tuple[BusyProcess, ...]
    window_s: float
    cpus: int

    def busy(self, limit: float = BUSY_CORES) -> bool:
        return self.others_cores > limit

    def as_json(self) -> dict[str, Any]:
        return {
            "busy": self.busy(),
            "load_average_1_5_15m": [round(x, 2) for x in self.load_average],
            "other_processes_cores": round(self.others_cores, 3),
            "busiest": [{"pid": p.pid, "command": p.command[:200], "cores": round(p.cores, 3)}
                        for p in self.busiest],
            "window_s": self.window_s, "cpus": self.cpus,
        }

    def refusal(self, what: str, limit: float = BUSY_CORES) -> str:
        """One line saying why ``what`` will not start, naming the busiest processes."""
        named = "; ".join(f"pid {p.pid} {p.command[:80]} {p.cores:.2f}" for p in self.busiest)
        return (f"{what}: the machine is busy: other processes use {self.others_cores:.2f} "
                f"cores (more than {limit}) over {self.window_s:g} s: {named}. End them, or "
                "pass --allow-busy to measure anyway")


def measure(window_s: float = WINDOW_S) -> MachineLoad:
    """Sample every process's CPU time twice, ``window_s`` apart (blocks that long)."""
    skip = proc_table.ancestors()
    before = proc_table.snapshot()
    started = time.monotonic()
    time.sleep(window_s)
    after = proc_table.snapshot()
    elapsed = time.monotonic() - started
    used: list[BusyProcess] = []
    for pid, info in after.items():
        if pid in skip:
            continue
        earlier = before.get(pid)
        # A process that started meanwhile (or a reused pid) spent all its CPU in the window.
        base = earlier.cpu_ticks if earlier and earlier.start_ticks == info.start_ticks else 0
        ticks = info.cpu_ticks - base
        if ticks > 0:
            used.append(BusyProcess(pid, info.command(),
                                    ticks / proc_table.CLOCK_TICKS / elapsed))
    used.sort(key=lambda p: p.cores, reverse=True)
    return MachineLoad(os.getloadavg(), sum(p.cores for p in used), tuple(used[:NAMED]),
                       round(elapsed, 3), os.cpu_count() or 1)
