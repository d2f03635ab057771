"""Benchmark figures of two git revisions from interleaved runs: did a change move any of them?

``python -m bench.interleave --before REV --after REV [--runs N] [--suite S] [--out DIR]
[--cpus LIST]`` checks each revision out (``git worktree add --detach`` in a temporary
directory, removed at the end, also on failure or Ctrl-C; the revision ``worktree`` means this
checkout as it is, edits included) and runs ``kvcoord bench S --quick`` there with this same
Python, in the order before, after, before, after, ... until each has run N times. Each run
imports that checkout's own packages (cwd and ``PYTHONPATH`` set to it; checked before the first
run).

Every numeric leaf under a suite's ``results`` is a figure, named ``<suite>.<step>.<key>``
(provenance and run metadata are not results, so they are never figures). A figure's verdict
compares its min-max ranges: ``overlap``, or ``separate`` with ``after`` ``higher`` or
``lower``. Which direction is better is not known here: that is for the reader. Figures that
separate are listed first; ``DIR/interleave.json`` keeps both commits and every run's values.

The compiled core (``setup.py``'s extensions) is build output, so a fresh checkout has none and
its benchmarks would run the pure-Python twins: ``--build-accel`` builds it in each checkout
first (``setup.py build_ext --inplace``), and the JSON's ``accel`` says which core each side ran.

Exit status: 0 when every run succeeded; 1 when a run failed (a crash or a broken invariant:
what was gathered is still written) or a checkout would not import its own packages; 2 for a
bad argument (an unknown revision, ``--runs`` below 1, an unusable ``--out`` or ``--cpus``);
130 on Ctrl-C (after cleaning up and writing what was gathered).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvcoord import child_process

REPO = Path(__file__).resolve().parent.parent
WORKTREE = "worktree"
"""The revision name that means this checkout as it is, not a commit."""
PACKAGES = ("coordinator", "worker", "kvcoord", "bench")
Values = dict[str, list[float | None]]
"""Figure name -> its value in each run, in run order (None where a run did not produce it)."""


def flatten(tree: Any, prefix: str = "") -> dict[str, float]:
    """The finite int/float leaves of nested dicts, keyed by their dotted path after ``prefix``;
    bools, strings, lists, None, NaN and infinities are left out."""
    if isinstance(tree, dict):
        flat: dict[str, float] = {}
        for key, value in tree.items():
            flat.update(flatten(value, f"{prefix}{key}."))
        return flat
    number = isinstance(tree, int | float) and not isinstance(tree, bool)
    return {prefix[:-1]: tree} if number and math.isfinite(tree) else {}


def verdict(before: list[float], after: list[float]) -> tuple[str, str | None]:
    """``("separate", "higher" | "lower")`` when the min-max ranges do not meet (``after``'s is
    above or below), ``("overlap", None)`` when they do (touching counts as meeting), and
    ``("missing", None)`` when either side has no value."""
    if not before or not after:
        return "missing", None
    if min(after) > max(before):
        return "separate", "higher"
    if max(after) < min(before):
        return "separate", "lower"
    return "overlap", None


def summarize(before: Values, after: Values) -> list[dict[str, Any]]:
    """One row per figure of either side: its values, ranges and verdict; separate ones first,
    then by name."""
    rows = []
    for name in sorted(set(before) | set(after)):
        b = [v for v in before.get(name, []) if v is not None]
        a = [v for v in after.get(name, []) if v is not None]
        kind, moved = verdict(b, a)
        rows.append({
            "name": name, "verdict": kind, "after_is": moved,
            "before_min": min(b, default=None), "before_max": max(b, default=None),
            "after_min": min(a, default=None), "after_max": max(a, default=None),
            "before": before.get(name, []), "after": after.get(name, []),
        })
    rows.sort(key=lambda row: (row["verdict"] != "separate", row["name"]))
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    """The rows as a text table, and a count of the verdicts."""
    from kvcoord.tables import render_table  # lazily: only the printing needs kvcoord

    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.6g}"

    cells = [[r["name"], fmt(r["before_min"]), fmt(r["before_max"]), fmt(r["after_min"]),
              fmt(r["after_max"]), r["verdict"] + (f": after {r['after_is']}" if r["after_is"]
                                                   else "")] for r in rows]
    counts = {k: sum(r["verdict"] == k for r in rows) for k in ("separate", "overlap", "missing")}
    return render_table(["figure", "before min", "before max", "after min", "after max",
                         "verdict"], cells) + "\n" + ", ".join(
        f"{n} {k}" for k, n in counts.items()) + f" (of {len(rows)} figures)"


def git(*args: str) -> subprocess.CompletedProcess[str]:
    """``git ARGS`` in this repository; never raises for a failing status."""
    return child_process.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, check=False)


def resolve(rev: str) -> dict[str, Any] | None:
    """``{"rev", "commit", "dirty"}`` for a revision (``dirty`` only for ``worktree``: whether
    this checkout differs from its HEAD), or None when git does not know it."""
    name = "HEAD" if rev == WORKTREE else rev
    found = git("rev-parse", "--verify", "--quiet", f"{name}^{{commit}}")
    if found.returncode != 0:
        return None
    dirty = bool(git("status", "--porcelain").stdout.strip()) if rev == WORKTREE else None
    return {"rev": rev, "commit": found.stdout.strip(), "dirty": dirty}


def check_imports(python: str, checkout: Path) -> str | None:
    """None when ``python`` run as the benchmarks are run in ``checkout`` finds that checkout's
    own PACKAGES; otherwise one line saying which package comes from where."""
    probe = ("import importlib.util as u, sys\n"
             "for n in sys.argv[1:]:\n    s = u.find_spec(n)\n    print(s and s.origin)")
    done = child_process.run([python, "-c", probe, *PACKAGES], cwd=checkout, env=env_for(checkout),
                          capture_output=True, text=True, check=False)
    origins = done.stdout.split("\n")[:len(PACKAGES)]
    wrong = [f"{name} not found" if origin == "None" else f"{name} from {origin}"
             for name, origin in zip(PACKAGES, origins, strict=False)
             if not origin.startswith(str(checkout.resolve()) + os.sep)]
    if done.returncode != 0 or len(origins) < len(PACKAGES) or wrong:
        return f"{checkout}: its own packages do not win: {', '.join(wrong) or done.stderr}"
    return None


def accel_of(python: str, checkout: Path) -> str:
    """Which index core ``checkout``'s benchmarks run (``coordinator.core.accel.status()``)."""
    probe = "from coordinator.core import accel; print(accel.status())"
    done = child_process.run([python, "-c", probe], cwd=checkout, env=env_for(checkout),
                          capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else f"unknown: {done.stderr.strip()}"


def build_accel(python: str, checkout: Path, log: Path) -> bool:
    """Build the compiled core in place in ``checkout`` (output to ``log``); True if it built."""
    with log.open("w") as stream:
        return child_process.run([python, "setup.py", "build_ext", "--inplace"], cwd=checkout,
                              env=env_for(checkout), stdout=stream, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, check=False).returncode == 0


def env_for(checkout: Path) -> dict[str, str]:
    """This environment with ``PYTHONPATH`` set to ``checkout`` alone."""
    return {**os.environ, "PYTHONPATH": str(checkout.resolve())}


def run_once(python: str, checkout: Path, suite: str, cpus: str | None, results: Path,
             log: Path) -> tuple[int, dict[str, float]]:
    """Run ``kvcoord bench SUITE --quick --out RESULTS`` in ``checkout`` (output to ``log``):
    its exit status and the figures of every ``<suite>.json`` it wrote."""
    command = [python, "-m", "kvcoord.cli", "bench", suite, "--quick", "--out", str(results)]
    if cpus:
        command = ["taskset", "-c", cpus, *command]
    with log.open("w") as stream:
        status = child_process.run(command, cwd=checkout, env=env_for(checkout), stdout=stream,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                check=False).returncode
    figures: dict[str, float] = {}
    for path in sorted(results.glob("*.json")):
        report = json.loads(path.read_text())
        figures.update(flatten(report.get("results", {}), f"{report.get('suite', path.stem)}."))
    return status, figures


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.interleave", description=__doc__
                                     .split("\n")[0])
    parser.add_argument("--before", required=True, metavar="REV",
                        help=f"git revision, or {WORKTREE} (this checkout as it is)")
    parser.add_argument("--after", required=True, metavar="REV", help="the same, for after")
    parser.add_argument("--runs", type=int, default=5, help="runs of each (default 5)")
    parser.add_argument("--suite", default="all", help="kvcoord bench suite (default all)")
    parser.add_argument("--out", type=Path, default=Path("."), metavar="DIR",
                        help="where interleave.json and the run logs go (default .)")
    parser.add_argument("--cpus", metavar="LIST", help="run the suites under taskset -c LIST")
    parser.add_argument("--build-accel", action="store_true",
                        help="build the compiled core in each checkout before the runs")
    return parser.parse_args(argv)


def refusal(args: argparse.Namespace, sides: dict[str, dict[str, Any] | None]) -> str | None:
    """Why these arguments cannot run (one line), checked before any checkout; None if fine.
    ``sides``: what ``resolve`` said of ``--before`` and ``--after``."""
    if args.runs < 1:
        return f"--runs must be at least 1 (got {args.runs})"
    for label, side in sides.items():
        if side is None:
            return f"unknown revision {getattr(args, label)!r}"
    if args.cpus is not None and (not re.fullmatch(r"[0-9,-]+", args.cpus)
                                  or shutil.which("taskset") is None):
        return f"--cpus {args.cpus!r}: needs taskset and a list like 0 or 0-1 or 0,2"
    try:
        (args.out / "logs").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"--out {args.out}: cannot create the directory ({exc.strerror})"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    resolved = {"before": resolve(args.before), "after": resolve(args.after)}
    if (why := refusal(args, resolved)) is not None:
        print(f"interleave: {why}", file=sys.stderr)
        return 2
    sides = {label: side for label, side in resolved.items() if side is not None}
    values: dict[str, Values] = {"before": {}, "after": {}}
    run_log: list[dict[str, Any]] = []
    tmp = Path(tempfile.mkdtemp(prefix="kvcoord-interleave-"))
    checkouts: dict[str, Path] = {}
    accel: dict[str, str] = {}
    status = 0
    try:
        for label, side in sides.items():
            if side["rev"] == WORKTREE:
                checkouts[label] = REPO
                continue
            checkouts[label] = tmp / label
            added = git("worktree", "add", "--detach", str(tmp / label), side["commit"])
            if added.returncode != 0:
                print(f"interleave: git worktree add failed: {added.stderr.strip()}",
                      file=sys.stderr)
                return 1
        for label, checkout in checkouts.items():
            if (why := check_imports(sys.executable, checkout)) is not None:
                print(f"interleave: {label} {why}", file=sys.stderr)
                return 1
            if args.build_accel and checkout != REPO and not build_accel(
                    sys.executable, checkout, args.out / "logs" / f"{label}-build.log"):
                print(f"interleave: {label}: the compiled core did not build (see "
                      f"{args.out / 'logs' / f'{label}-build.log'})", file=sys.stderr)
                return 1
            accel[label] = accel_of(sys.executable, checkout)
        order = [(i, label) for i in range(1, args.runs + 1) for label in sides]
        for n, (i, label) in enumerate(order, 1):
            rev = f"{sides[label]['rev']} ({sides[label]['commit'][:8]})"
            print(f"[{n}/{len(order)}] {label} {rev} run {i}/{args.runs} ...", file=sys.stderr,
                  flush=True)
            log = args.out / "logs" / f"{label}-{i}.log"
            started = time.perf_counter()
            code, figures = run_once(sys.executable, checkouts[label], args.suite, args.cpus,
                                     tmp / "results" / f"{label}-{i}", log)
            took = time.perf_counter() - started
            for name in set(figures) | set(values[label]):
                values[label].setdefault(name, [None] * (i - 1)).append(figures.get(name))
            run_log.append({"side": label, "run": i, "exit": code, "seconds": round(took, 2),
                            "figures": len(figures), "log": str(log)})
            print(f"    {took:.1f}s, exit {code}, {len(figures)} figures"
                  + ("" if code == 0 else f" (FAILED: see {log})"), file=sys.stderr, flush=True)
            status = status or (1 if code != 0 else 0)
    except KeyboardInterrupt:
        print("interleave: interrupted; writing what was gathered", file=sys.stderr)
        status = 130
    finally:
        for checkout in checkouts.values():
            if checkout != REPO:
                git("worktree", "remove", "--force", str(checkout))
        git("worktree", "prune")
        shutil.rmtree(tmp, ignore_errors=True)
    rows = summarize(values["before"], values["after"])
    report = {"suite": args.suite, "runs": args.runs, "cpus": args.cpus,
              "python": sys.executable, **sides, "accel": accel, "run_log": run_log,
              "failed_runs": sum(r["exit"] != 0 for r in run_log),
              "direction": "after_is says which way a figure moved, not whether that is better",
              "figures": rows}
    path = args.out / "interleave.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(render(rows))
    print(f"wrote {path}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
