"""``python -m bench.chaos`` as ``make smoke`` and ``make chaos`` run it, when it cannot run: a
missing capability (here: no ``ip`` on PATH) skips the quick run with the reason (exit 0) and
refuses a full run (exit 2), except under ``CI=true``, where it fails (exit 1); a fault kind it
does not know is refused before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvcoord import child_process

ROOT = Path(__file__).resolve().parent.parent


def chaos(*args: str, ci: bool, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PATH"] = str(tmp / "empty")  # no `ip`, no `redis-server`, no `nft`
    if ci:
        env["CI"] = "true"
    return child_process.run([sys.executable, "-m", "bench.chaos", *args, "--out", str(tmp)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_a_quick_run_without_ip_is_skipped_with_the_reason(tmp_path: Path) -> None:
    done = chaos("--quick", ci=False, tmp=tmp_path)
    assert done.returncode == 0
    assert "chaos: skipped: needs Linux with iproute2" in done.stderr
    assert not (tmp_path / "chaos.json").exists()


def test_a_full_run_without_ip_is_refused(tmp_path: Path) -> None:
    done = chaos(ci=False, tmp=tmp_path)
    assert done.returncode == 2
    assert "chaos: skipped: needs Linux with iproute2" in done.stderr


def test_under_ci_a_missing_capability_fails(tmp_path: Path) -> None:
    done = chaos("--quick", ci=True, tmp=tmp_path)
    assert done.returncode == 1
    assert "chaos: FAILED: needs Linux with iproute2" in done.stderr


def test_an_unknown_fault_kind_is_refused_naming_the_known_ones(tmp_path: Path) -> None:
    done = chaos("--quick", "--faults", "kill_worker,flood", ci=False, tmp=tmp_path)
    assert done.returncode == 2
    assert "unknown fault kinds ['flood']" in done.stderr and "packet_loss" in done.stderr


def test_a_bad_round_count_or_out_is_refused_before_anything_starts(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for args, needle in [(["--rounds", "0"], "--rounds must be >= 1, got 0"),
                         (["--out", str(blocker / "x")], f"--out {blocker / 'x'}: cannot create")]:
        done = child_process.run([sys.executable, "-m", "bench.chaos", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr[-2000:]
        assert needle in done.stderr
        assert "Traceback" not in done.stderr
