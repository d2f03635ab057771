"""The engines matrix (bench/engines_matrix.py) reads every case's JSON in a folder: each
router's row with its ranges, kv_aware's verdicts; a case started on a busy machine is void
(listed, not tabled); one begun or ended on a dirty tree is flagged; the simulator's errors
are tabled per predicted router."""

from __future__ import annotations

import json
from pathlib import Path

from bench.engines_matrix import load_cases, main

MEASURE = {"mean": 1000.0, "min": 900.0, "max": 1100.0}
SHARE = {"mean": 0.45, "min": 0.4, "max": 0.5}


def write_case(folder: Path, name: str, *, busy: bool, dirty: bool = False,
               dirty_start: bool = False, predicted: bool = False,
               ceiling: float | None = None) -> None:
    router = {"ttft_p50_ms": MEASURE, "ttft_p99_ms": MEASURE, "cached_share": SHARE}
    case: dict[str, object] = {"engines": {"count": 4}, "verdicts": {"ttft_p50_ms": "overlap"},
                               "routers": {"kv_aware": router, "smg_cache_aware": router}}
    if predicted:
        case["prediction"] = {"routers": {"kv_aware": {"policy": "kv_aware", "error": {
            "ttft_p50_ms": 0.12, "ttft_p99_ms": -0.3, "cached_share": None}}}}
    setup: dict[str, object] = {"started_at": {"commit": "began0123456", "dirty": dirty_start},
                                "wall_s": 840.0}
    if ceiling is not None:  # as a run records it: its stream's ceiling
        case["workload"] = name.split("/")[0]
        setup["streams"] = {name.split("/")[0]: {"ceiling": {"cached_share": ceiling}}}
    report = {"commit": "ended", "dirty": dirty, "machine_at_start": {"busy": busy},
              "results": {"engines": {"setup": setup, "cases": {name: case}}}}
    (folder / f"{name.replace('/', '-')}.json").write_text(json.dumps(report))


def test_the_matrix_tables_every_case_and_leaves_void_ones_out(
    tmp_path: Path, capsys: object,
) -> None:
    write_case(tmp_path, "trace/quota/pressure", busy=False, ceiling=0.6512)
    write_case(tmp_path, "chat/quota/pressure", busy=True)
    write_case(tmp_path, "agent/quota/roomy", busy=False, dirty=True)
    write_case(tmp_path, "chat/quota/roomy", busy=False, dirty_start=True, predicted=True)
    cases, void = load_cases(tmp_path)
    assert (sorted(cases), void) == (
        ["agent/quota/roomy", "chat/quota/roomy", "trace/quota/pressure"],
        ["chat/quota/pressure"])
    # the commit its run began on, not the one it ended on
    assert cases["trace/quota/pressure"]["commit"] == "began0123456"
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    lines = out.splitlines()
    assert sum("trace/quota/pressure" in line for line in lines) == 2  # one row per router
    assert "1,000 (900-1,100)" in out and "45.0% (40.0%-50.0%)" in out
    assert "ttft_p50 overlap" in out
    # the stream's cache ceiling on kv_aware's row; "-" where the run recorded none
    (ceiling_row,) = [line for line in lines if "trace/quota/pressure" in line
                      and "kv_aware" in line]
    assert "65.1%" in ceiling_row
    (unknown_row,) = [line for line in lines if "agent/quota/roomy" in line
                      and "kv_aware" in line]
    assert " - " in unknown_row
    assert "void (the machine was busy at its start): chat/quota/pressure" in lines
    assert "from a dirty tree (not quotable): agent/quota/roomy" in lines
    assert "from a dirty tree (not quotable): chat/quota/roomy" in lines  # began dirty
    # the simulator's errors: one row per predicted router, with its commit and minutes
    (error_row,) = [line.split() for line in lines if "+12%" in line]
    assert error_row == ["chat/quota/roomy", "kv_aware", "kv_aware", "+12%", "-30%", "-",
                         "began012", "14.0"]


def test_an_empty_folder_says_how_to_fill_it(tmp_path: Path) -> None:
    assert main([str(tmp_path)]) == 1
