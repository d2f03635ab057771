"""An RL fleet on real vLLM engines (the CPU build): the fleet ``make test-vllm``'s policy test
and ``kvcoord bench rl`` run updates on.

- two vLLM engines serving a checkpoint of the tiny test model (real safetensors weights, so
  ``reload_weights`` works; ``tests_vllm/tiny_model.write_checkpoint``), each pinned to a core,
  with ``VLLM_SERVER_DEV_MODE=1`` (the RL and dev endpoints), prefix caching, KV events on ipc
  sockets and ``--enable-prompt-tokens-details``;
- ``kvcoord coordinator`` (embedded store) with the timings a test passes;
- one ``kvcoord bridge vllm`` per engine: with ``policy_control`` it takes part in updates and
  serves the engine's API on a port of its own (``RlEngine.proxy_url``), loading a relative
  ``weights_uri`` under its own ``weights_root``; without, an external worker as before; either
  way its Prometheus ``/metrics`` on another (``RlEngine.metrics_url``: the last update's
  pause, ``kvcoord_bridge_last_pause_seconds``, and the version it confirmed);
- ``kvcoord gateway``, which waits out a drain for up to two minutes.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.engines_fleet import ENGINE_BLOCK, PAGE_SIZE, VLLM_START_S, vllm_env
from bench.engines_procs import Proc, http_get, kvcoord_argv, kvcoord_env, start, stop, wait_until
from coordinator.client import CoordinatorClient
from kvcoord.fleet_procs import free_port

MODEL = "rl-llama"
MAX_MODEL_LEN = 1024
KV_CACHE_BYTES = 64 << 20
HASH_KEY = "6b7663" * 10 + "6b76"  # any fixed 32-byte key: one for the coordinator and bridges
READY_S = 60.0
DRAIN_WAIT_MS = 120_000


@dataclass(frozen=True, slots=True)
class RlEngine:
    """One engine and its bridge: ``url`` the engine itself, ``proxy_url`` what the gateway
    reaches it through (the engine's own URL without policy control), ``metrics_url`` the
    bridge's ``/metrics``."""

    worker_id: str
    url: str
    proxy_url: str
    events: str
    replay: str
    engine: Proc
    bridge: Proc
    metrics_url: str


@dataclass(frozen=True, slots=True)
class RlFleet:
    coordinator: str
    gateway_url: str
    engines: tuple[RlEngine, ...]
    procs: tuple[Proc, ...]
    log_dir: Path


def vllm_argv(python: Path, checkpoint: Path, port: int, events: str, replay: str) -> list[str]:
    """The engine serving ``checkpoint`` (real weights) as ``MODEL``."""
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events,
                 "replay_endpoint": replay, "topic": "kv-events"}
    return [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(checkpoint), "--served-model-name", MODEL,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--enable-prefix-caching", "--block-size", str(ENGINE_BLOCK),
        "--kv-events-config", json.dumps(kv_events), "--enable-prompt-tokens-details",
        "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "32",
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
    ]


def launch_engines(python: Path, checkpoints: Sequence[Path], scratch: Path, log_dir: Path,
                   tag: str = "vllm") -> list[tuple[str, Proc, str, str]]:
    """One engine per checkpoint, started (not yet healthy), alternating cores: ``(url, proc,
    events, replay)`` each. ``await_engines`` waits for them."""
    started = []
    for i, checkpoint in enumerate(checkpoints):
        port = free_port()
        events, replay = f"ipc://{scratch}/{tag}-events-{i}", f"ipc://{scratch}/{tag}-replay-{i}"
        proc = start(f"{tag}-{i}", vllm_argv(python, checkpoint, port, events, replay),
                     env=vllm_env(scratch, i % 2), log_dir=log_dir, core=i % 2)
        started.append((f"http://127.0.0.1:{port}", proc, events, replay))
    return started


def await_engines(started: Sequence[tuple[str, Proc, str, str]]) -> None:
    """Until every one of ``launch_engines``' engines answers /health (EnginesError when one
    exits or the start takes too long)."""
    procs = [p for _, p, _, _ in started]
    for url, proc, _, _ in started:
        wait_until(lambda u=url: http_get(f"{u}/health") is not None,
                   timeout_s=VLLM_START_S, what=f"{proc.name}'s /health", procs=procs)


def start_engines(python: Path, checkpoints: Sequence[Path], scratch: Path, log_dir: Path,
                  tag: str = "vllm") -> list[tuple[str, Proc, str, str]]:
    """``launch_engines`` then ``await_engines``."""
    started = launch_engines(python, checkpoints, scratch, log_dir, tag)
    await_engines(started)
    return started


@contextmanager
def running_rl_fleet(
    python: Path, checkpoint: Path, weights_roots: Sequence[Path], log_dir: Path, *,
    coordinator_env: Mapping[str, str], policy_control: bool = True,
) -> Iterator[RlFleet]:
    """One engine per ``weights_roots`` entry, all started on ``checkpoint`` (version 0);
    yields the fleet with every bridge registered and the gateway up; stops everything."""
    scratch = Path(tempfile.mkdtemp(prefix="kvcoord-rl-"))  # short: ipc socket paths
    procs: list[Proc] = []
    env = kvcoord_env(HASH_KEY)
    try:
        started = start_engines(python, [checkpoint] * len(weights_roots), scratch, log_dir)
        procs += [p for _, p, _, _ in started]
        coordinator = f"127.0.0.1:{free_port()}"
        procs.append(start("coordinator", kvcoord_argv(
            "coordinator", "--listen", coordinator, "--page-size", str(PAGE_SIZE)),
            env={**env, **coordinator_env}, log_dir=log_dir))
        engines = []
        for i, ((url, engine, events, replay), root) in enumerate(
                zip(started, weights_roots, strict=True)):
            worker_id = f"vllm-{i}"
            proxy_port, metrics_port = free_port(), free_port()
            control = ["--http-listen", f"127.0.0.1:{proxy_port}", "--weights-root", str(root),
                       "--recover-interval-s", "1"] if policy_control else \
                ["--no-policy-control"]
            bridge = start(f"bridge-{i}", kvcoord_argv(
                "bridge", "vllm", "--events", events, "--replay", replay,
                "--coordinator", coordinator, "--worker-id", worker_id,
                "--worker-address", url.removeprefix("http://"), "--engine-url", url,
                "--model", MODEL, "--page-size", str(PAGE_SIZE),
                "--engine-block-size", str(ENGINE_BLOCK), "--metrics-port", str(metrics_port),
                *control), env=env, log_dir=log_dir)
            procs.append(bridge)
            proxy = f"http://127.0.0.1:{proxy_port}" if policy_control else url
            engines.append(RlEngine(worker_id, url, proxy, events, replay, engine, bridge,
                                    f"http://127.0.0.1:{metrics_port}/metrics"))
        gateway_url = f"http://127.0.0.1:{free_port()}"
        procs.append(start("gateway", kvcoord_argv(
            "gateway", "--coordinator", coordinator, "--listen",
            gateway_url.removeprefix("http://"), "--model", MODEL, "--tokenizer",
            str(checkpoint), "--max-context", str(MAX_MODEL_LEN),
            "--drain-wait-ms", str(DRAIN_WAIT_MS)), env=env, log_dir=log_dir))
        with CoordinatorClient(coordinator) as client:
            def registered() -> bool:
                try:
                    ready = {w.worker_id for w in client.workers() if w.state == "ready"}
                except Exception:  # the coordinator is still starting
                    return False
                return ready == {e.worker_id for e in engines}

            wait_until(registered, timeout_s=READY_S, what="every bridge registered", procs=procs)
        wait_until(lambda: http_get(f"{gateway_url}/readyz") is not None, timeout_s=READY_S,
                   what="the gateway's /readyz", procs=procs)
        yield RlFleet(coordinator, gateway_url, tuple(engines), tuple(procs), log_dir)
    finally:
        stop(procs)
        shutil.rmtree(scratch, ignore_errors=True)
