"""Child processes that end with whoever started them: the one way kvcoord, its tests and its
benchmarks start a process.

Every child is started

- with a **death signal** (Linux ``PR_SET_PDEATHSIG`` through util-linux ``setpriv
  --pdeathsig``, kept across exec), so a starter killed with SIGKILL still takes it along. Not
  a ``preexec_fn``: that forces ``fork()`` instead of ``vfork()``, and grpc's fork handlers then
  deadlock the parent while one of its channels is open (seen here). The signal follows the
  *thread* that started the child, so children are started from the main thread only
  (``start`` refuses another: a child started from a pool thread dies when the pool ends);
- in a **session of its own** (its process group id is its pid), so ``stop_processes`` ends
  the whole group and a terminal's Ctrl-C reaches only the starter, which tears its children
  down;
- carrying the starter's ``KVCOORD_PROCESS_OWNER`` even where the caller passes an environment
  of its own, so ``kvcoord.leftovers`` finds every process a run started, at any depth.

Standard library only (``.ci/local.py`` runs it before any venv exists). ``tests/
test_process_starts.py`` fails on a process start anywhere in kvcoord/, tests/, tests_vllm/ or
bench/ that bypasses this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

OWNER_VAR = "KVCOORD_PROCESS_OWNER"
"""Set by ``make test``, ``make test-vllm`` and the tests that kill their own runner: every
process started under it carries it (kvcoord.leftovers lists those still running)."""

Stream = IO[Any] | int | None
Argv = Sequence[str | Path]


class ThreadError(RuntimeError):
    """A child was to be started from a thread other than the main one."""


def death_signal_prefix(sig: signal.Signals = signal.SIGTERM) -> list[str]:
    """The argv prefix that has Linux send ``sig`` to the child when its starter dies (empty
    where ``setpriv`` is missing, or off Linux)."""
    setpriv = shutil.which("setpriv") if sys.platform.startswith("linux") else None
    return [setpriv, "--pdeathsig", sig.name.removeprefix("SIG"), "--"] if setpriv else []


def owner_marks(value: str | None) -> list[str]:
    """The marks an ``OWNER_VAR`` value holds (``:``-separated, outermost first)."""
    return [mark for mark in (value or "").split(":") if mark]


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) carrying every owner mark this process
    carries, after those ``env`` gives: a run inside a run (a test that runs a pytest of its
    own under a mark of its own) is found by both marks."""
    out = dict(os.environ if env is None else env)
    marks = owner_marks(os.environ.get(OWNER_VAR))
    given = owner_marks(out.get(OWNER_VAR))
    combined = [*marks, *(mark for mark in given if mark not in marks)]
    if combined:
        out[OWNER_VAR] = ":".join(combined)
    return out


def _argv(argv: Argv, death_signal: signal.Signals | None, *,
          any_thread: bool = False) -> list[str]:
    if not any_thread and threading.current_thread() is not threading.main_thread():
        raise ThreadError(
            f"start {argv[0]!s} from the main thread: its death signal follows the thread "
            f"that started it, and {threading.current_thread().name} may end first")
    prefix = death_signal_prefix(death_signal) if death_signal is not None else []
    return [*prefix, *(str(arg) for arg in argv)]


def _shell(argv: Argv | str, shell: bool) -> Argv:
    if isinstance(argv, str):
        if not shell:
            raise TypeError("a string command needs shell=True")
        return ["/bin/sh", "-c", argv]
    if shell:
        raise TypeError("shell=True takes one string")
    return argv


def start(argv: Argv | str, *, env: Mapping[str, str] | None = None,
          cwd: str | Path | None = None, stdin: Stream = subprocess.DEVNULL,
          stdout: Stream = None, stderr: Stream = None, text: bool = False,
          shell: bool = False, pass_fds: Sequence[int] = (),
          death_signal: signal.Signals | None = signal.SIGTERM) -> subprocess.Popen[Any]:
    """Start ``argv`` as described above (stdin from /dev/null unless given; ``shell``: one
    string run by ``/bin/sh -c``). ``death_signal`` None starts it without one: only the test
    showing that the signal matters does. ThreadError off the main thread."""
    return _popen(_argv(_shell(argv, shell), death_signal), env, cwd, stdin, stdout, stderr,
                  text, pass_fds)


def _popen(argv: list[str], env: Mapping[str, str] | None, cwd: str | Path | None,
           stdin: Stream, stdout: Stream, stderr: Stream, text: bool,
           pass_fds: Sequence[int]) -> subprocess.Popen[Any]:
    return subprocess.Popen(argv, env=child_env(env), cwd=cwd, start_new_session=True,
                            stdin=stdin, stdout=stdout, stderr=stderr, text=text,
                            pass_fds=tuple(pass_fds))


async def start_async(argv: Argv, *, env: Mapping[str, str] | None = None,
                      cwd: str | Path | None = None, stdin: Stream = subprocess.DEVNULL,
                      stdout: Stream = None, stderr: Stream = None,
                      pass_fds: Sequence[int] = (),
                      death_signal: signal.Signals | None = signal.SIGTERM,
                      ) -> asyncio.subprocess.Process:
    """``start`` for asyncio code (an event loop in the main thread)."""
    argv = _argv(argv, death_signal)
    return await asyncio.create_subprocess_exec(
        argv[0], *argv[1:], env=child_env(env), cwd=cwd, start_new_session=True,
        stdin=stdin, stdout=stdout, stderr=stderr, pass_fds=tuple(pass_fds))


def run(argv: Argv | str, *, env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None, input: str | bytes | None = None,
        stdin: Stream = subprocess.DEVNULL, capture_output: bool = False,
        stdout: Stream = None, stderr: Stream = None, text: bool = False,
        timeout: float | None = None, check: bool = False, shell: bool = False,
        death_signal: signal.Signals | None = signal.SIGTERM) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run`` through ``start``: the child and its group end when the call times
    out or is interrupted (TimeoutExpired, KeyboardInterrupt re-raised), or when this process
    dies. Any thread may call it: the calling thread outlives the child it waits for."""
    if capture_output:
        stdout = stderr = subprocess.PIPE
    process = _popen(_argv(_shell(argv, shell), death_signal, any_thread=True), env, cwd,
                     subprocess.PIPE if input is not None else stdin, stdout, stderr, text, ())
    try:
        out, err = process.communicate(input, timeout=timeout)
    except BaseException:
        stop_processes([process], grace=0.0)
        raise
    done = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def stop_processes(processes: Sequence[subprocess.Popen[Any]], grace: float = 5.0) -> None:
    """SIGTERM every process group at once, wait up to ``grace`` seconds in all, SIGKILL the
    groups still alive and reap them. Processes that already exited are only reaped."""
    for process in processes:
        if process.poll() is None:
            signal_group(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            signal_group(process.pid, signal.SIGKILL)
            process.wait()


def stop_process(process: subprocess.Popen[Any], grace: float = 10.0) -> None:
    """``stop_processes`` for one process (SIGTERM its group, SIGKILL after ``grace``)."""
    stop_processes([process], grace)


def signal_group(pid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to the process group led by ``pid`` (a child ``start`` made); nothing when
    it is gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
