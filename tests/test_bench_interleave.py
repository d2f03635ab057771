"""bench/interleave.py: figures flattened from results, range verdicts, and argument refusals.

No benchmark suite runs here: the refusals come before any checkout is made.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.interleave import accel_of, flatten, summarize, verdict
from kvcoord import child_process

REPO = Path(__file__).resolve().parent.parent


def test_flatten_keeps_finite_numbers_under_dotted_keys() -> None:
    tree = {
        "barrier": {"ms_p50": {"w1": 2.5, "w8": 3}, "ok": True, "note": "x", "none": None},
        "list": [1, 2],
        "nan": float("nan"),
        "inf": float("inf"),
        "top": 0,
    }
    assert flatten(tree, "policy.") == {
        "policy.barrier.ms_p50.w1": 2.5,
        "policy.barrier.ms_p50.w8": 3,
        "policy.top": 0,
    }
    assert flatten({}) == {}
    assert flatten({"a": {"b": -1.5}}) == {"a.b": -1.5}


def test_verdict_compares_min_max_ranges() -> None:
    assert verdict([1.0, 2.0], [3.0, 4.0]) == ("separate", "higher")
    assert verdict([3.0, 4.0], [1.0, 2.9]) == ("separate", "lower")
    assert verdict([1.0, 3.0], [2.0, 5.0]) == ("overlap", None)
    assert verdict([1.0, 2.0], [2.0, 3.0]) == ("overlap", None)  # touching counts as meeting
    assert verdict([5.0], [5.0]) == ("overlap", None)
    assert verdict([], [1.0]) == ("missing", None)
    assert verdict([1.0], []) == ("missing", None)


def test_summarize_lists_separate_figures_first_with_their_ranges() -> None:
    before = {"a": [1.0, 2.0], "b": [10.0, 12.0], "c": [5.0, None]}
    after = {"a": [1.5, 1.8], "b": [7.0, 8.0], "d": [None, 4.0]}
    rows = summarize(before, after)
    assert [(r["name"], r["verdict"], r["after_is"]) for r in rows] == [
        ("b", "separate", "lower"), ("a", "overlap", None), ("c", "missing", None),
        ("d", "missing", None),
    ]
    assert rows[0] == {
        "name": "b", "verdict": "separate", "after_is": "lower", "before_min": 10.0,
        "before_max": 12.0, "after_min": 7.0, "after_max": 8.0, "before": [10.0, 12.0],
        "after": [7.0, 8.0],
    }
    assert (rows[2]["before_min"], rows[2]["after_min"]) == (5.0, None)


def _interleave(*args: str, out: Path) -> subprocess.CompletedProcess[str]:
    return child_process.run(
        [sys.executable, "-m", "bench.interleave", *args, "--out", str(out)], cwd=REPO,
        capture_output=True, text=True, timeout=30, check=False,
    )


def test_runs_below_one_is_refused(tmp_path: Path) -> None:
    done = _interleave("--before", "HEAD", "--after", "HEAD", "--runs", "0", out=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == "interleave: --runs must be at least 1 (got 0)"
    assert not (tmp_path / "interleave.json").exists()


def test_unknown_revision_is_refused_by_name(tmp_path: Path) -> None:
    done = _interleave("--before", "HEAD", "--after", "no-such-rev-xyz", out=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == "interleave: unknown revision 'no-such-rev-xyz'"
    assert not (tmp_path / "interleave.json").exists()


def test_accel_of_names_the_core_a_checkout_runs(tmp_path: Path) -> None:
    # This checkout was built by `make install` where a C compiler is (CI has one); a bare
    # copy of the package has no extension modules, so its benchmarks would run pure Python.
    from coordinator.core import accel

    assert accel_of(sys.executable, REPO) == accel.status()
    bare = tmp_path / "bare"
    child_process.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(bare), "HEAD"],
                   check=True, capture_output=True)
    try:
        assert accel_of(sys.executable, bare).startswith("pure Python (not built:")
    finally:
        child_process.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(bare)],
                       check=False, capture_output=True)
