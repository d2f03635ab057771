"""Tiers as schedulers and operators see them, through a real coordinator: Lookup's matched
tokens per tier (both SDK clients), ListWorkers' and ``kvcoord status``'s pages per tier, and
Register's host page count (issue 18)."""

from __future__ import annotations

import asyncio
import json
import sys

import grpc
import pytest

from bench.scripted_worker import ScriptedWorker
from coordinator.client import AsyncCoordinatorClient, CoordinatorClient
from coordinator.control.sessions.registration_checks import MAX_HOST_PAGES
from coordinator.v1 import coordinator_pb2 as pb
from kvcoord import child_process
from tests.coordinator_fixtures import DEV_HASH, running_coordinator, target

PAGE = 16
PROMPT = list(range(1000, 1000 + 6 * PAGE))


async def kvcoord(*args: str) -> tuple[int, str]:
    process = await child_process.start_async(
        [sys.executable, "-m", "kvcoord.cli", *args], stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode is not None
    return process.returncode, out.decode() + err.decode()


async def test_lookup_answers_matched_tokens_per_tier_in_both_clients() -> None:
    async with running_coordinator() as coord:
        spilled = ScriptedWorker(target(coord), "spilled", hash_config=DEV_HASH,
                                 total_pages=64, host_pages=256)
        plain = ScriptedWorker(target(coord), "plain", hash_config=DEV_HASH)
        await spilled.start()
        await plain.start()
        keys = spilled.keys(PROMPT)
        await spilled.store(keys)
        await plain.store(keys[:4])
        # Pages 3 and 4 move to host memory, page 5 to disk: Stored events for keys held move
        # them (one tier per worker and key).
        await spilled.store(keys[3:5], pb.TIER_CPU)
        await spilled.store(keys[5:], pb.TIER_DISK)

        expected_matches = {"spilled": 6 * PAGE, "plain": 4 * PAGE}
        expected_tiers = {
            "spilled": {"gpu": 3 * PAGE, "cpu": 2 * PAGE, "disk": PAGE},
            "plain": {"gpu": 4 * PAGE, "cpu": 0, "disk": 0},
        }
        async with AsyncCoordinatorClient(target(coord)) as client:
            result = await client.lookup(PROMPT)
        assert (result.matches, result.tiers) == (expected_matches, expected_tiers)

        def blocking_lookup() -> tuple[dict[str, int], dict[str, dict[str, int]]]:
            with CoordinatorClient(target(coord)) as client:
                answer = client.lookup(PROMPT)
                return answer.matches, answer.tiers

        assert await asyncio.to_thread(blocking_lookup) == (expected_matches, expected_tiers)
        for tiers in expected_tiers.values():
            assert sum(tiers.values()) in expected_matches.values()
        await spilled.close()
        await plain.close()


async def test_workers_and_status_show_pages_per_tier() -> None:
    async with running_coordinator() as coord:
        w = ScriptedWorker(target(coord), "w", hash_config=DEV_HASH, total_pages=64,
                           host_pages=256)
        await w.start()
        keys = w.keys(PROMPT)
        await w.store(keys)
        await w.store(keys[2:5], pb.TIER_CPU)
        await w.store(keys[5:], pb.TIER_DISK)
        async with AsyncCoordinatorClient(target(coord)) as client:
            [info] = await client.workers()
        assert (info.total_pages, info.host_pages, info.cached_pages) == (64, 256, 6)
        assert (info.cached_gpu_pages, info.cached_cpu_pages, info.cached_disk_pages) == (2, 3, 1)

        code, out = await kvcoord("status", "--coordinator", target(coord), "--json")
        assert code == 0, out
        [row] = json.loads(out)["workers"]
        assert {k: row[k] for k in ("total_pages", "host_pages", "cached_pages",
                                    "cached_gpu_pages", "cached_cpu_pages",
                                    "cached_disk_pages")} == {
            "total_pages": 64, "host_pages": 256, "cached_pages": 6, "cached_gpu_pages": 2,
            "cached_cpu_pages": 3, "cached_disk_pages": 1}

        code, out = await kvcoord("status", "--coordinator", target(coord))
        assert code == 0, out
        header, _, line = out.splitlines()[1:4]
        columns = [h.strip() for h in header.split("  ") if h.strip()]
        assert columns[5:8] == ["gpu pages", "host pages", "disk"]
        assert line.split()[5:8] == ["2/64", "3/256", "1"]
        await w.close()


async def test_host_pages_above_the_bound_are_refused_at_register() -> None:
    async with running_coordinator() as coord:
        w = ScriptedWorker(target(coord), "w", hash_config=DEV_HASH,
                           host_pages=MAX_HOST_PAGES + 1)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await w.register()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"host_pages must be 0..{MAX_HOST_PAGES}" in (err.value.details() or "")
        # At the bound it is accepted.
        ok = ScriptedWorker(target(coord), "ok", hash_config=DEV_HASH, host_pages=MAX_HOST_PAGES)
        assert (await ok.register()).incarnation >= 1
        await ok.close()
        await w.close()
