"""Policy updates: the cost of the sync barrier, and routes served during an async update.

Both run a real coordinator (gRPC, in this process, embedded store unless ``redis_url`` is
given) with scripted agents that answer policy commands at once: DRAIN -> DRAINED, APPLY ->
APPLIED after ``APPLY_S`` (a stand-in for loading weights, so the trainer's Commit is already
waiting when the acks arrive, as it is in a real update).

- ``bench_barrier``: barrier cost = time from the last worker's APPLIED ack (the moment its agent
  writes it) to ``CommitPolicyUpdate`` returning to the trainer, with 1, 8 and 64 workers;
  p50/max over several updates. Target: <= 20 ms at 64 workers. The baseline, measured in the
  same run, is one ``GetPolicy`` round trip (``rpc_ms_p50``): the floor any answer pays.
  ``commits_before_last_apply`` (must be 0): commits that returned before the last ack.
- ``bench_routes_during_async``: routes/s from concurrent SDK callers while an async update
  moves the workers one by one, against the same callers with no update (same run).
  ``stale_routes`` (must be 0): answers during the updates naming a version other than the old
  or the new one, or the new one from a worker that had not applied it yet.

Run: ``kvcoord bench policy``.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
import uuid
from typing import Any

from bench.scripted_worker import ScriptedWorker
from coordinator.client import AsyncCoordinatorClient
from coordinator.config import CoordinatorConfig
from coordinator.core.hashing import DEV_HASH_KEY, HashConfig
from coordinator.logs import configure_logging
from coordinator.server.main import RunningCoordinator, start_coordinator
from coordinator.v1 import coordinator_pb2 as pb

APPLY_S = 0.02
ROUTE_CALLERS = 16
PROMPT_TOKENS = 256
# Long leases: the agents send no heartbeats, and nothing here should lapse mid-measure.
KNOBS: dict[str, Any] = {"lease_ms": 600_000, "heartbeat_ms": 300_000,
                         "barrier_timeout_ms": 30_000, "log_level": "warning"}


class AckingWorker(ScriptedWorker):
    """A scripted worker that acknowledges policy commands by itself: DRAINED at once, APPLIED
    ``apply_s`` after an APPLY. ``applied_at[version]`` is the ``perf_counter`` time it wrote
    its APPLIED ack."""

    def __init__(self, target: str, worker_id: str, apply_s: float) -> None:
        super().__init__(target, worker_id, hash_config=HashConfig(DEV_HASH_KEY))
        self.apply_s = apply_s
        self.applied_at: dict[int, float] = {}
        self._answering: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await super().start()
        self._answering = asyncio.create_task(self._answer())

    async def _answer(self) -> None:
        while True:
            message = await self.next_message(timeout=3600)
            if message.WhichOneof("body") != "command":
                continue
            command = message.command
            if command.kind == pb.PolicyCommand.KIND_DRAIN:
                await self._ack(pb.PolicyAck.STAGE_DRAINED, command.version)
            elif command.kind == pb.PolicyCommand.KIND_APPLY:
                await asyncio.sleep(self.apply_s)  # "loading the weights"
                self.policy_version = command.version
                self.applied_at[command.version] = time.perf_counter()
                await self._ack(pb.PolicyAck.STAGE_APPLIED, command.version)

    async def _ack(self, stage: pb.PolicyAck.Stage, version: int) -> None:
        await self.send(pb.SyncRequest(policy_ack=pb.PolicyAck(stage=stage, version=version)))

    async def close(self) -> None:
        if self._answering is not None:
            self._answering.cancel()
        await super().close()


async def _fleet(
    workers: int, apply_s: float, redis_url: str | None, **overrides: Any
) -> tuple[RunningCoordinator, list[AckingWorker]]:
    # A fresh store namespace: every run starts at version 0 with no workers, even on a Redis
    # that earlier runs used.
    running = await start_coordinator(CoordinatorConfig(
        listen="127.0.0.1:0", redis=redis_url, store_namespace=f"bench-{uuid.uuid4().hex}",
        **{**KNOBS, **overrides},
    ))
    target = f"127.0.0.1:{running.port}"
    agents = [AckingWorker(target, f"w{i:03d}", apply_s) for i in range(workers)]
    await asyncio.gather(*(a.start() for a in agents))
    return running, agents


async def _close(running: RunningCoordinator, agents: list[AckingWorker]) -> None:
    await asyncio.gather(*(a.close() for a in agents))
    await running.stop(grace=0.2)


def _ms(seconds: list[float]) -> tuple[float, float]:
    """(p50, max) in milliseconds."""
    return statistics.median(seconds) * 1000, max(seconds) * 1000


async def _barrier(workers: int, updates: int, redis_url: str | None) -> dict[str, float]:
    running, agents = await _fleet(workers, APPLY_S, redis_url)
    target = f"127.0.0.1:{running.port}"
    costs, rpcs = [], []
    try:
        async with AsyncCoordinatorClient(target) as trainer:
            for _ in range(updates):  # the baseline, on a quiet fleet
                started = time.perf_counter()
                version = (await trainer.policy()).version
                rpcs.append(time.perf_counter() - started)
            for _ in range(updates):
                await trainer.begin_policy_update(version, mode="sync")
                state = await trainer.commit_policy_update(version + 1, timeout=30)
                returned = time.perf_counter()
                version += 1
                if state.version != version or len(state.acked_workers) != workers:
                    raise RuntimeError(f"update to {version} did not pass the barrier: {state}")
                costs.append(returned - max(a.applied_at[version] for a in agents))
    finally:
        await _close(running, agents)
    p50, worst = _ms(costs)
    # A commit that returned before the last APPLIED ack was written did not wait for the
    # barrier: weights and generation could have overlapped.
    early = sum(cost < 0 for cost in costs)
    return {"barrier_ms_p50": p50, "barrier_ms_max": worst, "rpc_ms_p50": _ms(rpcs)[0],
            "commits_before_last_apply": early}


def bench_barrier(
    sizes: tuple[int, ...] = (1, 8, 64), updates: int = 15, redis_url: str | None = None
) -> dict[str, float]:
    """Barrier cost per fleet size: ``barrier_ms_p50.w<N>``, ``barrier_ms_max.w<N>`` and the
    same run's ``rpc_ms_p50.w<N>`` (one GetPolicy round trip)."""
    configure_logging("error")  # the coordinator runs in this process: keep it quiet
    out: dict[str, float] = {}
    for workers in sizes:
        for key, value in asyncio.run(_barrier(workers, updates, redis_url)).items():
            out[f"{key}.w{workers}"] = value
    return out


Answer = tuple[str, int, float]
"""A route's (worker id, policy version, ``perf_counter`` time the answer arrived)."""


async def _routes_for(client: AsyncCoordinatorClient, prompts: list[list[int]],
                      seconds: float, answers: list[Answer] | None = None) -> float:
    """Routes/s from ROUTE_CALLERS concurrent callers over ``seconds``; each answer appended
    to ``answers`` when given."""
    deadline = time.perf_counter() + seconds
    counts = [0] * ROUTE_CALLERS

    async def caller(lane: int) -> None:
        i = lane
        while time.perf_counter() < deadline:
            route = await client.route(prompts[i % len(prompts)])
            if answers is not None:
                answers.append((route.worker_id, route.policy_version, time.perf_counter()))
            counts[lane] += 1
            i += ROUTE_CALLERS

    started = time.perf_counter()
    await asyncio.gather(*(caller(lane) for lane in range(ROUTE_CALLERS)))
    return sum(counts) / (time.perf_counter() - started)


def _stale(answers: list[Answer], agents: list[AckingWorker], version: int) -> int:
    """Answers during the update from ``version`` that no worker could serve: a version other
    than ``version`` or the next, or the next from a worker that had not yet applied it."""
    applied = {a.worker_id: a.applied_at for a in agents}
    return sum(served not in (version, version + 1)
               or (served == version + 1 and applied[worker].get(served, float("inf")) > at)
               for worker, served, at in answers)


async def _async_update(client: AsyncCoordinatorClient, agents: list[AckingWorker],
                        measure: float, prompts: list[list[int]]) -> tuple[float, int]:
    """One async update from the current version: routes/s measured while it rolls, and the
    stale answers among them (``_stale``)."""
    version = (await client.policy()).version
    await client.begin_policy_update(version, mode="async")
    answers: list[Answer] = []
    during = await _routes_for(client, prompts, measure, answers)
    moved = sum(1 for a in agents if version + 1 in a.applied_at)
    state = await client.commit_policy_update(version + 1, timeout=30)
    if state.version != version + 1 or state.fenced_workers:
        raise RuntimeError(f"async update did not commit cleanly: {state}")
    if not 0 < moved < len(agents):
        raise RuntimeError(f"{moved} of {len(agents)} workers moved while measuring: the "
                           "update did not span the measure")
    return during, _stale(answers, agents, version)


async def _routes(workers: int, seconds: float, max_staleness: int) -> dict[str, float]:
    # Async rolls one worker at a time: each takes apply_s, so the update spans the measure.
    running, agents = await _fleet(workers, 1.5 * seconds / workers, None,
                                   max_staleness=max_staleness)
    rng = random.Random(3)
    prompts = [[rng.randrange(32_000) for _ in range(PROMPT_TOKENS)] for _ in range(64)]
    try:
        async with AsyncCoordinatorClient(f"127.0.0.1:{running.port}") as client:
            # A first update (routes warm channels and caches meanwhile): the baseline is then
            # the steady state between updates, with max_staleness old versions servable.
            _, stale_warm = await _async_update(client, agents, seconds / 4, prompts)
            idle = await _routes_for(client, prompts, seconds)
            during, stale = await _async_update(client, agents, seconds, prompts)
    finally:
        await _close(running, agents)
    return {"routes_per_s.no_update": idle, "routes_per_s.async_update": during,
            "speedup.routes_async_update_vs_none": during / idle,
            "stale_routes": stale_warm + stale}


def bench_routes_during_async(
    workers: int = 8, seconds: float = 2.0, stalenesses: tuple[int, ...] = (0, 1)
) -> dict[str, float]:
    """Routes/s with no update vs during an async update (same run, same callers), per
    ``max_staleness``: keys ``<measure>.s<staleness>``."""
    configure_logging("error")
    out: dict[str, float] = {}
    for staleness in stalenesses:
        for key, value in asyncio.run(_routes(workers, seconds, staleness)).items():
            out[f"{key}.s{staleness}"] = value
    return out
