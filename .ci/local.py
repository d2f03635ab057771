"""``make ci-local``: check HEAD as CI will, and leave the machine as it was.

Clones HEAD (committed work only) into a temporary directory, runs ``.ci/run`` there as CI does
(``CI=true``, no standard input), prints each stage's time and the disk it added as the run
goes and in a table at the end, then removes the clone whatever the result (an interrupt
included), and says what the run left on the machine: the engine environments it built in
``$KVCOORD_CACHE`` and pip's cache, which later runs reuse. Exits with ``.ci/run``'s status.

Standard library only (the system Python runs it).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from kvcoord import child_process  # noqa: E402  (stdlib only; importable before any venv)
from kvcoord.engine_envs import cache_dir  # noqa: E402

STAGE = "ci-stage: "


def disk_used_mb(path: Path) -> int:
    usage = shutil.disk_usage(path)
    return (usage.total - usage.free) // 2**20


def tree_mb(path: Path) -> int:
    """What ``path`` holds on disk, in MB (0 when it does not exist)."""
    if not path.exists():
        return 0
    done = child_process.run(["du", "-sm", str(path)], capture_output=True, text=True)
    return int(done.stdout.split()[0]) if done.returncode == 0 and done.stdout else 0


def git(*args: str) -> str:
    done = child_process.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                             check=True)
    return str(done.stdout).strip()


def run_ci(clone: Path) -> tuple[int, list[str]]:
    """``.ci/run`` in ``clone``: its output passed through, its stage lines collected. Its
    temporary files (pytest's, the benchmarks' scratch folders) go under the clone's ``tmp/``
    (ignored by git), so they go with it."""
    scratch = clone / "tmp"
    scratch.mkdir()
    env = {**os.environ, "CI": "true", "TMPDIR": str(scratch)}
    process = child_process.start(["bash", ".ci/run"], cwd=clone, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stages = []
    try:
        assert process.stdout is not None
        for line in process.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if line.startswith(STAGE):
                stages.append(line[len(STAGE):].strip())
        return process.wait(), stages
    except BaseException:
        child_process.stop_processes([process], grace=10.0)
        raise


def table(stages: list[str], total_s: float, clone_mb: int, left_mb: int,
          cache_added_mb: int) -> str:
    rows = [("stage", "time", "disk added", "result")]
    for stage in stages:  # "NAME S s, disk +MB MB, rc N"
        name, seconds, _, _, disk, _, _, rc = stage.replace(",", "").split()
        rows.append((name, f"{seconds} s", f"{disk.lstrip('+')} MB",
                     "ok" if rc == "0" else f"failed ({rc})"))
    rows.append(("all", f"{total_s:.0f} s", f"{clone_mb} MB in the clone (removed)", ""))
    rows.append(("left", "", f"{left_mb} MB on the disk after removal "
                 f"(engine environments +{cache_added_mb} MB)", ""))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
                     .rstrip() for row in rows)


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    head = git("rev-parse", "HEAD")
    if git("status", "--porcelain", "--untracked-files=no"):
        print("ci-local: the working tree has uncommitted changes; only HEAD is checked",
              file=sys.stderr)
    cache = cache_dir()
    temp_root = Path(tempfile.gettempdir())
    used_before, cache_before = disk_used_mb(temp_root), tree_mb(cache)
    clone = Path(tempfile.mkdtemp(prefix="kvcoord-ci-local-"))
    print(f"ci-local: {head[:12]} in {clone}; engine environments in {cache}", flush=True)
    started = time.monotonic()
    # A SIGTERM (a CI runner's timeout, `kill`) ends the run through the same cleanup as ^C.
    signal.signal(signal.SIGTERM, _interrupted)
    status, stages, clone_mb = 1, [], 0
    try:
        child_process.run(["git", "clone", "--quiet", "--no-checkout", str(ROOT), str(clone)],
                          check=True)
        child_process.run(["git", "-C", str(clone), "checkout", "--quiet", head], check=True)
        status, stages = run_ci(clone)
        clone_mb = tree_mb(clone)
    except KeyboardInterrupt:
        print("ci-local: interrupted", file=sys.stderr)
        status = 130
    finally:
        shutil.rmtree(clone, ignore_errors=True)
    total = time.monotonic() - started
    left = disk_used_mb(temp_root) - used_before
    print(table(stages, total, clone_mb, left, tree_mb(cache) - cache_before))
    print(f"ci-local: {'passed' if status == 0 else f'FAILED (exit {status})'}; "
          f"{clone} removed")
    return status


if __name__ == "__main__":
    sys.exit(main())
