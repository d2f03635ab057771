"""Reading Linux's process table (/proc): who is running, what it costs, who started it.

Facts only: no signals are sent here (kvcoord.leftovers and kvcoord.machine_load act on them).
Standard library only. Off Linux (no /proc) every answer is empty.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True, slots=True)
class ProcInfo:
    """One process as /proc showed it: ``cpu_ticks`` is its user + system time so far."""

    pid: int
    ppid: int
    name: str
    state: str
    """``R`` running, ``S`` sleeping, ``Z`` a zombie (ended, not yet reaped), ... (proc(5))."""
    cpu_ticks: int
    start_ticks: int
    """When it started, in clock ticks after boot (with ``pid``, names it across pid reuse)."""

    def command(self) -> str:
        """Its command line (its name in brackets when it has none, or when it is gone)."""
        try:
            raw = (PROC / str(self.pid) / "cmdline").read_bytes()
        except OSError:
            raw = b""
        words = raw.rstrip(b"\0").split(b"\0")
        text = " ".join(word.decode(errors="replace") for word in words if word)
        return text or f"[{self.name}]"


def read(pid: int) -> ProcInfo | None:
    """``pid``'s entry, or None when it is gone (or unreadable)."""
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The name is in parentheses and may hold spaces or ')': the fields follow the last ')'.
    name = raw[raw.index("(") + 1:raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2:].split()
    # Fields after the name, 0-based: 0 state, 1 ppid, 11 utime, 12 stime, 19 starttime.
    return ProcInfo(pid, int(fields[1]), name, fields[0], int(fields[11]) + int(fields[12]),
                    int(fields[19]))


def pids() -> list[int]:
    """Every process id /proc lists now."""
    if not PROC.is_dir():
        return []
    return sorted(int(entry.name) for entry in PROC.iterdir() if entry.name.isdigit())


def snapshot() -> dict[int, ProcInfo]:
    """Every process now, by pid."""
    out = {}
    for pid in pids():
        info = read(pid)
        if info is not None:
            out[pid] = info
    return out


def ancestors(pid: int | None = None) -> set[int]:
    """``pid`` (default: this process) and every process above it, up to init."""
    chain = set()
    current: int | None = os.getpid() if pid is None else pid
    while current and current not in chain:
        chain.add(current)
        info = read(current)
        current = info.ppid if info is not None else None
    return chain


def environ_value(pid: int, name: str) -> str | None:
    """The value of ``name`` in ``pid``'s environment as it was at its exec, or None (unset,
    gone, or not ours to read)."""
    try:
        raw = (PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    prefix = f"{name}=".encode()
    for entry in raw.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix):].decode(errors="replace")
    return None
