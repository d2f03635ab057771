"""The scheduler of ``kvcoord bench fleet`` (bench/fleet_load.py starts it): ``Route`` calls
at a set rate, open loop, from a process of its own, so the latency it measures is the
coordinator's and not the load generator's busy event loop. Prints one JSON object:
``{"ms": [latency of each answered route], "errors": n}``.

Run: ``python -m bench.fleet_routes TARGET RATE SECONDS REQUESTS``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import grpc

from bench.fleet_load import ROUTE_TOKENS, TRACE
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from kvcoord.simulate.trace import load_trace, prompt_bytes


async def routes(target: str, rate: float, seconds: float, requests: int) -> dict[str, object]:
    prompts = [prompt_bytes(r)[: ROUTE_TOKENS * 4] for r in load_trace(TRACE, limit=requests)]
    latencies: list[float] = []
    errors = 0
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.CoordinatorStub(channel)

        async def one(prompt: bytes) -> None:
            nonlocal errors
            began = time.perf_counter()
            try:
                await stub.Route(pb.RouteRequest(prompt=pb.Prompt(token_bytes=prompt)),
                                 timeout=10)
            except grpc.aio.AioRpcError:
                errors += 1
                return
            latencies.append((time.perf_counter() - began) * 1000)

        calls: set[asyncio.Task[None]] = set()
        start = time.monotonic()
        i = 0
        while time.monotonic() - start < seconds:
            task = asyncio.create_task(one(prompts[i % len(prompts)]))
            calls.add(task)
            task.add_done_callback(calls.discard)
            i += 1
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
        if calls:
            await asyncio.wait(calls, timeout=12)
    return {"ms": latencies, "errors": errors}


def main() -> None:
    target, rate, seconds, requests = sys.argv[1:5]
    print(json.dumps(asyncio.run(routes(target, float(rate), float(seconds), int(requests)))))


if __name__ == "__main__":
    main()
