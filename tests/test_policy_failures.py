"""A member that reports STAGE_FAILED (a bridged engine that could not load, reset or tag its
weights): fenced at once, its reason in the update's status and the commit's answer, the commit
not waiting out its deadline for it, and an update that no member applied aborted, not committed.
Real coordinator, scripted workers speaking the Sync protocol."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest

from bench.scripted_worker import ScriptedWorker
from coordinator.client import AsyncCoordinatorClient, KvcoordError
from coordinator.v1 import coordinator_pb2 as pb
from tests.coordinator_fixtures import DEV_HASH, eventually, running_coordinator, target

BAD_PATH = "load: POST /collective_rpc answered 500: no such file /ckpt/v1"


@asynccontextmanager
async def two_members() -> AsyncIterator[tuple[str, list[ScriptedWorker]]]:
    async with running_coordinator(barrier_timeout_ms=60_000, route_wait_ms=100) as coord:
        workers = [ScriptedWorker(target(coord), f"w{i}", hash_config=DEV_HASH) for i in range(2)]
        for w in workers:
            await w.start()
            await w.heartbeat()
        try:
            yield target(coord), workers
        finally:
            for w in workers:
                await w.close()


async def _command(worker: ScriptedWorker, kind: pb.PolicyCommand.Kind) -> pb.PolicyCommand:
    while True:
        message = await worker.next_message()
        if message.WhichOneof("body") == "command" and message.command.kind == kind:
            return message.command


async def _ack(worker: ScriptedWorker, stage: pb.PolicyAck.Stage, version: int,
               reason: str = "") -> None:
    await worker.send(pb.SyncRequest(policy_ack=pb.PolicyAck(stage=stage, version=version,
                                                             reason=reason)))


async def _drain_then(worker: ScriptedWorker, stage: pb.PolicyAck.Stage, reason: str = "") -> None:
    await _command(worker, pb.PolicyCommand.KIND_DRAIN)
    await _ack(worker, pb.PolicyAck.STAGE_DRAINED, 1)
    await _command(worker, pb.PolicyCommand.KIND_APPLY)
    await _ack(worker, stage, 1, reason)


async def test_a_failed_member_is_fenced_at_once_and_named_with_its_reason() -> None:
    async with two_members() as (addr, (good, bad)), AsyncCoordinatorClient(addr) as client:
        await client.begin_policy_update(0)
        await _drain_then(bad, pb.PolicyAck.STAGE_FAILED, BAD_PATH)

        async def failure_shown() -> bool:
            return (await client.policy()).failures == {"w1": BAD_PATH}

        await eventually(failure_shown, timeout=5, what="the failure in GetPolicy")
        states = {w.worker_id: w.state for w in await client.workers()}
        assert states["w1"] == "fenced" and states["w0"] == "draining"

        await _drain_then(good, pb.PolicyAck.STAGE_APPLIED)
        began = time.monotonic()
        state = await client.commit_policy_update(1, timeout=60)
        # The only member still missing had failed: nothing to wait for.
        assert time.monotonic() - began < 30
        assert state.version == 1
        assert state.acked_workers == ("w0",) and state.fenced_workers == ("w1",)
        assert state.failures == {"w1": BAD_PATH}
        assert {(await client.route([1, 2, 3, 4] * 8)).worker_id for _ in range(4)} == {"w0"}


async def test_an_update_no_member_applied_is_aborted_with_every_reason() -> None:
    async with two_members() as (addr, workers), AsyncCoordinatorClient(addr) as client:
        await client.begin_policy_update(0)
        for w in workers:
            await _drain_then(w, pb.PolicyAck.STAGE_FAILED, f"{w.worker_id} {BAD_PATH}")
        with pytest.raises(KvcoordError) as refused:
            await client.commit_policy_update(1, timeout=60)
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "aborted" in str(refused.value)
        assert f"w0: w0 {BAD_PATH}" in str(refused.value)
        assert f"w1: w1 {BAD_PATH}" in str(refused.value)
        state = await client.policy()
        assert (state.version, state.phase, state.target_version) == (0, "serving", None)
