"""The names the docs tell operators to use exist in the code: every ``kvcoord_*`` metric is
exposed by a coordinator or a worker, every ``KVCOORD_*`` variable is read by a loader, and every
``kvcoord`` subcommand in a command line parses."""

from __future__ import annotations

import dataclasses
import re
import textwrap
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from bench.bench_engines import TRACE_VAR
from bench.engines_fleet import SMG_VAR, VLLM_PYTHON_VAR
from bench.engines_quota import CGROUP_VAR
from coordinator.config import CoordinatorConfig
from coordinator.control.shard_routing import ShardRouting
from coordinator.core.accel import NO_ACCEL_VARIABLE
from coordinator.replica import CoordinatorReplica
from coordinator.rpc.interceptor import ErrorMappingInterceptor
from coordinator.server.metrics import CoordinatorMetrics
from coordinator.server.peer_shards import peer_shards
from coordinator.server.sync_relay import SyncFrontends
from coordinator.store.memory import MemoryStore
from kvcoord.child_process import OWNER_VAR
from kvcoord.cli_security import CLIENT_FILE_VARIABLES, TOKEN_VARIABLE
from kvcoord.engine_envs import CACHE_VAR
from kvcoord.epp.metrics import PickerMetrics
from kvcoord.gateway.config import GatewayConfig
from kvcoord.gateway.metrics import GatewayMetrics
from tests.test_bridge_engine_gauges import RANK0, vllm_metrics
from worker.bridge.bridge import Bridge, BridgeConfig
from worker.bridge.main import bridge_registry
from worker.config import WorkerConfig
from worker.metrics import WorkerMetrics
from worker.runtime import RuntimeStats, TierCopyStats
from worker.sync.sync_protocol import SyncCounters

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Read outside the two config dataclasses (see ARCHITECTURE.md §6).
OTHER_VARIABLES = {"KVCOORD_COORDINATOR", "KVCOORD_HASH_KEY", "KVCOORD_HASH_ALGORITHM",
                   "KVCOORD_PAGE_SIZE", TOKEN_VARIABLE, NO_ACCEL_VARIABLE,
                   *CLIENT_FILE_VARIABLES.values(),
                   # kvcoord bench engines: where the peers' venvs and its trace are
                   VLLM_PYTHON_VAR, SMG_VAR, TRACE_VAR, CGROUP_VAR,
                   # the engine environments' cache, and the owner mark of a run's processes
                   CACHE_VAR, OWNER_VAR}


def exposed_metric_names() -> set[str]:
    """Every sample name a coordinator (with replication) and a worker expose."""
    service = CoordinatorReplica(CoordinatorConfig(replica_id="r"), MemoryStore(),
                                 replicate=True)
    counts = {f.name: 0 for f in dataclasses.fields(RuntimeStats) if f.name != "copies"}
    stats = RuntimeStats(**counts, copies=TierCopyStats())  # a host tier: its metrics too
    coordinator = CoordinatorMetrics(service)
    coordinator.requests.labels("Route", "OK").inc()
    coordinator.latency.labels("Route").observe(0.001)
    # A replica with a sync frontend (configured, not started: its gauges read 0).
    coordinator.watch_frontends(SyncFrontends(
        service, ErrorMappingInterceptor(coordinator),
        CoordinatorConfig(replica_id="r", sync_frontends=1)))
    # A replica whose routes span another shard (its peer is never called here).
    coordinator.watch_shards(ShardRouting(service.router, peer_shards(
        {"b": ("127.0.0.1:1",)}, page_size=16, max_message_bytes=1 << 20)))
    text = generate_latest(coordinator.registry).decode()
    worker = WorkerMetrics(lambda: stats, sync=SyncCounters())
    worker.requests.labels("Generate", "OK").inc()
    worker.latency.labels("Generate").observe(0.1)
    worker.prompt_tokens.labels("cached").inc()
    worker.cache_hit_tokens.labels("cpu").inc()
    worker.sync_policy_commands.labels("drain").inc()
    text += generate_latest(worker.registry).decode()
    bridge = Bridge(BridgeConfig(events="tcp://127.0.0.1:1", coordinator="127.0.0.1:1",
                                 worker_id="engine", worker_address="127.0.0.1:2"))
    bridge.malformed["frame"] = 1
    text += generate_latest(bridge_registry(bridge)).decode()
    # A bridge with policy control (the CLI's default) exposes its policy metrics too.
    # With its engine's /metrics readable (read at the scrape), the engine's capacity and
    # requests too.
    with vllm_metrics(RANK0) as (engine_url, _asked):
        controlling = Bridge(BridgeConfig(
            events="tcp://127.0.0.1:1", coordinator="127.0.0.1:1", worker_id="engine",
            worker_address="127.0.0.1:2", engine_url=engine_url, policy_control=True,
            http_listen="127.0.0.1:4"))
        assert controlling.member is not None and controlling.gauges is not None
        controlling.member.driver.counters.failures["apply"] = 1
        controlling.member.driver.counters.stages["drain"] = 1
        text += generate_latest(bridge_registry(controlling)).decode()
    gateway = GatewayMetrics()
    gateway.requests.labels("/v1/completions", "200").inc()
    for histogram in (gateway.ttft, gateway.inter_token, gateway.latency):
        histogram.labels("w0").observe(0.01)
    text += generate_latest(gateway.registry).decode()
    picker = PickerMetrics()
    picker.picks.labels("picked").inc()
    picker.served.labels("picked").inc()
    text += generate_latest(picker.registry).decode()
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def _mentioned(pattern: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for doc in DOCS:
        for name in re.findall(pattern, doc.read_text()):
            found.setdefault(name, []).append(doc.name)
    return found


def test_every_metric_the_docs_name_is_exposed() -> None:
    exposed = exposed_metric_names()
    base = {re.sub(r"_(bucket|sum|count|created)$", "", n) for n in exposed} | exposed
    mentioned = _mentioned(r"\bkvcoord_[a-z_]*[a-z](?:_\*)?")
    missing = {
        name: docs for name, docs in mentioned.items()
        if not (name in base or (name.endswith("_*")
                and any(n.startswith(name[:-1]) for n in base)))  # a family: kvcoord_worker_*
    }
    assert not missing, f"metrics named in the docs but not exposed: {missing}"
    assert len(mentioned) > 20  # the check sees the docs at all


def test_every_variable_the_docs_name_is_read() -> None:
    known = {"KVCOORD_" + f.name.upper()
             for cls in (CoordinatorConfig, WorkerConfig, GatewayConfig)
             for f in dataclasses.fields(cls)} | OTHER_VARIABLES
    mentioned = _mentioned(r"\bKVCOORD_[A-Z_]*[A-Z]")
    unknown = {name: docs for name, docs in mentioned.items()
               if name not in known and name != "KVCOORD_KV"}  # KVCOORD_KV_* (a family)
    assert not unknown, f"variables named in the docs that no loader reads: {unknown}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_kvcoord_command_line_in_the_docs_parses(doc: Path) -> None:
    from kvcoord.cli import build_parser

    parser = build_parser()
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", doc.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip().rstrip("&").strip()
            if not line.startswith("kvcoord "):
                continue
            words = line.split()[1:]
            if "$(" in line or "|" in words:
                continue  # shell substitutions: not a literal command line
            # A redirection and its file are the shell's, not arguments.
            redirect = next((i for i, w in enumerate(words) if w in (">", ">>", "2>")), None)
            words = words[:redirect]
            parser.parse_args(words)  # SystemExit on an unknown subcommand or flag


def test_the_guides_own_overlay_example_renders_with_the_image_and_key_it_sets(
    tmp_path: Path,
) -> None:
    from tests import k8s_render

    guide = (ROOT / "docs" / "OPERATIONS.md").read_text()
    blocks = {}
    for body in re.findall(r"^ *```yaml\n(.*?)^ *```", guide, re.S | re.M):
        text = textwrap.dedent(body)
        name = re.match(r"# (my-cluster/[\w.-]+)", text)
        if name:
            blocks[name.group(1)] = text
    assert set(blocks) == {"my-cluster/kustomization.yaml", "my-cluster/secret-patch.yaml"}
    # The example sits next to a checkout called kvcoord; here the checkout is ROOT.
    (tmp_path / "kvcoord").symlink_to(ROOT)
    (tmp_path / "my-cluster").mkdir()
    for name, text in blocks.items():
        (tmp_path / name).write_text(text)
    resources = k8s_render.render(tmp_path / "my-cluster", k8s_render.wheel_kubectl())
    (secret,) = [r for r in resources
                 if r["kind"] == "Secret" and r["metadata"]["name"] == "kvcoord-secrets"]
    assert secret["stringData"]["KVCOORD_HASH_KEY"].startswith("3f9c")
    images = {c["image"] for r in resources if (spec := k8s_render.pod_spec(r))
              for c in spec["containers"] if "kvcoord" in c["image"]}
    assert images == {"registry.example.com/ml/kvcoord:0.1.0-cuda"}
