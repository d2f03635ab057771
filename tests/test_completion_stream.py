"""``kvcoord.completion_stream``, the client ``kvcoord up`` times requests with, against a real
worker's OpenAI endpoint: the streamed text is the worker's own greedy completion, the counts
are its ``usage``, the first event comes long before the end, and a refusal is an error that
leaves the streamer usable."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvcoord.completion_stream import CompletionStreamer, StreamError
from tests.coordinator_fixtures import running_coordinator, target
from worker.config import WorkerConfig
from worker.main import RunningWorker, start_worker
from worker.text.tokenizer import reference_tokenizer

PAGE = 16
PROMPT = [(7 * i) % 500 + 3 for i in range(72)]  # 4 full pages and 8 tokens


@pytest.fixture
async def worker() -> AsyncIterator[RunningWorker]:
    async with running_coordinator(page_size=PAGE) as coord:
        running = await start_worker(WorkerConfig(
            coordinator=target(coord), listen="127.0.0.1:0", pages=256, page_size=PAGE,
            device="cpu", worker_id="w0", http_listen="127.0.0.1:0"))
        try:
            await asyncio.wait_for(running.agent.synced.wait(), 10)
            yield running
        finally:
            await running.stop(0.5)


def url(worker: RunningWorker) -> str:
    return f"http://127.0.0.1:{worker.http_port}"


async def test_a_streamed_completion_is_the_workers_greedy_answer_with_its_usage(
    worker: RunningWorker,
) -> None:
    streamer = CompletionStreamer()
    try:
        first = await asyncio.to_thread(streamer.complete, url(worker), PROMPT, 6)
        again = await asyncio.to_thread(streamer.complete, url(worker), PROMPT, 6)
    finally:
        streamer.close()
    expected = await asyncio.to_thread(worker.runtime.generate, PROMPT, 6)
    assert first.text == again.text == reference_tokenizer().decode(expected.tokens)
    assert (first.prompt_tokens, first.cached_tokens, first.completion_tokens) == (72, 0, 6)
    assert (again.prompt_tokens, again.cached_tokens, again.completion_tokens) == (72, 64, 6)
    assert first.policy_version == again.policy_version == 0
    assert 0 < first.ttft_s <= first.total_s


async def test_the_first_event_arrives_long_before_a_long_answer_ends(
    worker: RunningWorker,
) -> None:
    streamer = CompletionStreamer()
    try:
        answer = await asyncio.to_thread(streamer.complete, url(worker), PROMPT, 300)
    finally:
        streamer.close()
    assert answer.completion_tokens == 300
    # 300 decode steps follow the first token; a stream read only at its end would fail this.
    assert answer.ttft_s < answer.total_s / 3


async def test_a_refusal_raises_with_the_status_and_the_streamer_stays_usable(
    worker: RunningWorker,
) -> None:
    wrong, right = CompletionStreamer(model="not-served"), CompletionStreamer()
    try:
        with pytest.raises(StreamError, match=r"HTTP 404.*not-served"):
            await asyncio.to_thread(wrong.complete, url(worker), PROMPT, 2)
        with pytest.raises(StreamError, match="only plain http"):
            await asyncio.to_thread(right.complete, "https://127.0.0.1:1", PROMPT, 2)
        answer = await asyncio.to_thread(right.complete, url(worker), PROMPT, 2)
    finally:
        wrong.close()
        right.close()
    assert answer.completion_tokens == 2
