"""The bridge on block events made by vLLM's own code (``vllm_block_events.py``: real
``Request``s, a real ``BlockPool`` with events on, vLLM's group-kind annotation, its
``ZmqEventPublisher``), against a real coordinator:

- a LoRA request's blocks are found under its adapter, never under the base model;
- a salted request's under its salt, never without it;
- an image request shares only the text before its image with a text prompt, and the same
  placeholder tokens with another image share nothing past it;
- in a hybrid model, a sliding-window group's eviction leaves what full attention holds, and
  full attention's eviction removes it.

Run by ``make test-vllm`` (the driver needs vLLM's interpreter)."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.client import AsyncCoordinatorClient
from coordinator.core.hashing import DEV_HASH_KEY, HashConfig, Namespace, PageHasher
from coordinator.server.main import RunningCoordinator
from kvcoord import child_process
from tests.coordinator_fixtures import eventually, running_coordinator, target
from tests_vllm.test_vllm_engine import vllm_interpreter
from worker.bridge.bridge import Bridge, BridgeConfig

BLOCK = 4  # vLLM's block here, and our page
WORKER = "vllm-events"
TEXT = list(range(100, 112))  # 3 blocks
DRIVER = Path(__file__).with_name("vllm_block_events.py")
STEP_S = 60.0  # the first step imports vLLM and torch


class Driver:
    """vLLM's side: one step a line in, ``{"done": n}`` out."""

    def __init__(self, endpoint: str) -> None:
        self.process = child_process.start(
            [str(vllm_interpreter()), str(DRIVER), endpoint, str(BLOCK)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True)

    async def _line(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(self.process.stdout.readline), STEP_S)
        if not line:
            raise AssertionError(f"the vLLM driver exited ({self.process.wait()})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    async def step(self, **step: Any) -> int:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(step) + "\n")
        self.process.stdin.flush()
        done: int = (await self._line())["done"]
        return done

    def close(self) -> None:
        if self.process.poll() is None and self.process.stdin is not None:
            self.process.stdin.write('{"exit": true}\n')
            self.process.stdin.close()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[tuple[RunningCoordinator, Bridge, Driver]]:
    endpoint = f"ipc://{tmp_path}/kv-events"
    driver = Driver(endpoint)
    try:
        assert (await driver._line()) == {"bound": True}
        async with running_coordinator(page_size=BLOCK) as coord:
            bridge = Bridge(BridgeConfig(events=endpoint, coordinator=target(coord),
                                         worker_id=WORKER, worker_address="127.0.0.1:9",
                                         page_size=BLOCK))
            await bridge.start()
            try:
                # ZMQ's slow joiner: publish a probe until the bridge follows the stream.
                for attempt in range(40):
                    await driver.step(cache={"id": f"probe-{attempt}", "tokens": [7] * BLOCK},
                                      group=0)
                    if bridge.last_seq >= 0:
                        break
                    await asyncio.sleep(0.25)
                assert bridge.last_seq >= 0, "the bridge never saw vLLM's publisher"
                yield coord, bridge, driver
            finally:
                await bridge.stop()
    finally:
        driver.close()


async def _matched(coord: RunningCoordinator, tokens: list[int], **scope: Any) -> int:
    async with AsyncCoordinatorClient(target(coord)) as client:
        return (await client.lookup(tokens, **scope)).matches.get(WORKER, 0)


async def _shows(coord: RunningCoordinator, tokens: list[int], expected: int,
                 **scope: Any) -> None:
    async def right() -> bool:
        return await _matched(coord, tokens, **scope) == expected
    await eventually(right)


async def test_lora_salt_and_image_blocks_from_vllm_are_keyed_as_the_engine_keys_them(
    fleet: tuple[RunningCoordinator, Bridge, Driver],
) -> None:
    coord, bridge, driver = fleet
    await driver.step(cache={"id": "lora", "tokens": TEXT, "lora": "sql"}, group=0)
    await _shows(coord, TEXT, len(TEXT), adapter="sql")
    await driver.step(cache={"id": "salted", "tokens": TEXT, "salt": "tenant-a"}, group=0)
    await _shows(coord, TEXT, len(TEXT), cache_salt="tenant-a")
    assert await _matched(coord, TEXT) == 0  # neither is the base model's, unsalted
    assert await _matched(coord, TEXT, cache_salt="tenant-b") == 0
    assert await _matched(coord, TEXT, adapter="chat") == 0

    # An image at tokens 5..7 (block 1): block 0 is the text before it, plain.
    before = len(coord.service.index.worker_keys(WORKER))
    await driver.step(cache={"id": "cat", "tokens": TEXT, "images": [["cat", 5, 3]]}, group=0)
    await _shows(coord, TEXT, BLOCK)  # only the text before the image: never its text alone
    cat = coord.service.index.worker_keys(WORKER)
    assert len(cat) == before + 3
    await driver.step(cache={"id": "dog", "tokens": TEXT, "images": [["dog", 5, 3]]}, group=0)

    async def dog_indexed() -> bool:  # the same tokens, another image: blocks 1, 2 are new
        return len(coord.service.index.worker_keys(WORKER)) == len(cat) + 2
    await eventually(dog_indexed)
    dog = coord.service.index.worker_keys(WORKER)
    hasher = PageHasher(HashConfig(key=DEV_HASH_KEY, page_size=BLOCK))
    plain = hasher.page_keys(TEXT, Namespace(page_size=BLOCK))
    assert plain[0] in dog and not set(plain[1:]) & dog
    assert {k: v for k, v in bridge.malformed.items() if k != "unknown_block"} == {}


async def test_a_sliding_window_eviction_from_vllm_leaves_what_full_attention_holds(
    fleet: tuple[RunningCoordinator, Bridge, Driver],
) -> None:
    coord, bridge, driver = fleet
    prompt = list(range(300, 308))
    # One request, two KV-cache groups (a hybrid model): the same block hashes in each.
    assert await driver.step(cache={"id": "r", "tokens": prompt}, group=0) == 1
    assert await driver.step(cache={"id": "r", "tokens": prompt}, group=1,
                             kind="sliding_window") == 1
    await _shows(coord, prompt, len(prompt))
    # The window's blocks are evicted by vLLM's pool: full attention still holds them.
    await driver.step(free="r", group=1)
    assert await driver.step(evict=True) >= 2  # BlockRemoved for group 1's two blocks
    await driver.step(cache={"id": "after", "tokens": [9] * BLOCK}, group=0)  # a marker
    await _shows(coord, [9] * BLOCK, BLOCK)
    assert await _matched(coord, prompt) == len(prompt)
    assert bridge.malformed.get("group_not_servable") == 1  # the window's store, not held
    assert bridge.blocks.group_kinds == {0: "full_attention", 1: "sliding_window"}
    # Then full attention's: the prefix is gone.
    await driver.step(free="r", group=0)
    await driver.step(evict=True)
    await _shows(coord, prompt, 0)
