"""The engines bench's scratch folder (bench/engines_procs.run_in_scratch): removed after a run
that went well, kept (its logs' path printed) after one that raised or whose result says to
keep it: a broken invariant is explained by the logs of the processes that broke it."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.engines_procs import run_in_scratch


def test_the_scratch_goes_unless_the_run_raised_or_its_result_keeps_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    seen: list[Path] = []

    def run(work: Path) -> str:
        (work / "logs").mkdir()
        seen.append(work)
        return "broken" if len(seen) == 2 else "fine"

    keep = "broken".__eq__
    assert run_in_scratch("t", run, keep=keep) == "fine"
    assert not seen[0].exists() and capsys.readouterr().err == ""
    assert run_in_scratch("t", run, keep=keep) == "broken"
    assert seen[1].is_dir()
    assert capsys.readouterr().err == f"t: the processes' logs are kept in {seen[1] / 'logs'}\n"

    def fails(work: Path) -> str:
        seen.append(work)
        raise RuntimeError("engine died")

    with pytest.raises(RuntimeError):
        run_in_scratch("t", fails)
    assert seen[2].is_dir()
    for kept in seen[1:]:
        for path in sorted(kept.rglob("*"), reverse=True):
            path.rmdir()
        kept.rmdir()
