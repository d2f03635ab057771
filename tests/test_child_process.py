"""No process outlives what started it: a pytest killed with SIGKILL while its fixture runs a
server takes the server (and what the server started) along; the leftover check finds a
process a test leaked on purpose (kvcoord.child_process, kvcoord.leftovers)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcoord import child_process, leftovers, proc_table

ROOT = Path(__file__).resolve().parent.parent
GONE_WITHIN_S = 5.0

# A fixture as the suites write them: a real `kvcoord coordinator` (the stand-in for an engine:
# a gRPC server in a process of its own) and a process that starts a child of its own through
# the helper (an engine's own workers), then a test that waits to be killed.
SERVING_FIXTURE = '''
import os, signal, sys, time
from pathlib import Path
import pytest
from kvcoord import child_process
from kvcoord.fleet_procs import free_port, wait_healthy

SIGNAL = None if os.environ.get("PLANT_NO_DEATH_SIGNAL") else signal.SIGTERM
NESTED = ("import signal, sys, time; from kvcoord import child_process; "
          "child_process.start(['sleep', '300'], death_signal=%s); time.sleep(300)")

@pytest.fixture
def servers():
    port = free_port()
    coordinator = child_process.start(
        [sys.executable, "-m", "kvcoord.cli", "coordinator", "--listen", f"127.0.0.1:{port}",
         "--log-level", "error"], death_signal=SIGNAL)
    wait_healthy(f"127.0.0.1:{port}", coordinator)
    nested = child_process.start(
        [sys.executable, "-c", NESTED % ("None" if SIGNAL is None else "signal.SIGTERM")],
        death_signal=SIGNAL)
    yield coordinator, nested
    child_process.stop_processes([coordinator, nested])  # reached only if not killed

def test_waits_to_be_killed(servers):
    Path(os.environ["READY_FILE"]).write_text("ready")
    time.sleep(300)
'''


def run_inner_pytest(tmp_path: Path, owner: str, *, plant: bool) -> subprocess.Popen[bytes]:
    (tmp_path / "test_inner.py").write_text(SERVING_FIXTURE)
    ready = tmp_path / "ready"
    env = {**os.environ, child_process.OWNER_VAR: owner, "READY_FILE": str(ready),
           "PYTHONPATH": str(ROOT)}
    if plant:
        env["PLANT_NO_DEATH_SIGNAL"] = "1"
    inner = child_process.start(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", os.devnull,
         "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert inner.poll() is None, f"the inner pytest exited with {inner.returncode}"
        assert time.monotonic() < deadline, "the inner fixture did not start in 60 s"
        time.sleep(0.1)
    return inner


def alive_after_kill(inner: subprocess.Popen[bytes], owner: str) -> list[str]:
    """SIGKILL ``inner`` (the pytest, alone: not its group), then what of its processes is
    still running ``GONE_WITHIN_S`` later (their commands)."""
    # The pytest, the coordinator, the nested python and its sleep.
    deadline = time.monotonic() + 30
    while len(before := leftovers.marked(owner)) < 4:
        assert time.monotonic() < deadline, [p.command() for p in before]
        time.sleep(0.1)
    os.kill(inner.pid, signal.SIGKILL)
    inner.wait()
    return [p.command() for p in leftovers.wait_gone(owner, GONE_WITHIN_S)]


@pytest.mark.skipif(not child_process.death_signal_prefix(), reason="needs Linux's setpriv")
def test_a_pytest_killed_with_sigkill_takes_its_fixture_servers_along(tmp_path: Path) -> None:
    owner = f"test-kill-{secrets.token_hex(4)}"
    inner = run_inner_pytest(tmp_path, owner, plant=False)
    try:
        assert alive_after_kill(inner, owner) == []
    finally:
        child_process.stop_processes([inner], grace=1.0)
        leftovers.kill(leftovers.marked(owner))


@pytest.mark.skipif(not child_process.death_signal_prefix(), reason="needs Linux's setpriv")
def test_without_the_death_signal_they_outlive_it(tmp_path: Path) -> None:
    """The planted defect: the same fixture, its processes started with no death signal. The
    check above must see them still running (else it could not fail)."""
    owner = f"test-plant-{secrets.token_hex(4)}"
    inner = run_inner_pytest(tmp_path, owner, plant=True)
    try:
        alive = alive_after_kill(inner, owner)
        assert any("kvcoord.cli coordinator" in command for command in alive), alive
        assert any(command == "sleep 300" for command in alive), alive
    finally:
        child_process.stop_processes([inner], grace=1.0)
        leftovers.kill(leftovers.marked(owner))


LEAKING_TEST = '''
import subprocess
from kvcoord import child_process

def test_leaks_a_process():
    # A daemon: the shell exits at once and its background child is nobody's (no death signal
    # reaches it), as a server started with --daemonize would be.
    child_process.run(["sh", "-c", "sleep 300 &"], check=True)

def test_cleans_up():
    process = child_process.start(["sleep", "300"])
    child_process.stop_processes([process])
'''


def leftovers_after(tmp_path: Path, test: str) -> tuple[str, subprocess.CompletedProcess[str]]:
    """An inner pytest running ``test`` of LEAKING_TEST under an owner mark of its own, then
    ``python -m kvcoord.leftovers`` for that mark, as ``make test`` runs them: the mark and
    the check's result."""
    owner = f"test-leak-{secrets.token_hex(4)}"
    (tmp_path / "test_leaky.py").write_text(LEAKING_TEST)
    env = {**os.environ, child_process.OWNER_VAR: owner, "PYTHONPATH": str(ROOT)}
    inner = child_process.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", os.devnull,
         "--rootdir", str(tmp_path), f"{tmp_path / 'test_leaky.py'}::{test}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert inner.returncode == 0, inner.stdout[-2000:]
    return owner, child_process.run(
        [sys.executable, "-m", "kvcoord.leftovers", owner, "--grace-s", "1"],
        capture_output=True, text=True, timeout=60)


def test_the_leftover_check_fails_naming_a_process_a_test_leaked_and_ends_it(
    tmp_path: Path,
) -> None:
    owner, done = leftovers_after(tmp_path, "test_leaks_a_process")
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.splitlines()
    assert lines[0] == (f"leftovers: 1 process(es) started under KVCOORD_PROCESS_OWNER={owner} "
                        "still running (each was killed):")
    assert lines[1].endswith(": sleep 300") and len(lines) == 2, lines
    assert leftovers.wait_gone(owner, GONE_WITHIN_S) == []


def test_the_leftover_check_passes_a_run_that_cleaned_up(tmp_path: Path) -> None:
    owner, done = leftovers_after(tmp_path, "test_cleans_up")
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert done.stdout == f"leftovers: none (KVCOORD_PROCESS_OWNER={owner})\n"


def test_a_child_carries_the_owner_mark_even_given_an_environment_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(child_process.OWNER_VAR, "outer")
    show = ("import os; print(os.environ.get("
            f"{child_process.OWNER_VAR!r}), os.environ.get('ONLY'))")
    done = child_process.run([sys.executable, "-c", show], env={"ONLY": "this"},
                             capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["outer", "this"]
    # A run inside the run (a test's own pytest under its own mark) carries both marks, so
    # both the test and the outer run's check find what it leaves.
    done = child_process.run([sys.executable, "-c", show],
                             env={"ONLY": "inner", child_process.OWNER_VAR: "test-1"},
                             capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["outer:test-1", "inner"]


def test_a_start_off_the_main_thread_is_refused() -> None:
    import threading

    errors: list[BaseException] = []

    def start_from_a_thread() -> None:
        try:
            child_process.start(["true"])
        except child_process.ThreadError as exc:
            errors.append(exc)

    thread = threading.Thread(target=start_from_a_thread, name="pool-1")
    thread.start()
    thread.join()
    assert len(errors) == 1 and "pool-1 may end first" in str(errors[0])


def test_run_ends_the_child_and_its_group_when_it_times_out(tmp_path: Path) -> None:
    pidfile = tmp_path / "sleep.pid"
    with pytest.raises(subprocess.TimeoutExpired):
        child_process.run(["sh", "-c", f"sleep 30 & echo $! > {pidfile}; wait"], timeout=1.0)
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + GONE_WITHIN_S  # SIGKILLed with its shell: gone or a zombie
    while (sleeper := proc_table.read(pid)) is not None and sleeper.state != "Z":
        assert time.monotonic() < deadline, sleeper
        time.sleep(0.05)
