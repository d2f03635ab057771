"""`kvcoord bench` as users run it: from a checkout it finds bench/, installed without one it
says so in one line (exit 2); a crashed step or a broken invariant fails the run (exit 1)."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.runner import run_suite
from bench.suites import SUITES, Suite
from kvcoord import child_process
from kvcoord.bench_runner import NEEDS_CHECKOUT

ROOT = Path(__file__).resolve().parent.parent
# What the wheel holds (pyproject: packages coordinator*, worker*, kvcoord*): no bench/, no tests/.
WHEEL_PACKAGES = ("coordinator", "worker", "kvcoord")


def kvcoord(*args: str, cwd: Path, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    return child_process.run([sys.executable, "-m", "kvcoord.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def test_installed_without_a_checkout_bench_exits_2_with_one_line(tmp_path: Path) -> None:
    site = tmp_path / "site-packages"
    for package in WHEEL_PACKAGES:
        shutil.copytree(ROOT / package, site / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # PYTHONPATH puts the copy ahead of the editable install's finder, as a wheel would be.
    done = kvcoord("bench", "coordinator", "--quick", "--out", str(tmp_path / "out"),
                   cwd=elsewhere, env={**os.environ, "PYTHONPATH": str(site)})
    assert (done.returncode, done.stdout, done.stderr) == (2, "", NEEDS_CHECKOUT + "\n")
    assert not (tmp_path / "out").exists()


def test_from_another_directory_bench_finds_the_checkout(tmp_path: Path) -> None:
    # The editable install's kvcoord sits in the checkout, so bench/ is found from anywhere;
    # an unknown suite is answered by bench/runner.py itself, naming the known ones.
    done = kvcoord("bench", "no-such-suite", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr == ("kvcoord bench: unknown suite 'no-such-suite'; known: "
                           f"{', '.join([*SUITES, 'all'])}\n")
    assert done.stderr.startswith("kvcoord bench: unknown suite 'no-such-suite'; known: "
                                  "coordinator, worker, policy, replication, bridge, security, "
                                  "gateway, fleet, ")


def test_no_installed_package_imports_bench() -> None:
    # bench/ imports kvcoord; the reverse would be an import circle (and fail in a wheel).
    # kvcoord/bench_runner.py reaches bench through importlib, at call time only.
    found = []
    for package in WHEEL_PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                found += [f"{path.relative_to(ROOT)}: {n}" for n in names
                          if n == "bench" or n.startswith("bench.")]
    assert found == []


def suite(step: object, broken: list[str]) -> Suite:
    def run() -> object:
        if isinstance(step, Exception):
            raise step
        return step

    return Suite(steps=lambda quick: [("only", run)], targets=lambda results: [],
                 invariants=lambda results: broken)


def test_a_clean_suite_writes_its_json_with_provenance_and_exits_0(tmp_path: Path) -> None:
    assert run_suite("s", out=tmp_path, suites={"s": suite({"n": 1}, [])}, allow_busy=True) == 0
    report = json.loads((tmp_path / "s.json").read_text())
    assert report["results"] == {"only": {"n": 1}}
    assert report["invariants_broken"] == []
    assert report["commit"] == child_process.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
        check=True).stdout.strip()
    assert isinstance(report["dirty"], bool) and report["trace"] is None


def test_a_broken_invariant_fails_the_run_and_keeps_the_evidence(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = ["wrong_routes = 3: routes to a worker not READY"]
    assert run_suite("s", out=tmp_path, suites={"s": suite({"wrong_routes": 3}, broken)},
                     allow_busy=True) == 1
    assert json.loads((tmp_path / "s.json").read_text())["invariants_broken"] == broken
    assert ("kvcoord bench: FAILED s: invariant broken: wrong_routes = 3: routes to a worker "
            "not READY") in capsys.readouterr().err


def test_a_step_that_raises_fails_the_run_writes_no_json_and_the_next_suite_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    suites = {"crash": suite(RuntimeError("RPC already finished"), []),
              "fine": suite({"n": 1}, [])}
    assert run_suite("all", out=tmp_path, suites=suites, allow_busy=True) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fine.json"]
    err = capsys.readouterr().err
    assert "Traceback" in err
    assert "FAILED crash: step only raised RuntimeError: RPC already finished" in err


def test_an_out_that_cannot_be_a_directory_exits_2_naming_it_before_any_suite_runs(
    tmp_path: Path,
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = kvcoord("bench", "all", "--quick", "--out", str(blocker / "results"), cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.splitlines() == [
        f"kvcoord bench: --out {blocker / 'results'}: cannot create the directory "
        "(Not a directory)"]
