"""docs/ARCHITECTURE.md's module map is what bench/module_map.py generates from the code now
(issue 28: the hand-written map had 20 wrong sizes and missed 21 bench modules), and every
dotted name of ours the docs put in backticks (``coordinator.replica.CoordinatorReplica``)
still resolves (the moves of issue 28 left ``coordinator.service`` and the like behind)."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

from bench.module_map import (
    BEGIN,
    DOC,
    END,
    PACKAGES,
    first_sentence,
    module_map,
    modules,
    rewritten,
)
from kvcoord import child_process

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOTTED_NAME = re.compile(rf"`((?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_]\w*)+)(?:\(\))?`")


def _check(doc: Path) -> subprocess.CompletedProcess[str]:
    return child_process.run(
        [sys.executable, "-m", "bench.module_map", "--check", "--doc", str(doc)], cwd=ROOT,
        capture_output=True, text=True, timeout=60, check=False)


def test_the_committed_map_is_current() -> None:
    done = _check(DOC)
    assert done.returncode == 0, done.stderr


def test_a_stale_map_is_reported_and_left_alone(tmp_path: Path) -> None:
    stale = tmp_path / "ARCHITECTURE.md"
    text = DOC.read_text().replace("| `coordinator/wire.py` |", "| `coordinator/wyre.py` |")
    stale.write_text(text)
    done = _check(stale)
    assert done.returncode == 1
    assert "the module map is stale" in done.stderr
    assert stale.read_text() == text


def test_every_module_has_a_row_with_its_size() -> None:
    generated = module_map()
    for path in modules():
        name = path.relative_to(ROOT).as_posix()
        if path.is_dir():
            assert f"| `{name}/` |" in generated
            continue
        lines = len(path.read_text().splitlines())
        if path.name == "__init__.py" and not path.read_text().strip():
            continue
        assert f"| `{name}` |" in generated and generated.count(f"| `{name}` |") == 1, name
        row = next(r for r in generated.splitlines() if r.startswith(f"| `{name}` |"))
        assert row.endswith(f"| {lines} |"), row
    assert "| `bench/module_map.py` |" in generated  # bench modules are in it too


def test_first_sentence_and_markers() -> None:
    assert first_sentence("One idea. More words.\n\nNext paragraph.") == "One idea."
    assert first_sentence("A `x | y` split\nacross lines") == "A `x \\| y` split across lines"
    assert rewritten(f"a\n{BEGIN}\nold\n{END}\nb", "NEW") == "a\nNEW\nb"


def test_a_module_without_a_docstring_is_refused_by_name(tmp_path: Path) -> None:
    import pytest

    from bench.module_map import MissingDocstring, row

    (tmp_path / "coordinator").mkdir()
    silent = tmp_path / "coordinator" / "silent.py"
    silent.write_text("X = 1\n")
    with pytest.raises(MissingDocstring, match=r"coordinator/silent\.py"):
        row(silent, tmp_path)


def _resolves(name: str) -> bool:
    """Whether ``name`` is a module, or an attribute chain on the longest module it starts with."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(target, attribute):
                return False
            target = getattr(target, attribute)
        return True
    return False


def _names_not_python() -> set[str]:
    """Dotted names of ours that are not Python names: the log events the code emits
    (``"worker.registered"``) and the gRPC services (``coordinator.v1.Coordinator``)."""
    quoted = re.compile(rf"[\"']((?:{'|'.join(PACKAGES)})\.[\w.]+)[\"']")
    names = {name for package in PACKAGES for path in (ROOT / package).rglob("*.py")
             for name in quoted.findall(path.read_text())}
    for proto in (ROOT / "proto").rglob("*.proto"):
        text = proto.read_text()
        (package,) = re.findall(r"^package ([\w.]+);", text, re.M)
        names |= {f"{package}.{service}" for service in re.findall(r"^service (\w+)", text, re.M)}
    return names


def unresolved_names(text: str, known: set[str]) -> list[str]:
    """The backticked dotted names of ours in ``text`` that neither resolve nor are ``known``."""
    return sorted({name for name in DOTTED_NAME.findall(text)
                   if name not in known and not _resolves(name)})


def test_every_dotted_name_the_docs_give_resolves() -> None:
    known = _names_not_python()
    stale = {doc.name: names for doc in DOCS
             if (names := unresolved_names(doc.read_text(), known))}
    assert not stale, f"names in the docs that the code no longer has: {stale}"
    checked = {name for doc in DOCS for name in DOTTED_NAME.findall(doc.read_text())}
    assert {"coordinator.replica", "coordinator.index.PrefixIndex"} <= checked  # it sees them


def test_a_renamed_module_or_attribute_is_reported_and_log_events_are_not() -> None:
    known = _names_not_python()
    assert {"worker.registered", "coordinator.v1.Coordinator"} <= known
    text = ("`coordinator.service.CoordinatorService`, `coordinator.core.routing.POLICIES`, "
            "`coordinator.replica.CoordinatorReplica`, `worker.main.start_worker()`, "
            "`worker.registered`, `coordinator.v1.Coordinator`")
    assert unresolved_names(text, known) == ["coordinator.core.routing.POLICIES",
                                             "coordinator.service.CoordinatorService"]
