"""Processes a run started that are still running after it: found, listed, ended.

``make test`` and ``make test-vllm`` run their suites with ``KVCOORD_PROCESS_OWNER`` set to a
mark of their own, which every process started under them carries (inherited, and re-added by
kvcoord.child_process where a test passes an environment of its own). After the suite,
``python -m kvcoord.leftovers MARK`` waits up to ``--grace-s`` for such processes to end, then
lists each one still running (pid, age, command), SIGKILLs them and exits 1; 0 when none is
left. It never touches itself or the processes above it (the make recipe's shell).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Sequence

from kvcoord import proc_table
from kvcoord.child_process import OWNER_VAR, owner_marks

POLL_S = 0.2


def marked(owner: str) -> list[proc_table.ProcInfo]:
    """The processes carrying ``owner`` as their mark, but this one and those above it."""
    skip = proc_table.ancestors()
    found = []
    for pid in proc_table.pids():
        if pid in skip or owner not in owner_marks(proc_table.environ_value(pid, OWNER_VAR)):
            continue
        info = proc_table.read(pid)
        if info is not None:
            found.append(info)
    return found


def wait_gone(owner: str, grace_s: float) -> list[proc_table.ProcInfo]:
    """Poll until no process carries ``owner`` or ``grace_s`` passes; those still running."""
    deadline = time.monotonic() + grace_s
    while True:
        left = marked(owner)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(POLL_S)


def uptime_ticks() -> float:
    with open("/proc/uptime") as uptime:
        return float(uptime.read().split()[0]) * proc_table.CLOCK_TICKS


def report(left: Sequence[proc_table.ProcInfo], owner: str) -> str:
    now = uptime_ticks()
    lines = [f"leftovers: {len(left)} process(es) started under {OWNER_VAR}={owner} still "
             "running (each was killed):"]
    for info in left:
        age = (now - info.start_ticks) / proc_table.CLOCK_TICKS
        lines.append(f"  pid {info.pid} (parent {info.ppid}), up {age:.0f} s: "
                     f"{info.command()[:300]}")
    return "\n".join(lines)


def kill(left: Sequence[proc_table.ProcInfo]) -> None:
    for info in left:
        current = proc_table.read(info.pid)
        if current is None or current.start_ticks != info.start_ticks:
            continue  # gone, or its pid was reused meanwhile
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(info.pid, signal.SIGKILL)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcoord.leftovers", description=__doc__)
    parser.add_argument("owner", help=f"the {OWNER_VAR} value the run was given")
    parser.add_argument("--grace-s", type=float, default=10.0,
                        help="how long processes may take to end (default 10)")
    args = parser.parse_args(argv)
    if not args.owner or ":" in args.owner:
        parser.error("the owner mark must be one non-empty mark (no ':')")
    left = wait_gone(args.owner, args.grace_s)
    if not left:
        print(f"leftovers: none ({OWNER_VAR}={args.owner})")
        return 0
    print(report(left, args.owner), file=sys.stderr)
    kill(left)
    return 1


if __name__ == "__main__":
    sys.exit(main())
