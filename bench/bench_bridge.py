"""The vLLM/SGLang bridge's throughput: engine blocks per second from the engine's ZMQ frames to
the coordinator's index, against the same pages hashed and sent by a worker on its own Sync
stream (the path a reference worker takes, one acked batch per prompt), measured in the same
run; publisher, bridge and coordinator share this process; and the bridge's own work per block
(decode + chain hashing) without any network. ``wrong_keys`` (must be 0): pages missing from,
or extra in, what the bridge mapped (and what the index holds for its engine) against our own
keys of the same tokens.

Run: ``kvcoord bench bridge``; it prints the table and writes bench/results/bridge.json.
"""

from __future__ import annotations

import asyncio
import struct
import time
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from bench.scripted_worker import ScriptedWorker
from coordinator.config import CoordinatorConfig
from coordinator.core.hashing import DEV_HASH_KEY, HashConfig, Namespace, PageHasher
from coordinator.server.main import start_coordinator
from worker.bridge.block_map import BlockMap
from worker.bridge.bridge import Bridge, BridgeConfig
from worker.bridge.engine_events import BlockStored, decode_payload

PAGE = 16
BLOCKS_PER_BATCH = 32
HASH = HashConfig(key=DEV_HASH_KEY, page_size=PAGE)


END_TO_END_DEADLINE_S = 60.0
"""How long the index may take to hold every bridged block before the run counts them lost."""


def _prompt(b: int) -> list[int]:
    return [(b * 7919 + i) % 50_000 for i in range(BLOCKS_PER_BATCH * PAGE)]


def _expected_keys(n_batches: int) -> set[bytes]:
    """Our page keys of every batch's tokens: what the bridge must map the engine's blocks to."""
    hasher = PageHasher(HASH)
    return {k for b in range(n_batches)
            for k in hasher.page_keys(_prompt(b), Namespace(page_size=PAGE))}


def _batches(n_batches: int) -> list[bytes]:
    """Payloads of chained BlockStored events (current vLLM map encoding), one prompt each."""
    payloads = []
    for b in range(n_batches):
        tokens = _prompt(b)
        events, parent = [], None
        for i in range(BLOCKS_PER_BATCH):
            block_hash = b * 1_000 + i
            block_tokens = tokens[i * PAGE:(i + 1) * PAGE]
            events.append({"type": "BlockStored", "block_hashes": [block_hash],
                           "parent_block_hash": parent, "token_ids": block_tokens,
                           "block_size": PAGE, "medium": "GPU"})
            parent = block_hash
        payloads.append(msgspec.msgpack.encode([time.time(), events, 0]))
    return payloads


def bench_decode_and_map(n_batches: int = 300) -> dict[str, float]:
    payloads = _batches(n_batches)
    blocks = BlockMap(PageHasher(HASH), model="default", policy_version=0, page_size=PAGE)
    started = time.perf_counter()
    for payload in payloads:
        for event in decode_payload(payload).events:
            assert isinstance(event, BlockStored)
            blocks.stored(event)
    elapsed = time.perf_counter() - started
    n = n_batches * BLOCKS_PER_BATCH
    mapped = {k for keys in blocks.inventory().values() for k in keys}
    return {"blocks_per_s": n / elapsed, "us_per_block": elapsed / n * 1e6,
            "wrong_keys": len(mapped ^ _expected_keys(n_batches))}


async def _end_to_end(n_batches: int) -> dict[str, float]:
    coordinator = await start_coordinator(CoordinatorConfig(
        listen="127.0.0.1:0", page_size=PAGE, log_level="warning"))
    target = f"127.0.0.1:{coordinator.port}"
    payloads = _batches(n_batches)
    total = n_batches * BLOCKS_PER_BATCH
    index = coordinator.service.index
    try:
        # Baseline: the same pages from a worker's own Sync stream, one batch per prompt.
        worker = ScriptedWorker(target, "direct", hash_config=HASH)
        await worker.start()
        hasher = PageHasher(HASH)
        prompts = [_prompt(b) for b in range(n_batches)]
        started = time.perf_counter()
        for prompt in prompts:  # a worker hashes its pages too (its prefix cache does)
            await worker.store(hasher.page_keys(prompt, Namespace(page_size=PAGE)))
        direct = total / (time.perf_counter() - started)
        await worker.close()
        # The bridge: frames on a PUB socket, until the index holds every page.
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        bridge = Bridge(BridgeConfig(events=f"tcp://127.0.0.1:{port}", coordinator=target,
                                     worker_id="engine", worker_address="10.0.0.1:8000",
                                     page_size=PAGE))
        await bridge.start()
        await asyncio.sleep(0.3)  # the SUB connects (a slow joiner would miss the first frames)
        started = time.perf_counter()
        for seq, payload in enumerate(payloads):
            await pub.send_multipart([b"kv-events", struct.pack(">q", seq), payload])
        deadline = started + END_TO_END_DEADLINE_S
        while len(index.worker_keys("engine")) < total and time.perf_counter() < deadline:
            await asyncio.sleep(0.001)
        bridged = total / (time.perf_counter() - started)
        held = index.worker_keys("engine")  # before the bridge stops: it deregisters
        await bridge.stop()
        pub.close(linger=0)
        ctx.term()
        wrong = len(held ^ _expected_keys(n_batches))
        return {"blocks_per_s.bridge": bridged, "blocks_per_s.worker_sync": direct,
                "ratio.bridge_vs_worker": bridged / direct, "wrong_keys": wrong}
    finally:
        await coordinator.stop(grace=0.1)


def bench_end_to_end(n_batches: int = 300) -> dict[str, Any]:
    return asyncio.run(_end_to_end(n_batches))
