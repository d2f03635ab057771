"""``kvcoord bench fleet``'s shared-routing case (issue 17 §4): do two replicas route as one?

Two ``kvcoord coordinator`` processes on a redis-server, with ``share_routes`` on and (the
baseline, same run) off, and scripted workers streaming to the first replica (the second knows
them through its events). Three measures, each beside one replica's:

- ``siblings``: groups of 16 siblings of a fresh prompt sent alternately to the two replicas
  one every 20 ms; a group is "placed as one replica" when each sibling's worker held as many
  of the group before it as one replica's placement gives (all on the first sibling's worker:
  its pages are pending there, and ``kv_aware`` charges a move the copy it would make).
- ``pairs``: two siblings sent at the same instant, one to each replica: how many land on the
  same worker and how many apart (one replica, sent the pair at once, is the reference).
- ``burst``: a concurrent burst of distinct fresh prompts from both replicas onto a fleet whose
  heartbeats say two workers are idle and the rest busy; the load-imbalance ratio afterwards
  (max over mean of heartbeat-queued plus routed tokens per worker) against one replica taking
  the same burst, the herding that replicas routing blind cause.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from typing import Any

from bench.scripted_worker import ScriptedWorker
from coordinator.client import AsyncCoordinatorClient
from coordinator.core.hashing import DEV_HASH_KEY, HashConfig
from kvcoord.child_process import stop_processes
from kvcoord.fleet_procs import free_port, start_coordinator_process, wait_healthy
from tests.redis_server import RedisServer

WORKERS = 8
SIBLINGS = 16
GAP_S = 0.020
PROMPT_TOKENS = 1024
BUSY_QUEUED_TOKENS = 8192  # heartbeat load of the busy workers (all but two)
IDLE_WORKERS = 2


@contextmanager
def _two_replicas(share_routes: bool) -> Iterator[list[str]]:
    redis = RedisServer()
    redis.start()
    processes = []
    try:
        targets = []
        env = {"KVCOORD_SHARE_ROUTES": "true" if share_routes else "false",
               "KVCOORD_LEASE_MS": "20000", "KVCOORD_PENDING_TTL_MS": "5000"}
        for i in range(2):
            port = free_port()
            process = start_coordinator_process(port, "--redis", redis.url, "--replica-id",
                                                f"r{i}", env=env)
            processes.append(process)
            wait_healthy(f"127.0.0.1:{port}", process, timeout=60)
            targets.append(f"127.0.0.1:{port}")
        yield targets
    finally:
        stop_processes(processes, 10)
        redis.stop()


async def _beat(workers: list[ScriptedWorker], busy: bool) -> None:
    for i, worker in enumerate(workers):
        queued = BUSY_QUEUED_TOKENS if busy and i >= IDLE_WORKERS else 0
        await worker.heartbeat(queued_tokens=queued)


@asynccontextmanager
async def _fleet(targets: list[str], hash_config: HashConfig, busy: bool
                 ) -> AsyncIterator[list[ScriptedWorker]]:
    """Fresh workers on the first replica, heartbeating ``busy`` loads, known to both."""
    async with AsyncExitStack() as stack:
        workers = [ScriptedWorker(targets[0], f"w{i}", hash_config=hash_config)
                   for i in range(WORKERS)]
        for worker in workers:
            await worker.start()
            stack.push_async_callback(worker.close)
        await _beat(workers, busy)

        async def beat_forever() -> None:
            while True:
                await asyncio.sleep(1.0)
                await _beat(workers, busy)

        beating = asyncio.create_task(beat_forever())
        stack.callback(beating.cancel)
        for target in targets:
            async with AsyncCoordinatorClient(target) as client:
                for _ in range(500):
                    infos = await client.workers()
                    loads = sorted(w.queued_tokens for w in infos if w.state == "ready")
                    if len(loads) == WORKERS and (not busy or loads[-1] == BUSY_QUEUED_TOKENS):
                        break
                    await asyncio.sleep(0.01)
                else:
                    raise RuntimeError(f"replica {target} never saw the fleet's heartbeats")
        yield workers


def _prompt(case: int, n: int) -> list[int]:
    return [case * 10_000_000 + n * 10_000 + i for i in range(PROMPT_TOKENS)]


def placement_ranks(chosen: list[str]) -> list[int]:
    """How a group was placed, whoever the workers: for each sibling, how many of the group
    its worker already had. One replica (equal, idle workers) keeps a fresh prompt's siblings on
    the first one's worker: [0, 1, ..., 15]."""
    seen: Counter[str] = Counter()
    ranks = []
    for worker_id in chosen:
        ranks.append(seen[worker_id])
        seen[worker_id] += 1
    return ranks


async def _siblings(clients: list[AsyncCoordinatorClient], tokens: list[int]) -> list[int]:
    chosen = []
    for i in range(SIBLINGS):
        chosen.append((await clients[i % len(clients)].route(tokens)).worker_id)
        await asyncio.sleep(GAP_S)
    return placement_ranks(chosen)


async def _measure(targets: list[str], hash_config: HashConfig, groups: int, pairs: int,
                   burst: int, case: int) -> dict[str, Any]:
    """The three measures through ``targets`` (one replica: the first, twice)."""
    out: dict[str, Any] = {}
    clients = [AsyncCoordinatorClient(t) for t in targets]
    try:
        async with _fleet(targets, hash_config, busy=False):
            one_replica = list(range(SIBLINGS))
            placed = [await _siblings(clients, _prompt(case, g)) for g in range(groups)]
            out["siblings_groups"] = groups
            out["siblings_placed_as_one_replica"] = sum(p == one_replica for p in placed)
        async with _fleet(targets, hash_config, busy=False):
            together = 0
            for n in range(pairs):
                tokens = _prompt(case + 1, n)
                a, b = await asyncio.gather(clients[0].route(tokens), clients[1].route(tokens))
                together += a.worker_id == b.worker_id
            out["pairs"] = pairs
            out["pairs_together"] = together
            out["pairs_apart"] = pairs - together
        async with _fleet(targets, hash_config, busy=True):
            routed: Counter[str] = Counter()
            # Eight callers, four per replica, each every 8th prompt: both replicas route at
            # once.
            await asyncio.gather(*[_burst_caller(clients[j % 2], _prompt(case + 2, 0)[0], j,
                                                 burst, routed) for j in range(8)])
            queued = {f"w{i}": (BUSY_QUEUED_TOKENS if i >= IDLE_WORKERS else 0)
                      for i in range(WORKERS)}
            loads = [queued[w] + routed[w] * PROMPT_TOKENS for w in queued]
            out["burst_routes"] = sum(routed.values())
            out["burst_routes_by_worker"] = dict(sorted(routed.items()))
            out["burst_imbalance"] = max(loads) / (sum(loads) / len(loads))
    finally:
        for client in clients:
            await client.close()
    return out


async def _burst_caller(client: AsyncCoordinatorClient, base: int, caller: int, burst: int,
                        routed: Counter[str]) -> None:
    """Caller ``caller`` of 8 sends every 8th prompt of the burst through ``client``."""
    for n in range(caller, burst, 8):
        tokens = [base + n * 10_000 + i for i in range(PROMPT_TOKENS)]
        routed[(await client.route(tokens)).worker_id] += 1


def shared_routes_case(groups: int = 10, pairs: int = 50, burst: int = 256) -> dict[str, Any]:
    """Share on, share off (two replicas each), and one replica: the three measures."""
    hash_config = HashConfig(key=DEV_HASH_KEY)
    result: dict[str, Any] = {}
    for share in (True, False):
        with _two_replicas(share) as targets:
            label = "2r_shared" if share else "2r_not_shared"
            result[label] = asyncio.run(_measure(targets, hash_config, groups, pairs, burst,
                                                 case=10))
            if share:
                # The reference: the same measures through one replica (the first, twice).
                result["1r"] = asyncio.run(_measure([targets[0], targets[0]], hash_config,
                                                    groups, pairs, burst, case=20))
    result["burst_imbalance_vs_1r"] = {
        k: result[k]["burst_imbalance"] / result["1r"]["burst_imbalance"]
        for k in ("2r_shared", "2r_not_shared")}
    return result
