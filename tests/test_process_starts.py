"""Every process kvcoord, its tests and its benchmarks start goes through kvcoord.child_process
(death signal, own session, owner mark): a scan of the source for starts that bypass it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("kvcoord", "tests", "tests_vllm", "bench", ".ci")
HELPER = ROOT / "kvcoord" / "child_process.py"
# kvcoord/engine_envs.py runs before any venv exists, alone: make's recipe is its owner, and
# its pip steps end with it (a killed build leaves only a partial folder, removed next time).
ALLOWED = {HELPER, ROOT / "kvcoord" / "engine_envs.py"}

STARTS = {
    "subprocess": {"Popen", "run", "call", "check_call", "check_output", "getoutput",
                   "getstatusoutput"},
    "asyncio": {"create_subprocess_exec", "create_subprocess_shell"},
    "os": {"system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp", "spawnl",
           "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe",
           "execv", "execve", "execl", "execle", "execlp", "execlpe", "execvp", "execvpe"},
    "multiprocessing": {"Process", "Pool", "get_context"},
    "pty": {"spawn", "fork"},
    "concurrent.futures": {"ProcessPoolExecutor"},
}
LOOP_STARTS = {"subprocess_exec", "subprocess_shell"}


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def bypasses(source: str, filename: str = "<source>") -> list[str]:
    """``LINE: what`` for each process start in ``source`` that is not kvcoord.child_process's."""
    found = []
    imported: dict[str, str] = {}  # a bare name -> "module.function" it was imported as
    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in STARTS:
            for alias in node.names:
                if alias.name in STARTS[node.module]:
                    imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name is None:
            continue
        module, _, function = name.rpartition(".")
        if (module in STARTS and function in STARTS[module]) or function in LOOP_STARTS:
            found.append(f"{node.lineno}: {name}")
        elif name in imported:
            found.append(f"{node.lineno}: {imported[name]}")
    return sorted(found, key=lambda line: int(line.split(":")[0]))


def scanned_files() -> list[Path]:
    return sorted(path for folder in SCANNED for path in (ROOT / folder).rglob("*.py")
                  if path not in ALLOWED)


def test_no_process_start_bypasses_the_child_process_helper() -> None:
    offenders = [f"{path.relative_to(ROOT)}:{line}" for path in scanned_files()
                 for line in bypasses(path.read_text(), str(path))]
    assert offenders == [], (
        "start these through kvcoord.child_process (start, start_async, run), which sets the "
        "death signal, a session of their own and the owner mark:\n" + "\n".join(offenders))


def test_the_scan_finds_each_way_of_starting_a_process() -> None:
    planted = """
import asyncio, os, subprocess, multiprocessing
from subprocess import Popen, check_output as out
subprocess.run(["true"])
proc = subprocess.Popen(["sleep", "1"])
asyncio.create_subprocess_exec("true")
os.system("true")
multiprocessing.Process(target=print)
Popen(["true"])
out(["true"])
loop.subprocess_exec(factory, "true")
helper: subprocess.Popen[bytes] | None = None
"""
    assert bypasses(planted) == [
        "4: subprocess.run", "5: subprocess.Popen", "6: asyncio.create_subprocess_exec",
        "7: os.system", "8: multiprocessing.Process", "9: subprocess.Popen",
        "10: subprocess.check_output", "11: loop.subprocess_exec"]


def test_the_scan_covers_the_tests_and_benchmarks() -> None:
    files = {path.relative_to(ROOT).as_posix() for path in scanned_files()}
    assert {"tests/redis_server.py", "bench/engines_procs.py", "tests_vllm/services.py",
            "kvcoord/fleet_procs.py", ".ci/local.py"} <= files
