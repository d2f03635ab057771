"""The engines bench's matrix: one row per router of every committed case
(``bench/results/engines/*.json``, each written by ``kvcoord bench engines --case NAME``), so
the matrix fills over several runs. A case measured on a busy machine (``machine_at_start``
says so) is void: listed, never tabled. Run: ``python -m bench.engines_matrix [DIR]``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

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
                cases[name] = {**case, "commit": report.get("commit"),
                               "dirty": report.get("dirty")}
    return cases, void


def matrix(cases: dict[str, dict[str, Any]]) -> str:
    headers = ["case", "engines", "router", *(label for _, label, _ in COLUMNS), "verdicts"]
    rows = []
    for name, case in cases.items():
        for router, measured in case["routers"].items():
            verdicts = ", ".join(f"{m.removesuffix('_ms')} {v}" for m, v in
                                 case["verdicts"].items()) if router == "kv_aware" else ""
            rows.append([name, str(case["engines"]["count"]), router,
                         *(_cell(measured[key], fmt) for key, _, fmt in COLUMNS), verdicts])
    return render_table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    folder = Path(args[0]) if args else RESULTS
    cases, void = load_cases(folder)
    if not cases and not void:
        print(f"no cases in {folder}: run `kvcoord bench engines --case NAME`", file=sys.stderr)
        return 1
    print(matrix(cases))
    for name in void:
        print(f"void (the machine was busy at its start): {name}")
    dirty = [name for name, case in cases.items() if case["dirty"]]
    for name in dirty:
        print(f"from a dirty tree (not quotable): {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
