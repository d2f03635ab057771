"""Send a stream of requests through a router with the official ``openai`` client, each at its
arrival time, each streamed (``stream=True``, ``stream_options={"include_usage": True}``), and
measure what a client sees.

- **TTFT**: from sending the request to the first chunk carrying a choice. vLLM sends its
  first chunk (the assistant role) once the first token exists, so this is time to first token.
- **Latency**: from sending to the end of the stream.
- **Cached tokens**: the final usage chunk's ``prompt_tokens_details.cached_tokens``: what the
  engine that served the request found in its prefix cache.

A request that fails (an HTTP error, a stream without usage, a timeout) is kept as an error:
the bench's invariants fail the run on any.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

from openai import AsyncOpenAI, OpenAIError

from bench.engines_stream import StreamRequest

REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one request met. ``sent_s``: when it left, seconds after the stream began;
    ``worker``: the router's ``x-kvcoord-worker`` header when it names the engine. A failed
    request has ``error``, its ``latency_s`` (sending to the failure) and the HTTP ``status``
    where the router answered one."""

    index: int
    sent_s: float
    ttft_s: float | None = None
    latency_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    worker: str | None = None
    error: str | None = None
    status: int | None = None


async def _one(client: AsyncOpenAI, model: str, request: StreamRequest,
               began: float) -> Outcome:
    await asyncio.sleep(max(0.0, began + request.arrival_s - time.perf_counter()))
    sent = time.perf_counter()
    ttft: float | None = None
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model=model, messages=request.messages,  # type: ignore[arg-type]
            max_tokens=request.max_tokens, stream=True,
            stream_options={"include_usage": True})
        worker = raw.headers.get("x-kvcoord-worker")
        stream = raw.parse()
        usage = None
        async for chunk in stream:
            if ttft is None and chunk.choices:
                ttft = time.perf_counter() - sent
            if chunk.usage is not None:
                usage = chunk.usage
    except (OpenAIError, OSError) as exc:
        return Outcome(request.index, sent - began, ttft, time.perf_counter() - sent,
                       error=f"{type(exc).__name__}: {exc}",
                       status=getattr(exc, "status_code", None))
    latency = time.perf_counter() - sent
    if usage is None or usage.prompt_tokens_details is None or ttft is None:
        return Outcome(request.index, sent - began, ttft, latency, worker=worker,
                       error="the stream ended without a token or without usage details")
    return Outcome(request.index, sent - began, ttft, latency, usage.prompt_tokens,
                   usage.prompt_tokens_details.cached_tokens or 0, worker)


async def _replay(base_url: str, model: str, requests: Sequence[StreamRequest]) -> list[Outcome]:
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0,
                           timeout=REQUEST_TIMEOUT_S) as client:
        began = time.perf_counter()
        return list(await asyncio.gather(*(_one(client, model, r, began) for r in requests)))


def replay(base_url: str, model: str, requests: Sequence[StreamRequest]) -> list[Outcome]:
    """Every request of ``requests`` through ``base_url`` (an OpenAI ``/v1`` base), sent at
    its ``arrival_s`` after the first: their outcomes, in stream order."""
    return asyncio.run(_replay(base_url, model, requests))


async def _send_one(base_url: str, model: str, request: StreamRequest) -> Outcome:
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0,
                           timeout=REQUEST_TIMEOUT_S) as client:
        return await _one(client, model, request, time.perf_counter() - request.arrival_s)


def send_one(base_url: str, model: str, request: StreamRequest) -> Outcome:
    """One request, now (its arrival time ignored), streamed as in ``replay``."""
    return asyncio.run(_send_one(base_url, model, request))
