"""The routers that take turns in front of the engines: ``kvcoord gateway`` (with its
coordinator, ``kv_aware`` by default, and one ``kvcoord bridge vllm`` per engine), Envoy asking
``kvcoord epp`` (the same coordinator and bridges behind a C++ data path), and SGLang's model
gateway ``smg`` (PyPI ``sglang-router``) with a ``--policy``. Each is started fresh for
its turn, after the engines' caches are emptied, so every turn starts from the same state:
empty caches, an empty index, new router books. Everything listens on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.engines_fleet import (
    ENGINE_BLOCK,
    MODEL,
    PAGE_SIZE,
    RUNNER_PYTHON_VARS,
    Engine,
    empty_caches,
)
from bench.engines_procs import (
    EnginesError,
    Proc,
    http_get,
    kvcoord_argv,
    kvcoord_env,
    metric_samples,
    start,
    stop,
    wait_until,
)
from bench.engines_trace import DECISION_LOG_VAR
from coordinator.client import CoordinatorClient
from coordinator.client.errors import KvcoordError
from kvcoord.epp.envoy_config import ENVOY_HINT, envoy_argv, envoy_binary, envoy_bootstrap
from kvcoord.fleet_procs import free_port

ROUTER_START_S = 60.0
SYNC_S = 60.0


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
    tag: str = ""
    front: str = "gateway"
    """What clients connect to: ``gateway`` (kvcoord's), ``envoy`` (Envoy asking ``kvcoord
    epp``) or ``smg``."""
    access_log: Path | None = None
    """Envoy's access log (``envoy_config.ACCESS_LOG_FIELDS``), for an Envoy front."""

    def role(self, proc: Proc) -> str:
        """What ``proc`` is in this router: ``gateway``, ``coordinator``, ``bridge-vllm-0``,
        ``smg``."""
        return proc.name.removeprefix(f"{self.tag}-")


@contextmanager
def kvcoord_router(engines: Sequence[Engine], model_dir: Path, log_dir: Path,
                   max_model_len: int, tag: str, *, policy: str = "kv_aware",
                   core: int | None = None, embedded: bool = True,
                   decision_log: bool = False, front: str = "gateway", fail_open: bool = False,
                   fallback: str | None = None) -> Iterator[RouterRun]:
    """A coordinator routing by ``policy``, one bridge per engine and the front clients
    connect to (its ``/metrics`` on: ``metrics_url``), all fresh, on ``core`` when given.
    ``front``: ``gateway`` (``kvcoord gateway``), or ``envoy`` (Envoy 1.40 whose ext_proc
    filter asks ``kvcoord epp``: ``envoy_config``'s bootstrap, the body buffered to the picker,
    the answer streamed past it). ``embedded``: the coordinator runs in the front's process
    (``--embed-coordinator``); else in its own. ``decision_log``: the coordinator logs each
    decision (``engines_trace``). ``fail_open`` and ``fallback`` (``host:port``): Envoy's
    answer to a picker it cannot reach (``envoy_config.envoy_bootstrap``). Yields once the
    front can route and every bridge has applied the engines' cache reset (done here, after
    the bridges subscribed). EnginesError for an Envoy front without an envoy binary."""
    envoy = envoy_binary() if front == "envoy" else None
    if front == "envoy" and envoy is None:
        raise EnginesError(f"the envoy turn needs an envoy binary: {ENVOY_HINT}")
    env = kvcoord_env(secrets.token_hex(32))
    traced = {DECISION_LOG_VAR: "1"} if decision_log else {}
    coordinator = f"127.0.0.1:{free_port()}"
    front_port, front_metrics, picker_port = free_port(), free_port(), free_port()
    procs: list[Proc] = []
    bridge_metrics: list[str] = []
    access_log: Path | None = None
    common = ["--model", MODEL, "--tokenizer", str(model_dir), "--max-context",
              str(max_model_len), "--metrics-port", str(front_metrics)]
    if front == "envoy":
        front_name, front_argv = "epp", kvcoord_argv(
            "epp", "--listen", f"127.0.0.1:{picker_port}", *common)
    else:
        front_name, front_argv = "gateway", kvcoord_argv(
            "gateway", "--listen", f"127.0.0.1:{front_port}", *common)
    try:
        if embedded:  # the front first: the bridges connect to the coordinator in it
            procs.append(start(f"{tag}-{front_name}", [
                *front_argv, "--embed-coordinator", coordinator],
                env={**env, **traced, "KVCOORD_PAGE_SIZE": str(PAGE_SIZE),
                     "KVCOORD_ROUTING_POLICY": policy}, log_dir=log_dir, core=core))
        else:
            procs.append(start(f"{tag}-coordinator", kvcoord_argv(
                "coordinator", "--listen", coordinator, "--page-size", str(PAGE_SIZE),
                "--routing-policy", policy), env={**env, **traced}, log_dir=log_dir,
                core=core))
        for engine in engines:
            port = free_port()
            bridge_metrics.append(f"http://127.0.0.1:{port}/metrics")
            procs.append(start(f"{tag}-bridge-{engine.worker_id}", kvcoord_argv(
                "bridge", "vllm", "--no-policy-control", "--events", engine.events,
                "--replay", engine.replay,
                "--coordinator", coordinator, "--worker-id", engine.worker_id,
                "--worker-address", engine.url.removeprefix("http://"),
                "--engine-url", engine.url, "--model", MODEL, "--page-size", str(PAGE_SIZE),
                "--engine-block-size", str(ENGINE_BLOCK), "--metrics-port", str(port)),
                env=env, log_dir=log_dir, core=core))
        if not embedded:
            procs.append(start(f"{tag}-{front_name}", [*front_argv, "--coordinator",
                                                       coordinator],
                               env=env, log_dir=log_dir, core=core))
        if envoy is not None:
            config = log_dir / f"{tag}-envoy.json"
            access_log = log_dir / f"{tag}-envoy-access.log"
            config.write_text(json.dumps(envoy_bootstrap(
                listen=("127.0.0.1", front_port), admin=("127.0.0.1", free_port()),
                picker=("127.0.0.1", picker_port), access_log=str(access_log),
                fail_open=fail_open, fallback=fallback)))
            procs.append(start(f"{tag}-envoy", envoy_argv(envoy, str(config)), env=env,
                               log_dir=log_dir, core=core))
        url = f"http://127.0.0.1:{front_port}"
        with CoordinatorClient(coordinator, timeout=5.0) as client:
            wait_until(lambda: _ready(client) == {e.worker_id for e in engines},
                       timeout_s=ROUTER_START_S, what="both bridges to register", procs=procs)
        # Through Envoy, a bodiless request answered by an engine: the picker picks.
        ready = f"{url}/v1/models" if envoy is not None else f"{url}/readyz"
        wait_until(lambda: http_get(ready) is not None, timeout_s=ROUTER_START_S,
                   what=f"{ready} to answer", procs=procs)
        empty_caches(engines)
        with CoordinatorClient(coordinator, timeout=5.0) as client:
            wait_until(_ResetApplied(bridge_metrics, client), timeout_s=SYNC_S,
                       what="the bridges to apply the engines' cache reset", procs=procs)
        yield RouterRun(f"{'envoy + ' if envoy else ''}kvcoord {policy}", f"{url}/v1",
                        tuple(procs), coordinator, tuple(bridge_metrics),
                        f"http://127.0.0.1:{front_metrics}/metrics", tag, front,
                        access_log)
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
               tag: str, *, core: int | None = None) -> Iterator[RouterRun]:
    """``smg launch`` with ``policy`` and its defaults otherwise, on loopback (its metrics
    too), in front of ``engines`` after their caches were reset, on ``core`` when given.
    Yields once it lists every engine healthy."""
    empty_caches(engines)
    port, metrics_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k not in RUNNER_PYTHON_VARS}
    proc = start(f"{tag}-smg", [
        str(smg), "launch", "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *[e.url for e in engines], "--policy", policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)],
        env=env, log_dir=log_dir, core=core)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _smg_healthy(url) == len(engines), timeout_s=ROUTER_START_S,
                   what=f"smg to list {len(engines)} healthy workers", procs=[proc])
        yield RouterRun(f"smg {policy}", f"{url}/v1", (proc,),
                        metrics_url=f"http://127.0.0.1:{metrics_port}/metrics", tag=tag)
    finally:
        stop([proc])


def _smg_workers(url: str) -> list[dict[str, Any]]:
    """smg's ``GET /workers`` list, in its registry's order ([] when it does not answer)."""
    body = http_get(f"{url}/workers")
    if body is None:
        return []
    try:
        workers = json.loads(body).get("workers", [])
    except (ValueError, AttributeError):
        return []
    return [w for w in workers if isinstance(w, dict)]


def _smg_healthy(url: str) -> int:
    return sum(1 for w in _smg_workers(url) if w.get("is_healthy"))


def smg_worker_order(router: RouterRun, engines: Sequence[Engine]) -> list[int]:
    """The engines (positions in ``engines``) in smg's registry order. smg breaks a tie
    between workers of equal load by this order, which is the order its workers finished
    registering, not the order of ``--worker-urls``."""
    listed = [w.get("url") for w in _smg_workers(router.url.removesuffix("/v1"))]
    urls = [e.url for e in engines]
    return [urls.index(u) for u in listed if u in urls]
