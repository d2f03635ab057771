"""Run benchmark suites: print each suite's tables, check its invariants, write its JSON.

``kvcoord bench SUITE [--quick] [--out DIR]`` lands here (through ``kvcoord.bench_runner``). A
suite (``bench.suites.SUITES``) is a list of steps, a targets table and its invariants:

- a **target** is a performance bar (met / MISSED): a miss is reported, never an error, since
  a noisy or small machine misses bars without anything being wrong;
- an **invariant** is something the run measured that must hold whatever the machine (a route
  to a worker that does not hold what the answer claims, a lost page or record, a crash): a
  broken one makes the run exit 1, after its JSON is written so the evidence is kept;
- a step that raises is a crash: its traceback is printed, the suite writes no JSON (a partial
  result must not replace a whole one), the remaining suites still run, and the exit is 1.

Every JSON carries ``kvcoord.provenance.provenance()`` (commit, dirty tree, trace).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench.suites import SUITES, Choices, Suite
from kvcoord import machine_load
from kvcoord.provenance import provenance
from kvcoord.tables import render_table

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


class StepFailed(Exception):
    """A step raised: the suite crashed (its traceback has been printed)."""


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def _flat_rows(section: dict[str, Any], prefix: str = "") -> list[list[str]]:
    rows: list[list[str]] = []
    for key, value in section.items():
        if isinstance(value, dict):
            rows.extend(_flat_rows(value, f"{prefix}{key}."))
        else:
            rows.append([f"{prefix}{key}", _fmt(value)])
    return rows


def _run_steps(suite: Suite, quick: bool, choices: Choices) -> dict[str, Any]:
    """Every step's result by name; StepFailed when one raises."""
    results: dict[str, Any] = {}
    steps = suite.steps(quick) if suite.chosen is None else suite.chosen(quick, choices)
    for i, (name, step) in enumerate(steps, 1):
        print(f"[{i}/{len(steps)}] {name} ...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        try:
            results[name] = step()
        except Exception as exc:
            traceback.print_exc()
            raise StepFailed(f"step {name} raised {type(exc).__name__}: {exc}") from exc
        print(f"      done in {time.perf_counter() - started:.1f}s", file=sys.stderr, flush=True)
    return results


def run_suite(suite: str, *, quick: bool = False, out: Path = RESULTS,
              suites: Mapping[str, Suite] = SUITES,
              options: Mapping[str, str] | None = None, allow_busy: bool = False) -> int:
    """Run one suite of ``suites``, or every one for ``all``: 0 when every step ran and every
    invariant held, 1 otherwise, 2 for an unknown suite, a suite whose ``preflight`` says what
    it lacks (its line printed) or an ``out`` that cannot be made a directory (checked first).
    ``all`` runs the suites whose ``in_all`` is true. JSON goes to ``out/<suite>.json``.
    ``options`` (option -> the value given, e.g. ``{"rig": "production"}``) go to a suite that
    takes them; one it does not take, or an unknown name in one, exits 2 naming the known ones.
    Run it from the checkout's root: steps start ``python -m bench.…`` servers.

    Before anything runs, the other processes' CPU is sampled (kvcoord.machine_load): above
    half a core the run exits 2 naming them, unless ``allow_busy``; either way each JSON
    records it (``machine_at_start``)."""
    names = [n for n, s in suites.items() if s.in_all] if suite == "all" else [suite]
    if any(n not in suites for n in names):
        known = ", ".join([*suites, "all"])
        print(f"kvcoord bench: unknown suite {suite!r}; known: {known}", file=sys.stderr)
        return 2
    choices = _choices(suite, names, suites, options or {})
    if choices is None:
        return 2
    for name in names:  # a missing optional peer: say how to get it, run nothing
        check = suites[name].preflight
        lacking = check(quick) if check is not None else None
        if lacking is not None:
            print(lacking, file=sys.stderr)
            return 2
    try:  # before any suite runs: a place that cannot take the JSON must not waste the run
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"kvcoord bench: --out {out}: cannot create the directory ({exc.strerror})",
              file=sys.stderr)
        return 2
    machine = machine_load.measure()
    if machine.busy() and not allow_busy:
        print(machine.refusal("kvcoord bench"), file=sys.stderr)
        return 2
    failures: list[str] = []
    took: list[str] = []
    for name in names:
        print(f"== suite {name}", file=sys.stderr, flush=True)
        started = time.perf_counter()
        try:
            results = _run_steps(suites[name], quick, choices)
        except StepFailed as exc:
            failures.append(f"{name}: {exc}")
            continue
        finally:
            took.append(f"{name} {time.perf_counter() - started:.0f}s")
        broken = suites[name].invariants(results)
        result_name = suites[name].result_name
        _report(name, results, suites[name].targets(results), broken, quick, out, machine,
                result_name(choices) if result_name is not None else name)
        failures.extend(f"{name}: invariant broken: {b}" for b in broken)
    print(f"kvcoord bench: {', '.join(took)}", file=sys.stderr)
    for failure in failures:
        print(f"kvcoord bench: FAILED {failure}", file=sys.stderr)
    return 1 if failures else 0


def _choices(suite: str, names: list[str], suites: Mapping[str, Suite],
             options: Mapping[str, str]) -> Choices | None:
    """``options`` parsed by the one suite that takes them; None (its line printed) when a
    suite does not take them or a value is unknown."""
    if not options:
        return {}
    parse = suites[names[0]].parse if len(names) == 1 else None
    if parse is None:
        taken = ", ".join(f"--{o}" for o in options)
        print(f"kvcoord bench: suite {suite!r} takes no {taken}", file=sys.stderr)
        return None
    try:
        return {option: parse(option, value) for option, value in options.items()}
    except ValueError as exc:
        print(f"kvcoord bench {suite}: {exc}", file=sys.stderr)
        return None


def _report(suite: str, results: dict[str, Any], targets: list[list[str]], broken: list[str],
            quick: bool, out: Path, machine: machine_load.MachineLoad,
            file_name: str) -> None:
    for name, section in results.items():
        if section is None:
            print(f"\n{name}: not measured (optional peer package not installed)")
            continue
        print(f"\n{name}")
        print(render_table(["measure", "value"], _flat_rows(section)))
    print(f"\ntargets ({suite})")
    print(render_table(["what", "target", "measured", "verdict"], targets))
    print(f"\ninvariants ({suite}): " + ("all held" if not broken else
                                         f"{len(broken)} BROKEN: " + "; ".join(broken)))
    report = {
        "suite": suite, "quick": quick, "python": platform.python_version(),
        "machine": platform.machine(), "cpus": os.cpu_count(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **provenance(), "machine_at_start": machine.as_json(),
        "invariants_broken": broken, "results": results,
    }
    path = out / f"{file_name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    print(f"\nwrote {path}")
