"""Under CI (CI=true) a namespace test whose capability is missing fails instead of skipping
(tests/netns.py); elsewhere it skips with the reason. Run in a child pytest whose PATH has no
`ip`, as on a machine without iproute2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcoord import child_process

ROOT = Path(__file__).resolve().parent.parent
NEEDS_NAMESPACES = """
from tests.netns import Network

def test_needs_namespaces():
    with Network() as net:
        net.add_host("a")
"""


def run_without_ip(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_child.py").write_text(NEEDS_NAMESPACES)
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env |= {"PATH": str(empty), "PYTHONPATH": str(ROOT)} | ({} if ci is None else {"CI": ci})
    return child_process.run(
        [sys.executable, "-m", "pytest", "-q", "-rsf", "-p", "no:cacheprovider", "-c",
         os.devnull, "--rootdir", str(tmp_path), str(tmp_path / "test_child.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("ci", ["true", "1"])
def test_under_ci_a_missing_capability_fails(tmp_path: Path, ci: str) -> None:
    done = run_without_ip(tmp_path, ci)
    assert done.returncode == 1, done.stdout
    assert "1 failed" in done.stdout
    assert ("no `ip` command (apt-get install iproute2) (CI=true: the namespace tests must run, "
            "not skip)") in done.stdout


def test_outside_ci_a_missing_capability_skips_with_its_reason(tmp_path: Path) -> None:
    done = run_without_ip(tmp_path, None)
    assert done.returncode == 0, done.stdout
    assert "1 skipped" in done.stdout
    assert "no `ip` command (apt-get install iproute2)" in done.stdout
