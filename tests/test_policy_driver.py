"""The bridge's ``PolicyDriver`` with ``--weights trainer`` against the contract double of SGLang
0.5.23 (``tests.sglang_double``): APPLY waits, gate closed and nothing acked, until the trainer
has pushed the weights and named their version on the engine (here through SGLang's
``/update_weights_from_disk`` with ``weight_version``, as a trainer's own client calls it); then
the cache is flushed, the version read back, the gate reopened at it and APPLIED acked. A trainer
that never signals fences the engine (FAILED, step ``wait_weights``), and a bridge that loads
from URIs refuses an update that names none, saying which flag it would need."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from coordinator.v1 import coordinator_pb2 as pb
from tests.sglang_double import SglangDouble
from worker.bridge.engine_proxy import EngineProxy
from worker.bridge.engine_sglang import SglangControl
from worker.bridge.policy_driver import PolicyDriver


def checkpoint(root: Path, name: str) -> str:
    folder = root / name
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    return str(folder)


@dataclass
class Driven:
    double: SglangDouble
    driver: PolicyDriver
    acks: list[pb.PolicyAck] = field(default_factory=list)
    fenced: list[str] = field(default_factory=list)

    def flushes(self) -> int:
        return self.double.flush_statuses.count(200)

    def stages(self) -> list[tuple[str, int]]:
        return [(pb.PolicyAck.Stage.Name(a.stage), a.version) for a in self.acks]


async def drive(tmp_path: Path, weights: str, trainer_timeout_s: float = 30.0
                ) -> AsyncIterator[Driven]:
    async with SglangDouble(checkpoint(tmp_path, "v0")) as double:
        control = SglangControl(double.url, load_timeout_s=5.0)
        proxy = EngineProxy(double.url, worker_id="sglang-0", on_answer=lambda _: None)
        driven: Driven

        def send(request: pb.SyncRequest) -> bool:
            driven.acks.append(request.policy_ack)
            return True

        async def on_fenced(reason: str) -> None:
            driven.fenced.append(reason)

        driver = PolicyDriver(
            control, proxy, version=0, weights=weights, weights_root=tmp_path,
            cleared=lambda: driven.flushes(), confirmed=lambda _: None, send=send,
            on_fenced=on_fenced, clear_timeout_s=5.0, trainer_timeout_s=trainer_timeout_s)
        driven = Driven(double, driver)
        proxy.open(0)
        try:
            yield driven
        finally:
            await driver.stop()
            await control.close()


@pytest.fixture
async def trainer_pushes(tmp_path: Path) -> AsyncIterator[Driven]:
    async for driven in drive(tmp_path, "trainer"):
        yield driven


def command(kind: pb.PolicyCommand.Kind, version: int, weights_uri: str = ""
            ) -> pb.PolicyCommand:
    return pb.PolicyCommand(kind=kind, version=version, weights_uri=weights_uri)


async def test_apply_waits_for_the_trainers_push_then_flushes_checks_and_reopens(
    trainer_pushes: Driven, tmp_path: Path,
) -> None:
    driven, double, driver = trainer_pushes, trainer_pushes.double, trainer_pushes.driver
    driver.handle(command(pb.PolicyCommand.KIND_DRAIN, 1))
    driver.handle(command(pb.PolicyCommand.KIND_APPLY, 1))
    await asyncio.sleep(0.5)  # drained, and waiting for the trainer
    assert driven.stages() == [("STAGE_DRAINED", 1)]
    assert (double.paused, driver.proxy.is_open, driven.flushes()) == (True, False, 0)
    async with aiohttp.ClientSession() as session, session.post(
            f"{double.url}/update_weights_from_disk",
            json={"model_path": checkpoint(tmp_path, "v1"), "weight_version": "1",
                  "flush_cache": False}) as pushed:
        assert pushed.status == 200, await pushed.text()
    await asyncio.wait_for(driver.idle(), 10)
    assert driven.stages() == [("STAGE_DRAINED", 1), ("STAGE_APPLIED", 1)]
    assert (double.model_path, double.weight_version) == (str(tmp_path / "v1"), "1")
    assert (double.paused, driven.flushes(), double.cache_blocks) == (False, 1, 0)
    assert (driver.proxy.is_open, driver.proxy.version, driver.version) == (True, 1, 1)
    assert driven.fenced == [] and not driver.counters.fenced


async def test_a_trainer_that_never_signals_fences_the_engine(tmp_path: Path) -> None:
    async for driven in drive(tmp_path, "trainer", trainer_timeout_s=1.0):
        driven.driver.handle(command(pb.PolicyCommand.KIND_DRAIN, 1))
        driven.driver.handle(command(pb.PolicyCommand.KIND_APPLY, 1))
        await asyncio.wait_for(driven.driver.idle(), 10)
        assert driven.stages() == [("STAGE_DRAINED", 1), ("STAGE_FAILED", 1)]
        reason = driven.acks[-1].reason
        assert reason == "wait_weights: the trainer did not finish pushing version 1 within 1 s"
        assert driven.fenced == [reason]
        assert driven.driver.counters.failures == {"wait_weights": 1}
        assert driven.driver.counters.fenced and driven.driver.version == 0
        assert (driven.double.paused, driven.double.weight_version) == (True, "default")


async def test_a_bridge_loading_from_uris_refuses_an_update_that_names_none(
    tmp_path: Path,
) -> None:
    async for driven in drive(tmp_path, "uri"):
        driven.driver.handle(command(pb.PolicyCommand.KIND_DRAIN, 1))
        driven.driver.handle(command(pb.PolicyCommand.KIND_APPLY, 1))
        await asyncio.wait_for(driven.driver.idle(), 10)
        assert driven.stages() == [("STAGE_DRAINED", 1), ("STAGE_FAILED", 1)]
        assert "names no weights_uri" in driven.acks[-1].reason
        assert "--weights trainer" in driven.acks[-1].reason
        assert driven.driver.counters.failures == {"load": 1}
        assert driven.double.model_path == str(tmp_path / "v0")
