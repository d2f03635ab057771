"""A benchmark refuses to start on a busy machine, naming what keeps it busy, unless told
``--allow-busy``; either way its JSON says what else ran at its start (kvcoord.machine_load)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.runner import run_suite
from bench.suites import Suite
from kvcoord import child_process, machine_load

ROOT = Path(__file__).resolve().parent.parent
BURN = "while True: pass"


@pytest.fixture
def burner() -> Iterator[subprocess.Popen[bytes]]:
    """A process using a whole core until the test ends."""
    process = child_process.start([sys.executable, "-c", BURN])
    try:
        yield process
    finally:
        child_process.stop_processes([process], grace=1.0)


def one_step_suite() -> Suite:
    return Suite(steps=lambda quick: [("only", lambda: {"n": 1})],
                 targets=lambda results: [], invariants=lambda results: [])


def test_the_sample_names_a_busy_process_with_its_share_of_a_core(
    burner: subprocess.Popen[bytes],
) -> None:
    load = machine_load.measure()
    burning = [p for p in load.busiest if p.pid == burner.pid]
    assert len(burning) == 1 and burning[0].command == f"{sys.executable} -c {BURN}"
    assert machine_load.BUSY_CORES < burning[0].cores <= 1.05 and load.busy()
    assert load.as_json()["busiest"][0]["pid"] == burner.pid


def test_a_suite_refuses_to_start_on_a_busy_machine_naming_the_process(
    burner: subprocess.Popen[bytes], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    assert run_suite("s", out=tmp_path, suites={"s": one_step_suite()}) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcoord bench: the machine is busy: other processes use ")
    assert f"pid {burner.pid} {sys.executable} -c {BURN}" in err
    assert err.rstrip().endswith("pass --allow-busy to measure anyway")
    assert not (tmp_path / "s.json").exists()


def test_allow_busy_runs_and_the_json_records_the_busy_process(
    burner: subprocess.Popen[bytes], tmp_path: Path,
) -> None:
    assert run_suite("s", out=tmp_path, suites={"s": one_step_suite()}, allow_busy=True) == 0
    report = json.loads((tmp_path / "s.json").read_text())
    machine = report["machine_at_start"]
    assert machine["other_processes_cores"] > machine_load.BUSY_CORES
    assert machine["busiest"][0]["pid"] == burner.pid
    assert len(machine["load_average_1_5_15m"]) == 3 and machine["cpus"] == os.cpu_count()


def test_the_cli_and_chaos_take_allow_busy_and_refuse_without_it(
    burner: subprocess.Popen[bytes], tmp_path: Path,
) -> None:
    bench = child_process.run(
        [sys.executable, "-m", "kvcoord.cli", "bench", "coordinator", "--quick", "--out",
         str(tmp_path / "bench")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bench.returncode == 2 and f"pid {burner.pid} " in bench.stderr, bench.stderr
    assert not (tmp_path / "bench").exists() or not any((tmp_path / "bench").iterdir())
    chaos = child_process.run(
        [sys.executable, "-m", "bench.chaos", "--quick", "--out", str(tmp_path / "chaos")],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    if "chaos: skipped" in chaos.stderr:  # no root or no `ip` here: it never gets that far
        pytest.skip(chaos.stderr.strip())
    assert chaos.returncode == 2 and chaos.stderr.startswith("chaos: the machine is busy"), \
        chaos.stderr
    assert f"pid {burner.pid} " in chaos.stderr
