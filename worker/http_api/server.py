"""``OpenAIServer``: the worker's OpenAI-compatible endpoint (``--http-listen HOST:PORT``).

``GET /v1/models``, ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream`` true
or false, ``stream_options.include_usage``, ``n``, several prompts), on aiohttp. Prompts become
token ids through the worker's tokenizer (the shipped reference tokenizer by default, the ids
the gateway routes by), run through the same ``GenerationRunner`` as the gRPC ``Generate`` and
under the same credentials: a bearer token from the identities file, the ``Generate`` role
check, the rate bucket, the caller's tenant for the cache. The reference engine decodes greedily
for exactly ``max_tokens`` tokens (``finish_reason`` ``length``); ``usage`` carries
``prompt_tokens_details.cached_tokens``. Streams go out token by token; a client that goes away
cancels its generation at the next decode step. Every refusal is OpenAI-shaped JSON
(``openai_requests.OpenAIError``); nothing a client sends crashes the server.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import structlog
from aiohttp import web

from coordinator.core.errors import DomainError
from coordinator.rpc.guard import Guard, caller
from coordinator.rpc.identities import WORKER_PERMISSIONS
from worker.http_api.openai_requests import (
    ChatRequest,
    CompletionRequest,
    OpenAIError,
    parse_chat,
    parse_completion,
)
from worker.http_api.openai_responses import DONE, Answer, IncrementalText, Usage
from worker.http_api.serving import (
    check_context,
    check_model,
    common_refusal,
    json_body,
    openai_errors,
    retry_after,
)
from worker.runtime import (
    Generation,
    GenerationAborted,
    GenerationCancelled,
    InvalidRequest,
    PoolExhausted,
)
from worker.serving.gate import Draining
from worker.serving.generations import GenerationRunner
from worker.text.tokenizer import TextTokenizer

log = structlog.get_logger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024
DRAIN_RETRY_S = 1
_STATUS_OF_DOMAIN = {"UNAUTHENTICATED": (401, "authentication_error"),
                     "PERMISSION_DENIED": (403, "permission_error"),
                     "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
                     "INVALID_ARGUMENT": (400, "invalid_request_error")}


class _HttpCall:
    """What ``Guard`` reads of a call, from an HTTP request (its bearer token)."""

    def __init__(self, request: web.Request) -> None:
        self._authorization = request.headers.get("Authorization")

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return () if self._authorization is None else (("authorization", self._authorization),)

    def auth_context(self) -> dict[str, Any]:
        return {}


def _refusal(exc: Exception) -> OpenAIError | None:
    """The OpenAI-shaped answer to what a generation may raise (``common_refusal`` first)."""
    found = common_refusal(exc)
    if found is not None:
        return found
    if isinstance(exc, DomainError):
        status, kind = _STATUS_OF_DOMAIN.get(exc.status_name, (500, "server_error"))
        headers = {} if exc.retry_after_ms is None else retry_after(exc.retry_after_ms)
        return OpenAIError(status, str(exc), type=kind, code=exc.status_name.lower(),
                           headers=headers)
    if isinstance(exc, Draining | GenerationAborted):
        return OpenAIError(503, str(exc), type="server_error", code="draining",
                           headers={"Retry-After": str(DRAIN_RETRY_S)})
    if isinstance(exc, InvalidRequest):
        return OpenAIError(400, str(exc))
    if isinstance(exc, PoolExhausted):
        return OpenAIError(400, str(exc), code="pool_exhausted")
    if isinstance(exc, GenerationCancelled):  # the client went away; nobody reads this
        return OpenAIError(499, str(exc), code="client_closed")
    return None


class OpenAIServer:
    """See the module docstring. ``start`` binds; ``stop`` closes (streams in flight end)."""

    def __init__(self, generations: GenerationRunner, tokenizer: TextTokenizer, guard: Guard,
                 *, model: str, ssl_context: ssl.SSLContext | None = None) -> None:
        self._generations = generations
        self._tokenizer = tokenizer
        self._guard = guard
        self._model = model
        self._ssl = ssl_context
        self._runner: web.AppRunner | None = None
        app = web.Application(client_max_size=MAX_BODY_BYTES,
                              middlewares=[openai_errors(_refusal)])
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        self.app = app

    async def start(self, sock: socket.socket) -> None:
        """Serve on ``sock`` (``bind_http``)."""
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.SockSite(self._runner, sock, ssl_context=self._ssl).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ------------------------------------------------------------------ endpoints

    def _admit(self, request: web.Request) -> None:
        self._guard.admit("Generate", _HttpCall(request), WORKER_PERMISSIONS)

    async def _models(self, request: web.Request) -> web.Response:
        self._admit(request)
        return web.json_response({"object": "list", "data": [{
            "id": self._model, "object": "model", "created": 0, "owned_by": "kvcoord",
            "max_model_len": self._generations.runtime.model.max_context}]})

    def _check_context(self, prompt: Sequence[int], max_tokens: int) -> None:
        check_context(prompt, max_tokens, self._generations.runtime.model.max_context)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        self._admit(request)
        parsed = parse_completion(json_body(await request.read()))
        check_model(parsed.model, self._model, "this worker")
        prompts = [p if isinstance(p, list) else self._tokenizer.encode(p)
                   for p in parsed.prompts]
        return await self._answer(request, parsed, prompts, Answer(parsed.model, chat=False))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self._admit(request)
        parsed = parse_chat(json_body(await request.read()))
        check_model(parsed.model, self._model, "this worker")
        prompt = self._tokenizer.encode_chat(parsed.messages, tools=parsed.tools)
        return await self._answer(request, parsed, [prompt], Answer(parsed.model, chat=True))

    # ------------------------------------------------------------------ generation

    async def _answer(self, request: web.Request, parsed: CompletionRequest | ChatRequest,
                      prompts: list[list[int]], answer: Answer) -> web.StreamResponse:
        sampling = parsed.sampling
        for prompt in prompts:
            self._check_context(prompt, sampling.max_tokens)
        headers = {"x-request-id": request.headers.get("x-request-id") or uuid.uuid4().hex,
                   "x-kvcoord-policy-version": str(self._generations.runtime.policy_version)}
        jobs = [(index * sampling.n + copy, prompt)
                for index, prompt in enumerate(prompts) for copy in range(sampling.n)]
        if sampling.stream:
            return await self._stream(request, answer, jobs, sampling.max_tokens, sampling.n,
                                      sampling.include_usage, headers)
        usage, choices = Usage(), []
        for choice, prompt in jobs:
            generation = await self._generate(prompt, sampling.max_tokens)
            self._count(usage, choice, sampling.n, prompt, generation)
            choices.append(answer.choice(choice, self._tokenizer.decode(generation.tokens),
                                         "length"))
        return web.json_response(answer.whole(choices, usage), headers=headers)

    @staticmethod
    def _count(usage: Usage, choice: int, n: int, prompt: list[int],
               generation: Generation) -> None:
        if choice % n == 0:  # a prompt counts once, however many copies of it run
            usage.prompt_tokens += len(prompt)
            usage.cached_tokens += generation.cached_tokens
            usage.host_cached_tokens += generation.host_cached_tokens
        usage.completion_tokens += len(generation.tokens)

    async def _generate(self, prompt: list[int], max_tokens: int,
                        on_token: Callable[[int], None] | None = None) -> Generation:
        cancel = threading.Event()
        try:
            generation = await self._generations.start(
                prompt, max_tokens, caller().tenant, on_token=on_token, cancel=cancel)
        finally:
            cancel.set()  # the caller went away (or it is done): stop at the next step
        self._generations.answered(generation, uuid.uuid4().hex, len(prompt))
        return generation

    async def _stream(self, request: web.Request, answer: Answer,
                      jobs: list[tuple[int, list[int]]], max_tokens: int, n: int,
                      include_usage: bool, headers: dict[str, str]) -> web.StreamResponse:
        """Server-sent events, each token's text as it is decoded; choices one after another
        (the runtime runs one generation at a time)."""
        response = web.StreamResponse(headers={
            **headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        loop = asyncio.get_running_loop()
        usage = Usage()
        for choice, prompt in jobs:
            tokens: asyncio.Queue[int] = asyncio.Queue()

            def on_token(token: int, queue: asyncio.Queue[int] = tokens) -> None:
                loop.call_soon_threadsafe(queue.put_nowait, token)

            if answer.chat:
                await response.write(answer.chunk(choice, "", first=True))
            text = IncrementalText(self._tokenizer.decode)
            running = asyncio.ensure_future(self._generate(prompt, max_tokens, on_token))
            try:
                while (token := await _next_token(tokens, running)) is not None:
                    if delta := text.add(token):
                        await response.write(answer.chunk(choice, delta))
                generation = await running
            finally:
                running.cancel()  # the client went away: _generate stops the runtime
            await response.write(answer.chunk(choice, text.rest() or None, "length"))
            self._count(usage, choice, n, prompt, generation)
        if include_usage:
            await response.write(answer.usage_chunk(usage))
        await response.write(DONE)
        await response.write_eof()
        return response


async def _next_token(tokens: asyncio.Queue[int], running: asyncio.Future[Generation]
                      ) -> int | None:
    """The next streamed token, or None once the generation has ended and every token it
    streamed was taken (the runtime's tokens are queued before its result arrives). Raises the
    generation's error."""
    while tokens.empty():
        if running.done():
            running.result()
            return None
        getter: asyncio.Future[int] = asyncio.ensure_future(tokens.get())
        try:
            pending: list[asyncio.Future[Any]] = [getter, running]
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        finally:
            getter.cancel()
        if getter.done() and not getter.cancelled():
            return getter.result()
    return tokens.get_nowait()
