"""The bridge's ``PolicyDriver`` with ``VllmControl`` against the contract double of vLLM 0.32
(``tests.vllm_double``; vLLM's OffloadingConnector does not run on its CPU build, so no real
engine can show the offload tier here):

- APPLY's reset clears the offload tier too (``reset_external=true``): a prefix computed under v0
  and held only in the offload tier is not served under v1;
- APPLY checksums the weights before and after the load (``/weight_checker``): a load that
  changed them is applied, one that left every weight as it was fences the engine (FAILED, step
  ``verify``), and an engine without ``/weight_checker`` goes on unchecked, logged once;
- the checks are exported as ``kvcoord_bridge_weight_checks_total{outcome}``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from prometheus_client import generate_latest
from structlog.testing import capture_logs

from coordinator.v1 import coordinator_pb2 as pb
from tests.vllm_double import BLOCK_TOKENS, VllmDouble
from worker.bridge.bridge import Bridge, BridgeConfig
from worker.bridge.engine_proxy import EngineProxy
from worker.bridge.engine_vllm import VllmControl
from worker.bridge.main import bridge_registry
from worker.bridge.policy_driver import PolicyDriver

PROMPT = list(range(100, 100 + 3 * BLOCK_TOKENS + 1))  # three full blocks before its last token


def checkpoint(root: Path, name: str, weights: bytes) -> str:
    folder = root / name
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(weights)
    return str(folder)


@dataclass
class Driven:
    double: VllmDouble
    driver: PolicyDriver
    acks: list[pb.PolicyAck] = field(default_factory=list)
    fenced: list[str] = field(default_factory=list)

    def stages(self) -> list[tuple[str, int]]:
        return [(pb.PolicyAck.Stage.Name(a.stage), a.version) for a in self.acks]

    async def update(self, version: int) -> None:
        """The coordinator's sync update to ``version``, weights ``v<version>``."""
        for kind in (pb.PolicyCommand.KIND_DRAIN, pb.PolicyCommand.KIND_APPLY):
            self.driver.handle(pb.PolicyCommand(kind=kind, version=version,
                                                weights_uri=f"v{version}"))
        await self.driver.idle()


@asynccontextmanager
async def driven(tmp_path: Path, *, without: frozenset[str] = frozenset()
                 ) -> AsyncIterator[Driven]:
    async with VllmDouble(checkpoint(tmp_path, "v0", b"weights of v0"),
                          without=without) as double:
        control = VllmControl(double.url, load_timeout_s=5.0)
        proxy = EngineProxy(double.url, worker_id="vllm-0", on_answer=lambda _: None)
        acks: list[pb.PolicyAck] = []
        fenced: list[str] = []

        def send(request: pb.SyncRequest) -> bool:
            acks.append(request.policy_ack)
            return True

        async def on_fenced(reason: str) -> None:
            fenced.append(reason)

        driver = PolicyDriver(
            control, proxy, version=0, weights="uri", weights_root=tmp_path,
            cleared=lambda: double.clears_published, confirmed=lambda _: None, send=send,
            on_fenced=on_fenced, clear_timeout_s=5.0)
        proxy.open(0)
        try:
            yield Driven(double, driver, acks, fenced)
        finally:
            await driver.stop()
            await control.close()


async def cached_tokens(url: str, prompt: list[int]) -> int:
    async with aiohttp.ClientSession() as session, session.post(
            f"{url}/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1}
    ) as answer:
        assert answer.status == 200, await answer.text()
        body = await answer.json()
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


async def test_a_v0_prefix_in_the_offload_tier_is_not_served_under_v1(tmp_path: Path) -> None:
    checkpoint(tmp_path, "v1", b"weights of v1")
    async with driven(tmp_path) as engine:
        double = engine.double
        assert await cached_tokens(double.url, PROMPT) == 0
        double.evict_device()  # the prefix now lives only in the offload tier
        assert await cached_tokens(double.url, PROMPT) == 3 * BLOCK_TOKENS  # loaded back

        await engine.update(1)

        assert engine.stages() == [("STAGE_DRAINED", 1), ("STAGE_APPLIED", 1)]
        assert double.weight_version == "1"
        assert await cached_tokens(double.url, PROMPT) == 0  # computed anew, under v1
        assert double.stale_tokens == 0
        assert double.reset_queries == [{"reset_external": "true"}]


async def test_a_load_that_changed_the_weights_is_checked_and_applied(tmp_path: Path) -> None:
    checkpoint(tmp_path, "v1", b"weights of v1")
    async with driven(tmp_path) as engine:
        await engine.update(1)
        assert engine.stages() == [("STAGE_DRAINED", 1), ("STAGE_APPLIED", 1)]
        counters = engine.driver.counters
        assert counters.weight_checks == {"checked": 1, "failed": 0, "unchecked": 0}
        assert (engine.double.checksums_taken, counters.failures, engine.fenced) == (2, {}, [])
        assert engine.driver.known_paths == {1: str(tmp_path / "v1")}


async def test_a_load_that_left_every_weight_unchanged_fences_the_engine(tmp_path: Path) -> None:
    checkpoint(tmp_path, "v1", b"weights of v0")  # the trainer saved the old weights again
    async with driven(tmp_path) as engine:
        await engine.update(1)
        reason = (f"verify: every weight is unchanged after loading {tmp_path / 'v1'} for "
                  f"version 1 (1 checksums equal to those before)")
        assert engine.stages() == [("STAGE_DRAINED", 1), ("STAGE_FAILED", 1)]
        assert engine.acks[-1].reason == reason and engine.fenced == [reason]
        counters = engine.driver.counters
        assert counters.weight_checks == {"checked": 0, "failed": 1, "unchecked": 0}
        assert (counters.failures, counters.fenced, engine.driver.version) == \
            ({"verify": 1}, True, 0)
        assert engine.driver.known_paths == {}  # recovery never reloads v1 from there
        # Left paused, its cache and version tag as they were; the proxy refuses.
        assert (engine.double.paused, engine.double.weight_version) == (True, "default")
        assert engine.double.reset_queries == [] and not engine.driver.proxy.is_open


async def test_an_engine_without_the_weight_checker_goes_on_unchecked_logged_once(
    tmp_path: Path,
) -> None:
    checkpoint(tmp_path, "v1", b"weights of v1")
    checkpoint(tmp_path, "v2", b"weights of v1")  # unchanged, and nobody can tell
    async with driven(tmp_path, without=frozenset({"/weight_checker"})) as engine:
        with capture_logs() as logs:
            await engine.update(1)
            await engine.update(2)
        assert engine.stages() == [("STAGE_DRAINED", 1), ("STAGE_APPLIED", 1),
                                   ("STAGE_DRAINED", 2), ("STAGE_APPLIED", 2)]
        assert engine.driver.counters.weight_checks == {"checked": 0, "failed": 0,
                                                        "unchecked": 2}
        unchecked = [entry for entry in logs if entry["event"] == "bridge.weights_unchecked"]
        assert unchecked == [{"event": "bridge.weights_unchecked", "log_level": "warning",
                              "engine": "vllm",
                              "reason": "the engine gives no weight checksums"}]
        assert engine.double.weight_version == "2"


def test_weight_checks_are_exported_by_outcome() -> None:
    bridge = Bridge(BridgeConfig(events="tcp://127.0.0.1:1", coordinator="127.0.0.1:1",
                                 worker_id="vllm-0", worker_address="127.0.0.1:2",
                                 engine_url="http://127.0.0.1:1", policy_control=True,
                                 http_listen="127.0.0.1:4"))
    assert bridge.member is not None
    bridge.member.driver.counters.weight_checks.update(checked=3, failed=1)
    lines = generate_latest(bridge_registry(bridge)).decode().splitlines()
    assert [line for line in lines if line.startswith("kvcoord_bridge_weight_checks_total")] == [
        'kvcoord_bridge_weight_checks_total{outcome="checked"} 3.0',
        'kvcoord_bridge_weight_checks_total{outcome="failed"} 1.0',
        'kvcoord_bridge_weight_checks_total{outcome="unchecked"} 0.0']
