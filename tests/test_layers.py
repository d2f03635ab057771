"""The layers are checked: the import contracts in pyproject.toml (run by `make lint`) hold on
this tree and break on a tree that crosses each of them, an import under `if TYPE_CHECKING:`
included; the import paths DESIGN names stay importable; no hand-written module outgrows 400
lines, compiled ones (.pyx) included, but for the exemptions named with their reason; no module
but prefix_index.py reads PrefixIndex's private attributes."""

from __future__ import annotations

import ast
import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvcoord import child_process

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("coordinator", "worker", "kvcoord")
LINTED = (*PACKAGES, "bench")  # pyproject's root_packages: bench/ is checked for cycles too
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
INDEX_MODULE = ROOT / "coordinator" / "core" / "index" / "prefix_index.py"

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
    return child_process.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(root), "PATH": ""})


def test_the_tree_keeps_every_import_contract() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "6 kept, 0 broken" in result.stdout


def copy_with(tmp_path: Path, crossings: dict[str, str]) -> Path:
    """The linted packages and pyproject.toml in ``tmp_path``, each file of ``crossings`` with
    its text appended."""
    for package in LINTED:
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__", "results"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for path, text in crossings.items():
        with (tmp_path / path).open("a") as source:
            source.write(f"\n{text}\n")
    return tmp_path


def test_each_contract_breaks_on_an_import_that_crosses_it(tmp_path: Path) -> None:
    crossings = {
        "coordinator/core/routing/choosers.py": "import asyncio",  # a pure core on the event loop
        "worker/kv/allocator.py": "import socket",  # the worker's pure core on the network
        "coordinator/config.py": "import torch",  # the coordinator needing torch
        "worker/serving/gate.py": "import coordinator.server.convert\nimport kvcoord.tables",
        # a cycle between two subsystems of the core
        "coordinator/core/hashing/page_hasher.py": "import coordinator.core.routing.router",
        "kvcoord/gateway/routing.py": "import worker.runtime.runtime",  # the gateway needing torch
    }
    result = lint_imports(copy_with(tmp_path, crossings))
    assert result.returncode != 0
    out = result.stdout
    assert "0 kept, 6 broken" in out, out[-3000:]
    assert "kvcoord.gateway.routing -> worker.runtime.runtime" in out
    assert "coordinator.core.routing.choosers -> asyncio" in out
    assert "worker.kv.allocator -> socket" in out
    assert "coordinator.config -> torch" in out
    assert "worker.serving.gate -> coordinator.server.convert" in out
    assert "worker.serving.gate -> kvcoord.tables" in out
    assert "No cycles are allowed in coordinator.core" in out


def test_a_cycle_under_type_checking_or_in_bench_breaks_the_acyclic_contract(
    tmp_path: Path,
) -> None:
    # Each pair was a real cycle: index_audit typed its argument as a PrefixIndex imported under
    # TYPE_CHECKING, and bench modules ran their suite through bench.runner when run as
    # `python -m bench.X`. An annotation-only import still ties the two modules together.
    crossings = {
        "coordinator/core/index/index_audit.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    import coordinator.core.index.prefix_index"),
        "bench/bench_policy.py": "import bench.runner",
    }
    result = lint_imports(copy_with(tmp_path, crossings))
    out = result.stdout
    assert result.returncode != 0
    assert "5 kept, 1 broken" in out, out[-3000:]
    assert "No cycles are allowed in coordinator.core.index" in out
    assert "No cycles are allowed in bench" in out


# A module past 400 lines is split, unless splitting would cost what the module exists for.
# Each exemption names its ceiling and its reason (docs/ARCHITECTURE.md, the module map).
OVER_400_EXEMPT = {
    "coordinator/core/_holdings_accel.pyx": (
        600,
        "one compiled translation unit: the cdef class CHoldings (~390 lines) must be defined in "
        "one .pyx, and its hot loops' helpers are inline functions of it or of a shared .pxd "
        "(_holdings_entry.pxd); as cdef functions of another .pyx module they would be called "
        "through a function-pointer table",
    ),
}


def test_no_hand_written_module_is_over_400_lines() -> None:
    long = {}
    for package in PACKAGES:
        for path in [*(ROOT / package).rglob("*.py"), *(ROOT / package).rglob("*.pyx")]:
            if "_pb2" in path.name:
                continue  # generated stubs
            lines = len(path.read_text().splitlines())
            name = str(path.relative_to(ROOT))
            ceiling = OVER_400_EXEMPT.get(name, (400, ""))[0]
            if lines > ceiling:
                long[name] = lines
    assert long == {}
    assert all((ROOT / name).exists() for name in OVER_400_EXEMPT)


# A white-box test may reach inside the index, each for the reason named here.
INDEX_PRIVATE_READS_ALLOWED = {
    ("tests/test_index.py", "_holdings"): "corrupts the table on purpose: check_integrity refuses",
}


def index_private_names() -> set[str]:
    """PrefixIndex's private attributes and methods: every ``self._name`` in its class."""
    index_class = next(
        node for node in ast.parse(INDEX_MODULE.read_text()).body
        if isinstance(node, ast.ClassDef) and node.name == "PrefixIndex")
    return {node.attr for node in ast.walk(index_class)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "self" and node.attr.startswith("_")
            and not node.attr.startswith("__")}


def reads_from_outside(source: str, private: set[str]) -> list[tuple[int, str]]:
    """Each ``x._name`` in ``source`` with ``_name`` in ``private`` and ``x`` not ``self``
    or ``cls``, whatever ``x`` is called: (line, the expression)."""
    return [(node.lineno, ast.unparse(node)) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr in private
            and not (isinstance(node.value, ast.Name) and node.value.id in {"self", "cls"})]


def test_only_the_index_reads_its_private_attributes() -> None:
    # index_audit once read ten of PrefixIndex's private attributes (one class in two files);
    # it reads PrefixIndex.tables() now, typed read-only.
    private = index_private_names()
    assert {"_workers", "_slots", "_holdings", "_queue", "_pending_count"} <= private
    planted = "def f(index, r):\n    return index._slots, r.index._workers, r._queue\n"
    assert reads_from_outside(planted, private) == [
        (2, "index._slots"), (2, "r.index._workers"), (2, "r._queue")]
    readers = []
    for package in (*LINTED, "tests", "tests_vllm"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == INDEX_MODULE or "_pb2" in path.name:
                continue
            name = str(path.relative_to(ROOT))
            readers += [f"{name}:{line} {expr}" for line, expr in
                        reads_from_outside(path.read_text(), private)
                        if (name, expr.rpartition(".")[2]) not in INDEX_PRIVATE_READS_ALLOWED]
    assert readers == []
