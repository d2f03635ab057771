"""The engines bench's matrix: one row per router of every committed case
(``bench/results/engines/*.json``, each written by ``kvcoord bench engines --case NAME``), so
the matrix fills over several runs, then the simulator's prediction error for each router of
every case it predicts (engines of their own: the quota rig). A case measured on a busy machine
(``machine_at_start`` says so) is void: listed, never tabled; one begun or ended on a dirty
tree is flagged. A case's commit is the one its run began on (the runner stamps the JSON when
it ends). Run: ``python -m bench.engines_matrix [DIR]``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.bench_engines import FULL_TRACE, TRACE_VAR
from bench.engines_ceiling import case_ceilings
from kvcoord.tables import render_table

RESULTS = Path(__file__).resolve().parent / "results" / "engines"
COLUMNS = (("ttft_p50_ms", "TTFT p50 ms", "{:,.0f}"), ("ttft_p99_ms", "TTFT p99 ms", "{:,.0f}"),
           ("cached_share", "cached", "{:.1%}"))


def _cell(measure: dict[str, float], fmt: str) -> str:
    return (f"{fmt.format(measure['mean'])} ({fmt.format(measure['min'])}-"
            f"{fmt.format(measure['max'])})")


def load_cases(folder: Path = RESULTS) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Every case's result by case name, and the void ones' names (a busy start)."""
    cases: dict[str, dict[str, Any]] = {}
    void = []
    for path in sorted(folder.glob("*.json")):
        report = json.loads(path.read_text())
        for name, case in report["results"]["engines"]["cases"].items():
            if report.get("machine_at_start", {}).get("busy"):
                void.append(name)
            else:
                setup = report["results"]["engines"].get("setup", {})
                began = setup.get("started_at", {})
                cases[name] = {
                    **case, "commit": began.get("commit", report.get("commit")),
                    "dirty": bool(report.get("dirty") or began.get("dirty")),
                    "wall_s": setup.get("wall_s"), "setup": setup}
    return cases, void


def matrix(cases: dict[str, dict[str, Any]],
           ceilings: dict[str, float | None] | None = None) -> str:
    """One row per router of every case; kv_aware's row carries the case's verdicts and its
    stream's cache ceiling (``engines_ceiling``; "-" where unknown)."""
    headers = ["case", "engines", "router", *(label for _, label, _ in COLUMNS), "ceiling",
               "verdicts"]
    rows = []
    for name, case in cases.items():
        for router, measured in case["routers"].items():
            first = router == "kv_aware"
            verdicts = ", ".join(f"{m.removesuffix('_ms')} {v}" for m, v in
                                 case["verdicts"].items()) if first else ""
            ceiling = (ceilings or {}).get(name)
            rows.append([name, str(case["engines"]["count"]), router,
                         *(_cell(measured[key], fmt) for key, _, fmt in COLUMNS),
                         ("-" if ceiling is None else f"{ceiling:.1%}") if first else "",
                         verdicts])
    return render_table(headers, rows)


def errors(cases: dict[str, dict[str, Any]]) -> str:
    """The simulator's relative error (predicted / measured - 1) per router of every predicted
    case, and each case's commit and minutes."""
    headers = ["case", "router", "simulated as", "p50 error", "p99 error", "cached error",
               "commit", "minutes"]
    rows = []
    for name, case in cases.items():
        for router, predicted in ((case.get("prediction") or {}).get("routers") or {}).items():
            wall = case.get("wall_s")
            rows.append([name, router, predicted["policy"],
                         *(f"{predicted['error'][k]:+.0%}" if predicted["error"][k] is not None
                           else "-" for k in ("ttft_p50_ms", "ttft_p99_ms", "cached_share")),
                         (case["commit"] or "?")[:8], "-" if wall is None else f"{wall / 60:.1f}"])
    return render_table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    folder = Path(args[0]) if args else RESULTS
    cases, void = load_cases(folder)
    if not cases and not void:
        print(f"no cases in {folder}: run `kvcoord bench engines --case NAME`", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="kvcoord-matrix-") as work:
        ceilings = case_ceilings(cases, Path(os.environ.get(TRACE_VAR) or FULL_TRACE),
                                 Path(work))
    print(matrix(cases, ceilings))
    print("ceiling: the most of the stream's prompt tokens any router can serve from cache "
          "(one engine of unbounded memory, the stream in order)")
    print("\nthe simulator's error, calibrated on each case's engines")
    print(errors(cases))
    for name in void:
        print(f"void (the machine was busy at its start): {name}")
    dirty = [name for name, case in cases.items() if case["dirty"]]
    for name in dirty:
        print(f"from a dirty tree (not quotable): {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
