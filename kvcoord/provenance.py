"""What a result file measured: the commit, whether the tree was dirty, and the trace by content.

Every JSON written under ``bench/results/`` (``kvcoord bench``, ``python -m bench.chaos``,
``kvcoord simulate --json``) carries ``provenance(trace)``::

    {"commit": "<40 hex>" | null, "dirty": true | false | null,
     "trace": {"name": "<file name>", "sha256": "<64 hex>"} | null}

``commit`` and ``dirty`` are null outside a git checkout (an installed package). ``dirty`` is
true when anything but ``bench/results/`` differs from the commit, untracked files included:
a run that rewrites several result files in turn must not call the later ones dirty because of
the earlier ones. The trace is named by its file name and hashed, never given as a path, so a
figure can be matched to the data it came from on another machine.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path
from typing import Any

from kvcoord import child_process

SOURCE_ROOT = Path(__file__).resolve().parent.parent
"""The checkout this package was imported from (when it was imported from one)."""

RESULTS_DIR = "bench/results"


def _git(root: Path, *args: str) -> str | None:
    """``git ARGS`` in ``root``: its stdout, or None when git is missing or fails."""
    try:
        done = child_process.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def git_state(root: Path = SOURCE_ROOT) -> tuple[str | None, bool | None]:
    """(HEAD's sha, dirty) of the checkout at ``root``; (None, None) when it is not one."""
    if not (root / ".git").exists():
        return None, None
    commit = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain", "--", ".", f":(exclude){RESULTS_DIR}")
    if commit is None or status is None:
        return None, None
    return commit.strip(), bool(status.strip())


def trace_identity(path: str | Path) -> dict[str, str]:
    """``{"name": file name, "sha256": hex digest of its bytes}``; OSError if unreadable."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return {"name": Path(path).name, "sha256": digest.hexdigest()}


def provenance(trace: str | Path | None = None, root: Path = SOURCE_ROOT) -> dict[str, Any]:
    """The three keys every result file carries (module docstring); ``trace`` null without
    one. Merge it into the report: ``{**report, **provenance(trace_path)}``."""
    commit, dirty = git_state(root)
    return {"commit": commit, "dirty": dirty,
            "trace": None if trace is None else trace_identity(trace)}
