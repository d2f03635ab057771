"""Leaving the fleet: a deregistration from outside (a pod's preStop) is final for the worker,
its pages leave the index at once, and the rollout records of what it was still running are
accepted after it left; a graceful stop cordons the worker before it drains."""

from __future__ import annotations

import asyncio

from coordinator.client import AsyncCoordinatorClient
from tests.coordinator_fixtures import eventually, running_coordinator, target
from worker.client import AsyncWorkerClient
from worker.config import WorkerConfig
from worker.main import start_worker

PAGE = 4
PROMPT = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5]


async def test_a_deregistered_worker_stays_out_and_its_last_rollouts_still_count() -> None:
    async with running_coordinator(page_size=PAGE) as coordinator:
        worker = await start_worker(WorkerConfig(
            coordinator=target(coordinator), listen="127.0.0.1:0", pages=64, page_size=PAGE,
            device="cpu", worker_id="w-0", max_new_tokens=8, backoff_max_ms=100,
        ))
        try:
            await asyncio.wait_for(worker.agent.synced.wait(), 10)
            async with AsyncCoordinatorClient(target(coordinator)) as client, \
                    AsyncWorkerClient(f"127.0.0.1:{worker.port}") as engine:
                await engine.generate(PROMPT, 2)
                await eventually(lambda: _cached(client), what="the prompt's pages indexed")
                assert await asyncio.to_thread(_deregister, target(coordinator))
                await asyncio.wait_for(worker.agent.left.wait(), 5)
                await asyncio.sleep(0.5)  # several reconnect backoffs: it must not come back
                assert await client.workers() == []
                assert (await client.lookup(PROMPT)).matches == {}
                # Still running what it was given; the records reach the trainer.
                await engine.generate(PROMPT, 2)
                await worker.stop()
                records = [r async for r in client.rollouts()]
                assert [r.worker_id for r in records] == ["w-0", "w-0"]
        finally:
            await worker.stop()


async def test_a_graceful_stop_cordons_the_worker_before_draining() -> None:
    async with running_coordinator(page_size=PAGE) as coordinator:
        worker = await start_worker(WorkerConfig(
            coordinator=target(coordinator), listen="127.0.0.1:0", pages=64, page_size=PAGE,
            device="cpu", worker_id="w-0", max_new_tokens=8,
        ))
        await asyncio.wait_for(worker.agent.synced.wait(), 10)
        session = coordinator.service.fleet.get("w-0")
        assert session is not None and not session.cordoned
        await worker.stop(deregister=False)
        assert session.cordoned  # before the drain, so no route landed on it meanwhile


async def _cached(client: AsyncCoordinatorClient) -> bool:
    return bool((await client.lookup(PROMPT)).matches)


def _deregister(coordinator: str) -> bool:
    from coordinator.client import CoordinatorClient

    with CoordinatorClient(coordinator) as client:
        return client.deregister("w-0")
