"""docs/ARCHITECTURE.md's module map is what bench/module_map.py generates from the code now
(issue 28: the hand-written map had 20 wrong sizes and missed 21 bench modules)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.module_map import BEGIN, DOC, END, first_sentence, module_map, modules, rewritten

ROOT = Path(__file__).resolve().parent.parent


def _check(doc: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench.module_map", "--check", "--doc", str(doc)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)


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
