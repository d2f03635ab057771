"""The layers are checked: the import contracts in pyproject.toml (run by `make lint`) hold on
this tree and break on a tree that crosses each of them; the import paths DESIGN names stay
importable; no hand-written module outgrows 400 lines."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("coordinator", "worker", "kvcoord")
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"

CONTRACT_PATHS = [
    ("coordinator.client", "CoordinatorClient"),
    ("coordinator.client", "AsyncCoordinatorClient"),
    ("coordinator.client", "KvcoordError"),
    ("worker.client", "WorkerClient"),
    ("coordinator.index", "PrefixIndex"),
    ("coordinator.hashing", "page_keys"),
    ("worker.allocator", "PageAllocator"),
]


@pytest.mark.parametrize(("module", "name"), CONTRACT_PATHS)
def test_the_import_paths_design_names_stay_importable(module: str, name: str) -> None:
    assert callable(getattr(importlib.import_module(module), name))


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(root), "PATH": ""})


def test_the_tree_keeps_every_import_contract() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "6 kept, 0 broken" in result.stdout


def test_each_contract_breaks_on_an_import_that_crosses_it(tmp_path: Path) -> None:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    crossings = {
        "coordinator/core/routing.py": "import asyncio",  # a pure core on the event loop
        "worker/allocator.py": "import socket",  # the worker's pure core on the network
        "coordinator/config.py": "import torch",  # the coordinator needing torch
        "worker/gate.py": "import coordinator.server.convert\nimport kvcoord.tables",
        "coordinator/core/hashing.py": "import coordinator.core.router",  # a cycle
        "kvcoord/gateway/routing.py": "import worker.runtime",  # the gateway needing torch
    }
    for path, line in crossings.items():
        with (tmp_path / path).open("a") as source:
            source.write(f"\n{line}\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    out = result.stdout
    assert "0 kept, 6 broken" in out, out[-3000:]
    assert "kvcoord.gateway.routing -> worker.runtime" in out
    assert "coordinator.core.routing -> asyncio" in out
    assert "worker.allocator -> socket" in out
    assert "coordinator.config -> torch" in out
    assert "worker.gate -> coordinator.server.convert" in out
    assert "worker.gate -> kvcoord.tables" in out
    assert "No cycles are allowed in coordinator.core" in out


def test_no_hand_written_module_is_over_400_lines() -> None:
    long = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "_pb2" in path.name:
                continue  # generated stubs
            lines = len(path.read_text().splitlines())
            if lines > 400:
                long[str(path.relative_to(ROOT))] = lines
    assert long == {}
