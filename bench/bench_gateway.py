"""``kvcoord bench gateway``: what the gateway costs and what it buys.

``overhead``: the same small completion requests (one new token each), at the same concurrency,
sent to one reference worker's own OpenAI endpoint and through ``kvcoord gateway`` in front of
it: requests/s, latency p50/p99 of each, the latency the gateway adds, and the gateway
process's CPU per request (``/proc`` utime + stime of its pid over the run / requests).

``ttft``: a replay of the committed trace slice (``tests/data/mooncake_300.jsonl``) scaled to the
reference model (each 512-token trace block becomes one 16-token page, so prompts fit its
4,096-token context), streamed through the gateway at a fixed concurrency, on two fresh fleets
of real processes whose coordinators route ``kv_aware`` and ``round_robin``: time to first
token at the client (p50, p99), and the prompt tokens the engines report cached.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from coordinator.client import CoordinatorClient
from kvcoord.fleet_procs import LocalFleet
from kvcoord.simulate.trace import load_trace
from kvcoord.up_report import percentile

TRACE = Path(__file__).resolve().parent.parent / "tests" / "data" / "mooncake_300.jsonl"
PAGE = 16
MODEL = "default"
FIRST_ID, VOCAB = 3, 512  # ids 0-2 are the shipped tokenizer's special tokens


def page_tokens(hash_id: int) -> list[int]:
    """The 16 token ids a trace block becomes."""
    digest = hashlib.shake_128(b"kvcoord.bench.gateway:%d" % hash_id).digest(PAGE * 2)
    return [FIRST_ID + int.from_bytes(digest[2 * i:2 * i + 2], "little") % (VOCAB - FIRST_ID)
            for i in range(PAGE)]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _load(url: str, bodies: list[dict[str, Any]], concurrency: int,
                stream: bool = False) -> tuple[list[float], list[int], float]:
    """(latencies or TTFTs in ms, cached tokens per answer, wall seconds) for ``bodies``."""
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    latencies: list[float] = []
    cached: list[int] = []

    async def client(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            body = queue.get_nowait()
            started = time.perf_counter()
            async with session.post(f"{url}/v1/completions", json=body) as response:
                if response.status != 200:
                    raise RuntimeError(f"{response.status}: {await response.text()}")
                if not stream:
                    answer = await response.json()
                    latencies.append((time.perf_counter() - started) * 1000)
                    cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
                    continue
                first = True
                async for line in response.content:
                    if first and line.startswith(b"data: {"):
                        latencies.append((time.perf_counter() - started) * 1000)
                        first = False
                    if b'"usage"' in line and b'"choices":[]' in line:
                        usage = json.loads(line[5:])["usage"]
                        cached.append(usage["prompt_tokens_details"]["cached_tokens"])

    began = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return latencies, cached, time.perf_counter() - began


def _fleet(root: Path, name: str, workers: int, routing: str | None = None) -> LocalFleet:
    fleet = LocalFleet(workers, root / name, http=True, routing_policy=routing, pages=2048)
    fleet.log_dir.mkdir(parents=True)
    fleet.start()
    fleet.start_gateway()
    return fleet


def _http_url(fleet: LocalFleet, worker: str) -> str:
    with CoordinatorClient(fleet.coordinator_target) as client:
        return next(w.http_url for w in client.workers() if w.worker_id == worker)


def bench_gateway_overhead(requests: int, concurrency: int = 4) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvcoord-bench-gateway-") as tmp:
        fleet = _fleet(Path(tmp), "overhead", workers=1)
        try:
            direct_url = _http_url(fleet, "w0")
            gateway_pid = fleet.pids[-1]
            bodies = [{"model": MODEL, "prompt": [FIRST_ID + i % 400, 7, 8, 9],
                       "max_tokens": 1} for i in range(requests)]
            asyncio.run(_load(direct_url, bodies[:20], concurrency))  # warm both paths
            asyncio.run(_load(fleet.gateway_url, bodies[:20], concurrency))
            direct, _, direct_s = asyncio.run(_load(direct_url, bodies, concurrency))
            cpu0 = _cpu_seconds(gateway_pid)
            through, _, through_s = asyncio.run(_load(fleet.gateway_url, bodies, concurrency))
            cpu_us = (_cpu_seconds(gateway_pid) - cpu0) / requests * 1e6
        finally:
            fleet.stop()
    return {
        "requests": requests, "concurrency": concurrency,
        "direct.requests_per_s": requests / direct_s,
        "gateway.requests_per_s": requests / through_s,
        "direct.p50_ms": statistics.median(direct), "direct.p99_ms": percentile(direct, 99),
        "gateway.p50_ms": statistics.median(through),
        "gateway.p99_ms": percentile(through, 99),
        "added.p50_ms": statistics.median(through) - statistics.median(direct),
        "added.p99_ms": percentile(through, 99) - percentile(direct, 99),
        "gateway_cpu_us_per_request": cpu_us,
    }


def bench_gateway_ttft(requests: int, workers: int = 2, concurrency: int = 4) -> dict[str, Any]:
    trace = load_trace(TRACE, limit=requests)
    bodies = []
    for request in trace:
        prompt = [t for h in request.hash_ids for t in page_tokens(h)][:4096 - 8]
        bodies.append({"model": MODEL, "prompt": prompt, "stream": True,
                       "stream_options": {"include_usage": True},
                       "max_tokens": max(1, min(8, request.output_length))})
    results: dict[str, Any] = {"requests": len(bodies), "workers": workers,
                               "concurrency": concurrency}
    with tempfile.TemporaryDirectory(prefix="kvcoord-bench-gateway-") as tmp:
        for routing in ("round_robin", "kv_aware"):
            fleet = _fleet(Path(tmp), routing, workers, routing)
            try:
                ttft, cached, _ = asyncio.run(_load(fleet.gateway_url, bodies, concurrency,
                                                    stream=True))
            finally:
                fleet.stop()
            prompt_tokens = sum(len(b["prompt"]) for b in bodies)
            results[f"{routing}.ttft_p50_ms"] = statistics.median(ttft)
            results[f"{routing}.ttft_p99_ms"] = percentile(ttft, 99)
            results[f"{routing}.cached_token_ratio"] = sum(cached) / prompt_tokens
            results[f"{routing}.answered"] = min(len(ttft), len(cached))
    results["speedup.ttft_p50_kv_aware_vs_round_robin"] = (
        results["round_robin.ttft_p50_ms"] / results["kv_aware.ttft_p50_ms"])
    return results
