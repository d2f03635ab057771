"""The docs' "Measured at" lines say what the result files they quote record
(bench/doc_provenance.py), and no other commit of this repository is named in them unless this
file says why, so a commit typed for the current figures fails here (issue 27: SIMULATOR.md
named one commit while simulate.json recorded another)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.doc_provenance import (
    Marked,
    NoProvenance,
    docs,
    main,
    marked,
    measured_line,
    named_commits,
    rewrite,
    stale,
)
from kvcoord import child_process

ROOT = Path(__file__).resolve().parent.parent

# Commits the docs name that are not the provenance of figures in bench/results/: each as the
# phrase around it (within one line) and why it is there.
NOT_FROM_RESULTS = [
    ("README.md", "One run at commit `a92299d`", "`make demo`'s report: it writes no result file"),
    ("README.md", "(commit `ead020b`, four runs)", "an earlier version of the rule"),
    ("docs/ENGINES.md", "when the bench was first run (50ad2d4)", "the bench's first run"),
    ("docs/ENGINES.md", "in 3b8cdb0; a run at 7da24ad", "the change to sglang_like, a run before"),
    ("docs/ENGINES.md", "which d1d634f fixed", "the commit that fixed the check"),
    ("docs/SECURITY.md", "older code (commit 0a160bd, 2026-12-01)", "an earlier run: the spread"),
    ("docs/SIMULATOR.md", "Measured at commit `1582288` in a clean worktree",
     "the generated families' sizing runs: no result file holds them"),
]


def test_every_marked_line_says_what_its_result_files_record() -> None:
    lines = stale(ROOT)
    assert lines == [], "stale, run `make docs-provenance`:\n" + "\n".join(
        f"{m.doc.name}:{m.line + 1}\n  found:  {m.found}\n  wanted: {m.wanted}" for m in lines)


def test_the_simulator_results_name_the_commit_simulate_json_records() -> None:
    recorded = json.loads((ROOT / "bench/results/simulate.json").read_text())["commit"]
    (first, *_) = [m for m in marked(ROOT / "docs/SIMULATOR.md", ROOT)
                   if "`bench/results/simulate.json`" in m.wanted]
    assert first.found == first.wanted
    assert f"commit `{recorded[:7]}`" in first.wanted


def test_the_docs_name_no_other_commit_of_this_repository_unless_told_why() -> None:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: which tokens are commits is for git to say")
    unexplained = []
    for doc in docs(ROOT):
        name = doc.relative_to(ROOT).as_posix()
        phrases = [phrase for where, phrase, _ in NOT_FROM_RESULTS if where == name]
        for number, token, text in named_commits(doc, ROOT):
            if not any(token in phrase and phrase in text for phrase in phrases):
                unexplained.append(f"{name}:{number}: {token} in {text.strip()!r}")
    assert unexplained == [], (
        "a commit named outside a generated line: put the figures' provenance on a marked line "
        "(bench/doc_provenance.py), or say why in NOT_FROM_RESULTS:\n" + "\n".join(unexplained))


def test_every_reason_given_still_matches_its_doc() -> None:
    gone = [(where, phrase) for where, phrase, _ in NOT_FROM_RESULTS
            if phrase not in (ROOT / where).read_text()]
    assert gone == []


# The mechanism on a checkout of its own.

def git(root: Path, *args: str) -> str:
    return child_process.run(["git", "-C", str(root), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def results(root: Path, name: str, **report: object) -> None:
    path = root / "bench" / "results" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report))


SIM = "bench/results/simulate.json"
DOC = """# Simulator

Intro with no commit.

<!-- provenance: bench/results/simulate.json -->
Measured at commit `c339092` on a clean tree (`bench/results/simulate.json`).
On a shared 2-core machine.
"""


def test_a_typed_commit_that_differs_from_the_json_is_stale_and_rewritten(
        tmp_path: Path) -> None:
    results(tmp_path, "simulate.json", commit="f0f0ea3" + "0" * 33, dirty=False)
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# kvcoord\n")
    doc = tmp_path / "docs" / "SIMULATOR.md"
    doc.write_text(DOC)
    wanted = f"Measured at commit `f0f0ea3` on a clean tree (`{SIM}`)."
    assert stale(tmp_path) == [Marked(doc, 5, DOC.splitlines()[5], wanted)]
    assert main(["--check", "--root", str(tmp_path)]) == 1
    assert doc.read_text() == DOC  # --check changes nothing
    assert main(["--root", str(tmp_path)]) == 0
    assert doc.read_text() == DOC.replace(DOC.splitlines()[5], wanted)
    assert stale(tmp_path) == []
    assert main(["--check", "--root", str(tmp_path)]) == 0


def test_a_marker_without_its_line_gets_one_inserted_and_the_prose_kept(tmp_path: Path) -> None:
    results(tmp_path, "simulate.json", commit="ab" * 20, dirty=True)
    doc = tmp_path / "DOC.md"
    doc.write_text(f"Before.\n<!-- provenance: {SIM} -->\nOn a shared machine.\n")
    (only,) = marked(doc, tmp_path)
    assert only.found is None
    assert rewrite(doc, tmp_path) is True
    assert doc.read_text() == (f"Before.\n<!-- provenance: {SIM} -->\n"
                               f"Measured at commit `abababa` on a dirty tree (`{SIM}`).\n"
                               "On a shared machine.\n")
    assert rewrite(doc, tmp_path) is False


def test_files_from_one_run_share_a_clause_and_other_runs_get_their_own(tmp_path: Path) -> None:
    results(tmp_path, "a.json", commit="1" * 40, dirty=False, when="2026-12-02T15:20:00Z",
            cpus=2)
    results(tmp_path, "b.json", commit="1" * 40, dirty=False, when="2026-12-02T15:23:24Z",
            cpus=2)
    results(tmp_path, "c.json", commit=None, dirty=None, config={"cpus": 1})
    names = ["bench/results/a.json", "bench/results/b.json", "bench/results/c.json"]
    assert measured_line(names, tmp_path) == (
        "Measured at commit `1111111` on a clean tree, 2026-12-02, 2 cores "
        "(`bench/results/a.json`, `bench/results/b.json`); at outside a git checkout, 1 core "
        "(`bench/results/c.json`).")


def test_a_result_file_without_provenance_is_refused(tmp_path: Path) -> None:
    results(tmp_path, "old.json", suite="interleave", runs=3)
    with pytest.raises(NoProvenance, match=r"old\.json has no provenance"):
        measured_line(["bench/results/old.json"], tmp_path)


def test_only_commits_of_the_checkout_named_outside_generated_lines_are_found(
        tmp_path: Path) -> None:
    git(tmp_path, "init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    git(tmp_path, "add", ".")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = git(tmp_path, "rev-parse", "HEAD")
    results(tmp_path, "simulate.json", commit=head, dirty=False)
    doc = tmp_path / "DOC.md"
    doc.write_text(f"Typed: measured at {head[:7]}.\n"
                   f"<!-- provenance: {SIM} -->\n"
                   f"Measured at commit `{head[:7]}` on a clean tree (`{SIM}`).\n"
                   "A digest `5e9a9cd1e3745b71ce71357ba03e9b00`, vLLM's commit `b4e69e0`.\n"
                   f"Full: {head}\n")
    assert named_commits(doc, tmp_path) == [
        (1, head[:7], f"Typed: measured at {head[:7]}."), (5, head, f"Full: {head}")]
