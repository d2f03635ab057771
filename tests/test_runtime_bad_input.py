"""Refused input, a pool too small for a request, and concurrent callers: the runtime answers
with domain errors, never leaks a page and never corrupts a buffer."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from coordinator.core.hashing import HashConfig
from worker.runtime import Generation, InvalidRequest, PoolExhausted
from worker.runtime.engine import ModelConfig
from worker.runtime.runtime import WorkerRuntime

KEY = bytes(range(32))
MODEL = ModelConfig(max_context=256)


def runtime(pages: int, page_size: int = 4, **kwargs: object) -> WorkerRuntime:
    return WorkerRuntime(
        model=MODEL,
        pages=pages,
        page_size=page_size,
        hash_config=HashConfig(KEY, page_size=page_size),
        **kwargs,  # type: ignore[arg-type]
    )


def assert_no_leak(rt: WorkerRuntime, free: int, cached: int) -> None:
    rt.check_integrity()  # allocator + prefix cache invariants, no page referenced while idle
    stats = rt.stats()
    assert (stats.free_pages, stats.cached_pages) == (free, cached)
    assert (stats.running_requests, stats.queued_tokens) == (0, 0)


def test_prompt_longer_than_the_pool_is_exhausted_and_leaks_nothing() -> None:
    rt = runtime(pages=8)  # 32 token slots
    with pytest.raises(PoolExhausted, match="the pool has 8"):
        rt.generate(list(range(40)), 1)
    assert_no_leak(rt, free=8, cached=0)


def test_exhaustion_after_a_prefix_hit_gives_the_hit_pages_back() -> None:
    rt = runtime(pages=8)
    prompt = list(range(13))
    rt.generate(prompt, 4)  # 16 positions with KV: 4 full pages recorded
    assert_no_leak(rt, free=4, cached=4)
    with pytest.raises(PoolExhausted):
        rt.generate([*prompt, *range(30)], 2)  # reuses 3 cached pages, needs 11 in all
    assert_no_leak(rt, free=4, cached=4)
    assert rt.generate(prompt, 4).cached_tokens == 12  # the cache survived the refusal


def test_decode_slots_count_against_the_pool() -> None:
    rt = runtime(pages=8)
    rt.generate(list(range(20)), 13)  # 20 + 12 fed-back tokens = 32 slots: fits exactly
    with pytest.raises(PoolExhausted):
        rt.generate(list(range(20)), 14)
    rt.check_integrity()


@pytest.mark.parametrize(
    ("prompt", "max_new_tokens", "message"),
    [
        ([], 1, "prompt is empty"),
        ([1, 2, MODEL.vocab_size], 1, f"token id {MODEL.vocab_size} at position 2"),
        ([1, -1], 1, "token id -1 at position 1"),
        ([1, 2], 0, "max_new_tokens must be 1..64, got 0"),
        ([1, 2], 65, "max_new_tokens must be 1..64, got 65"),
        ([1] * 200, 57, "exceeds the model context of 256"),
    ],
)
def test_bad_input_is_refused_before_anything_is_taken(
    prompt: list[int], max_new_tokens: int, message: str
) -> None:
    rt = runtime(pages=64, max_new_tokens_limit=64)
    with pytest.raises(InvalidRequest, match=message):
        rt.generate(prompt, max_new_tokens)
    assert_no_leak(rt, free=64, cached=0)


def test_invalid_request_is_a_value_error() -> None:
    # The client and server map ValueError-like refusals the same way (INVALID_ARGUMENT).
    assert issubclass(InvalidRequest, ValueError)


def test_concurrent_callers_on_a_small_pool_match_the_sequential_answers() -> None:
    rng = random.Random(0)
    shared = [rng.randrange(MODEL.vocab_size) for _ in range(10)]
    requests = []
    for i in range(24):
        tail = [rng.randrange(MODEL.vocab_size) for _ in range(rng.randrange(1, 30))]
        requests.append((shared + tail if i % 2 else tail, rng.randrange(1, 8)))
    requests.append(([1] * 60, 5))  # never fits 10 pages of 4

    def answer(rt: WorkerRuntime, prompt: list[int], n: int) -> Generation | str:
        try:
            return rt.generate(prompt, n)
        except PoolExhausted:
            return "exhausted"

    sequential = runtime(pages=10)
    expected = [answer(sequential, p, n) for p, n in requests]
    assert expected[-1] == "exhausted" and 1 < expected.count("exhausted") < 8

    rt = runtime(pages=10)
    start = threading.Barrier(8)

    def call(index: int) -> Generation | str:
        if index < 8:
            start.wait()  # the first eight arrive together and queue on the lock
        return answer(rt, *requests[index])

    with ThreadPoolExecutor(max_workers=8) as pool:
        got = list(pool.map(call, range(len(requests))))
    for want, have in zip(expected, got, strict=True):
        if want == "exhausted":
            assert have == "exhausted"
        else:
            assert isinstance(want, Generation) and isinstance(have, Generation)
            assert have.tokens == want.tokens  # cache hits may differ, answers may not
    rt.check_integrity()
    assert rt.stats().free_pages + rt.stats().cached_pages == 10
