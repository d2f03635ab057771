"""A pytest killed with SIGKILL while its fixture serves a real vLLM engine takes the engine
along: its API server, and the engine core and model worker vLLM forked, are gone 5 s later
(every process the run started carries its owner mark: kvcoord.leftovers finds them).

The engine is started as the engine tests start theirs (tests_vllm.services, vLLM's CPU build
serving the tiny model with dummy weights), inside a pytest of its own that this test kills.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import time
from pathlib import Path

import pytest

from kvcoord import child_process, leftovers
from tests_vllm.test_vllm_engine import VLLM_START_S, vllm_interpreter

ROOT = Path(__file__).resolve().parent.parent
GONE_WITHIN_S = 5.0

SERVING_ENGINE = '''
import os, sys, tempfile, time, urllib.request
from pathlib import Path
from tests_vllm.services import start_service, stop_services
from tests_vllm.test_vllm_engine import vllm_argv, vllm_env
from tests_vllm.tiny_model import write_tiny_model
from kvcoord.fleet_procs import free_port

def test_serves_until_killed(tmp_path):
    scratch = Path(tempfile.mkdtemp(prefix="kvcoord-outlived-"))
    port = free_port()
    model = write_tiny_model(tmp_path / "model")
    engine = start_service("vllm", vllm_argv(Path(os.environ["VLLM_PYTHON"]), model, port,
                                             f"ipc://{scratch}/events", f"ipc://{scratch}/replay"),
                           env=vllm_env(scratch, tmp_path / "cache"), cwd=tmp_path,
                           log_dir=tmp_path)
    deadline = time.monotonic() + float(os.environ["START_S"])
    while True:
        assert engine.process.poll() is None, engine.log_tail()
        assert time.monotonic() < deadline, engine.log_tail()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                if answer.status == 200:
                    break
        except OSError:
            time.sleep(0.5)
    Path(os.environ["READY_FILE"]).write_text(str(engine.process.pid))
    time.sleep(600)
'''


def test_a_killed_pytest_takes_its_vllm_engine_and_the_processes_vllm_forked_along(
    tmp_path: Path,
) -> None:
    python = vllm_interpreter()
    owner = f"test-vllm-outlived-{secrets.token_hex(4)}"
    (tmp_path / "test_inner.py").write_text(SERVING_ENGINE)
    ready = tmp_path / "ready"
    env = {**os.environ, child_process.OWNER_VAR: owner, "READY_FILE": str(ready),
           "PYTHONPATH": str(ROOT), "VLLM_PYTHON": str(python), "START_S": str(VLLM_START_S)}
    log = (tmp_path / "inner.log").open("wb")
    inner = child_process.start(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-c",
         os.devnull, "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
        cwd=tmp_path, env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + VLLM_START_S + 30
        while not ready.exists():
            if inner.poll() is not None or time.monotonic() > deadline:
                pytest.fail("the inner engine did not come up:\n" +
                            (tmp_path / "inner.log").read_text()[-6000:], pytrace=False)
            time.sleep(0.5)
        engine_pid = int(ready.read_text())
        serving = leftovers.marked(owner)
        # The pytest, vLLM's API server and at least the engine core it forked.
        assert len(serving) >= 3 and engine_pid in {p.pid for p in serving}, \
            [p.command() for p in serving]
        os.kill(inner.pid, signal.SIGKILL)
        inner.wait()
        alive = leftovers.wait_gone(owner, GONE_WITHIN_S)
        assert alive == [], (f"{len(serving)} processes served; {GONE_WITHIN_S} s after the "
                             f"kill these still run: {[p.command()[:200] for p in alive]}")
    finally:
        leftovers.kill(leftovers.marked(owner))
        log.close()
