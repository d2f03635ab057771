"""The hash namespace a gateway request names, routed where the bridge keyed the engine's
blocks: ``kvcoord gateway --adapter NAME`` routes a request whose ``model`` names a LoRA adapter
in that adapter's namespace (vLLM 0.32 publishes the name in ``lora_name`` and in every block's
``extra_keys``), and a request's ``cache_salt`` binds its keys as the engine binds its first
block (the salt is that block's extra key).

A real coordinator, a real reference worker (``w0``) and a real bridge (external worker
``engine``) whose engine publishes LoRA blocks of one prompt (``tests/engine_publisher.py``).
The bridge registers the reference worker's OpenAI endpoint as its engine's, so either route
is answered (the reference worker serves no adapter, so an adapter's request is answered 404
by it); ``x-kvcoord-worker`` says which worker the gateway chose."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from coordinator.client import AsyncCoordinatorClient
from kvcoord import child_process
from kvcoord.gateway.config import ConfigError, GatewayConfig
from tests.coordinator_fixtures import eventually, running_coordinator, target
from tests.engine_publisher import Encoding, EnginePublisher, Stored
from tests.test_gateway import running_gateway
from worker.bridge.bridge import Bridge, BridgeConfig
from worker.config import WorkerConfig
from worker.main import start_worker

PAGE = 16
PROMPT = list(range(1000, 1064))  # 4 pages
SALTED = list(range(2000, 2064))
ROUTES = 8  # a cache-blind choice between two workers lands all 8 on one with p = 2/256


@pytest.fixture
async def fleet() -> AsyncIterator[tuple[str, int]]:
    """(coordinator target, gateway port): the engine behind the bridge holds PROMPT under the
    adapter ``sql`` and SALTED under the salt ``tenant-a``, the reference worker nothing."""
    engine = EnginePublisher(encoding=Encoding.VLLM_MAP)
    try:
        async with running_coordinator(page_size=PAGE) as coord:
            worker = await start_worker(WorkerConfig(
                coordinator=target(coord), listen="127.0.0.1:0", pages=256, page_size=PAGE,
                device="cpu", worker_id="w0", http_listen="127.0.0.1:0"))
            bridge = Bridge(BridgeConfig(
                events=engine.events, coordinator=target(coord), worker_id="engine",
                worker_address="127.0.0.1:9", page_size=PAGE,
                engine_url=f"http://127.0.0.1:{worker.http_port}"))
            try:
                await bridge.start()
                await engine.wait_subscribed()
                engine.publish(Stored([1, 2, 3, 4], None, PROMPT, PAGE, lora_id=1,
                                      lora_name="sql", extra={"extra_keys": [["sql"]] * 4}),
                               Stored([5, 6, 7, 8], None, SALTED, PAGE, extra={
                                   "extra_keys": [["tenant-a"], None, None, None]}))
                async with AsyncCoordinatorClient(target(coord)) as client:
                    async def indexed() -> bool:
                        lora = await client.lookup(PROMPT, adapter="sql")
                        salted = await client.lookup(SALTED, cache_salt="tenant-a")
                        return lora.matches.get("engine") == salted.matches.get("engine") == 64
                    await eventually(indexed)
                    assert (await client.lookup(PROMPT)).matches == {}  # not the base model's
                    assert (await client.lookup(SALTED)).matches == {}  # nor the unsalted
                    assert (await client.lookup(SALTED, cache_salt="b")).matches == {}
                async with running_gateway(target(coord), adapters=("sql", "chat")) as gateway:
                    yield target(coord), gateway.port
            finally:
                await bridge.stop()
                await worker.stop(0.5)
    finally:
        engine.close()


async def _chosen(port: int, model: str, prompt: list[int] = PROMPT,
                  **fields: Any) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": model, "prompt": prompt, "max_tokens": 1, **fields}) as answer:
        await answer.read()
        return answer.status, answer.headers.get("x-kvcoord-worker", "")


async def test_a_request_naming_an_adapter_lands_where_that_adapter_holds_its_prefix(
    fleet: tuple[str, int],
) -> None:
    _, port = fleet
    chosen = [await _chosen(port, "sql") for _ in range(ROUTES)]
    assert chosen == [(404, "engine")] * ROUTES  # 404: the reference worker serves no LoRA


async def test_another_adapter_and_the_base_model_are_not_credited_the_adapters_prefix(
    fleet: tuple[str, int],
) -> None:
    coordinator, port = fleet
    async with AsyncCoordinatorClient(coordinator) as client:
        assert (await client.lookup(PROMPT, adapter="chat")).matches == {}
        # Routing them runs: each forwarded to whichever worker the load picks (and answered
        # by it: 400 for the base model, whose vocabulary these ids are outside; 404 for chat).
        for model, status in (("chat", 404), ("default", 400)):
            assert (await _chosen(port, model))[0] == status


async def test_a_salted_request_lands_where_its_salt_made_the_prefix(
    fleet: tuple[str, int],
) -> None:
    _, port = fleet
    chosen = [(await _chosen(port, "default", SALTED, cache_salt="tenant-a"))[1]
              for _ in range(ROUTES)]
    assert chosen == ["engine"] * ROUTES
    for bad in ("", 7):
        status, worker = await _chosen(port, "default", SALTED, cache_salt=bad)
        assert (status, worker) == (400, "")  # refused by the gateway, as vLLM refuses it


async def test_models_lists_each_adapter_under_its_base_and_an_unknown_model_is_404(
    fleet: tuple[str, int],
) -> None:
    _, port = fleet
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/v1/models") as answer:
            models = (await answer.json())["data"]
        async with session.post(f"http://127.0.0.1:{port}/v1/completions",
                                json={"model": "nope", "prompt": PROMPT}) as refused:
            error: dict[str, Any] = json.loads(await refused.read())["error"]
    assert [(m["id"], m.get("parent")) for m in models] == [
        ("default", None), ("sql", "default"), ("chat", "default")]
    assert (refused.status, error["code"]) == (404, "model_not_found")


@pytest.mark.parametrize(("adapters", "why"), [
    (("",), "not an adapter name"),
    (("default",), "not an adapter name"),  # the base model's own name
    (("sql\x00",), "not an adapter name"),
    (("sql", "sql"), "given twice"),
])
def test_bad_adapter_names_are_refused_at_start(adapters: tuple[str, ...], why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        GatewayConfig(adapters=adapters)


def test_adapters_come_from_a_comma_separated_variable_and_the_flag_wins() -> None:
    env = {"KVCOORD_ADAPTERS": "sql, chat"}
    assert GatewayConfig.from_sources({}, env).adapters == ("sql", "chat")
    assert GatewayConfig.from_sources({"adapters": ("code",)}, env).adapters == ("code",)


async def test_the_cli_takes_adapter_repeated() -> None:
    proc = await child_process.start_async(
        [".venv/bin/kvcoord", "gateway", "--adapter", "", "--listen", "127.0.0.1:0"],
        stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    assert proc.returncode == 2 and b"not an adapter name" in err


async def test_a_chat_with_an_image_is_refused_never_routed_on_its_text_alone(
    fleet: tuple[str, int],
) -> None:
    # The engine keys an image's blocks on its identifier and placeholder tokens, which the
    # gateway cannot compute (docs/BRIDGE.md, Limits): routing the text would credit prefixes
    # the engine does not share, so the request is refused, not routed.
    _, port = fleet
    message = {"role": "user", "content": [
        {"type": "text", "text": "what is in this picture?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="},
         "uuid": "cat-1"}]}
    async with aiohttp.ClientSession() as session, session.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": "default", "messages": [message]}) as answer:
        body = json.loads(await answer.read())
    assert answer.status == 400 and "x-kvcoord-worker" not in answer.headers
    assert "only text parts are supported, got 'image_url'" in body["error"]["message"]
