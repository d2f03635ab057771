"""What every OpenAI-compatible server here shares (the worker's endpoint and the gateway): the
listening socket (``bind_http``), the aiohttp middleware that turns what a handler raised into
``{"error": {...}}`` with its status, and the refusals both servers make (the transport's 404,
405 and 413, a body that is not JSON, an unknown model, a prompt over the context). No torch."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import structlog
from aiohttp import web

from worker.http_api.openai_requests import OpenAIError
from worker.text.tokenizer import ChatTemplateError, TokenizerError

log = structlog.get_logger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Refusal = Callable[[Exception], "OpenAIError | None"]


def retry_after(ms: int) -> dict[str, str]:
    """The ``Retry-After`` header (whole seconds, at least 1) for a delay of ``ms``."""
    return {"Retry-After": str(max(1, -(-ms // 1000)))}


def common_refusal(exc: Exception) -> OpenAIError | None:
    """The answer to what any of these servers may raise; None when it is not one of them."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return OpenAIError(413, "the request body is over the size limit", code="body_too_large")
    if isinstance(exc, web.HTTPNotFound):
        return OpenAIError(404, "no such endpoint", code="not_found")
    if isinstance(exc, web.HTTPMethodNotAllowed):
        return OpenAIError(405, "method not allowed", code="method_not_allowed")
    if isinstance(exc, TokenizerError | ChatTemplateError):
        return OpenAIError(400, str(exc))
    return None


def openai_errors(refusal: Refusal) -> Any:
    """A middleware answering what a handler raised with ``refusal(exc)`` (OpenAI JSON), or
    500 for what it does not know (logged). A client gone away is not answered."""

    @web.middleware
    async def answer(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:
            found = refusal(exc)
            if found is None:
                log.exception("http.internal_error", path=request.path)
                found = OpenAIError(500, "internal error", type="server_error",
                                    code="internal_error")
            return web.json_response(found.body(), status=found.status, headers=found.headers)

    return answer


def json_body(raw: bytes) -> Any:
    """The request body as JSON; OpenAIError (400, ``invalid_json``) when it is not."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise OpenAIError(400, f"the request body is not JSON: {exc}",
                          code="invalid_json") from None


def check_model(model: str, served: str, here: str) -> None:
    """OpenAIError (404, ``model_not_found``) unless ``model`` is the one ``here`` serves."""
    if model != served:
        raise OpenAIError(404, f"the model {model!r} does not exist ({here} serves "
                          f"{served!r})", code="model_not_found", param="model")


def check_context(prompt: Sequence[int], max_tokens: int, limit: int | None) -> None:
    """OpenAIError (400) for an empty prompt, or one whose ``max_tokens`` more pass ``limit``
    (``context_length_exceeded``; None: no limit known)."""
    if not prompt:
        raise OpenAIError(400, "the prompt is empty", param="prompt")
    if limit is not None and len(prompt) + max_tokens > limit:
        raise OpenAIError(
            400, f"this model's context is {limit} tokens; the prompt has {len(prompt)} "
            f"and {max_tokens} more were asked for", code="context_length_exceeded")


def bind_http(listen: str) -> socket.socket:
    """A listening TCP socket on ``listen`` (HOST:PORT; port 0 picks a free one), bound before
    the server starts so its port is known first (the worker registers the URL)."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, int(port)))
    except OSError:
        sock.close()
        raise
    sock.listen(128)
    sock.setblocking(False)
    return sock
