"""Result files name the commit they measured, whether the tree was dirty, and the trace by
content (kvcoord/provenance.py), on a real git checkout."""

from __future__ import annotations

import hashlib
from pathlib import Path

from kvcoord import child_process
from kvcoord.provenance import provenance


def git(root: Path, *args: str) -> str:
    return child_process.run(["git", "-C", str(root), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def make_checkout(root: Path) -> str:
    git(root, "init", "-q")
    (root / "bench" / "results").mkdir(parents=True)
    (root / "bench" / "results" / "suite.json").write_text("{}\n")
    (root / "code.py").write_text("x = 1\n")
    git(root, "add", ".")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    return git(root, "rev-parse", "HEAD")


def test_a_clean_checkout_stays_clean_when_only_results_change(tmp_path: Path) -> None:
    head = make_checkout(tmp_path)
    assert provenance(root=tmp_path) == {"commit": head, "dirty": False, "trace": None}
    (tmp_path / "bench" / "results" / "suite.json").write_text('{"new": 1}\n')
    (tmp_path / "bench" / "results" / "other.json").write_text("{}\n")
    assert provenance(root=tmp_path)["dirty"] is False


def test_a_changed_or_new_source_file_makes_the_tree_dirty(tmp_path: Path) -> None:
    make_checkout(tmp_path)
    (tmp_path / "code.py").write_text("x = 2\n")
    assert provenance(root=tmp_path)["dirty"] is True
    git(tmp_path, "checkout", "-q", "--", "code.py")
    (tmp_path / "scratch.py").write_text("")
    assert provenance(root=tmp_path)["dirty"] is True


def test_outside_a_checkout_commit_and_dirty_are_null(tmp_path: Path) -> None:
    assert provenance(root=tmp_path) == {"commit": None, "dirty": None, "trace": None}


def test_the_trace_is_named_by_file_name_and_sha256_never_by_path(tmp_path: Path) -> None:
    trace = tmp_path / "deep" / "trace.jsonl"
    trace.parent.mkdir()
    trace.write_bytes(b'{"timestamp": 0}\n')
    assert provenance(trace, root=tmp_path)["trace"] == {
        "name": "trace.jsonl", "sha256": hashlib.sha256(b'{"timestamp": 0}\n').hexdigest()}
