"""OpenAI ``/v1/completions`` and ``/v1/chat/completions`` request bodies, checked.

Known fields of the wrong type are refused (``OpenAIError``, HTTP 400) naming the field; unknown
fields are left alone (engines take extra sampling parameters), and the parsed request keeps the
body as it came. Sampling parameters are checked for type only: the reference engine decodes
greedily, so ``temperature``, ``top_p``, ``seed`` and ``stop`` do not change its output.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_TOKENS = 16
MAX_N = 64
"""The largest ``n`` (copies of each prompt) one request may ask for."""


class OpenAIError(Exception):
    """A refusal in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with
    HTTP ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_field(name: str, expected: str) -> OpenAIError:
    return OpenAIError(400, f"'{name}' must be {expected}", param=name, code="invalid_type")


@dataclass(frozen=True, slots=True)
class Sampling:
    """What every request asks of the generation."""

    max_tokens: int
    n: int
    stream: bool
    include_usage: bool


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """``prompts``: each prompt as given, a string or token ids (several prompts in one request
    are answered as choices ``prompt_index * n + copy``)."""

    model: str
    prompts: list[str | list[int]]
    sampling: Sampling
    body: Mapping[str, Any] = field(repr=False)


@dataclass(frozen=True, slots=True)
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    sampling: Sampling
    body: Mapping[str, Any] = field(repr=False)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _optional(body: Mapping[str, Any], name: str, check: Any, expected: str) -> None:
    value = body.get(name)
    if value is not None and not check(value):
        raise bad_field(name, expected)


def _common(body: object, max_tokens_names: tuple[str, ...]
            ) -> tuple[Mapping[str, Any], str, Sampling]:
    if not isinstance(body, Mapping):
        raise OpenAIError(400, "the request body must be a JSON object", code="invalid_body")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_field("model", "a non-empty string")
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        _optional(body, name, _is_number, "a number")
    _optional(body, "seed", _is_int, "an integer")
    _optional(body, "user", lambda v: isinstance(v, str), "a string")
    _optional(body, "stop", lambda v: isinstance(v, str) or (
        isinstance(v, list) and all(isinstance(s, str) for s in v)), "a string or strings")
    _optional(body, "stream", lambda v: isinstance(v, bool), "a boolean")
    _optional(body, "stream_options", lambda v: isinstance(v, Mapping), "an object")
    options = body.get("stream_options") or {}
    _optional(options, "include_usage", lambda v: isinstance(v, bool), "a boolean")
    max_tokens = DEFAULT_MAX_TOKENS
    for name in max_tokens_names:
        value = body.get(name)
        if value is None:
            continue
        if not _is_int(value) or value < 1:
            raise bad_field(name, "an integer >= 1")
        max_tokens = value
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise bad_field("n", f"an integer from 1 to {MAX_N}")
    return body, model, Sampling(max_tokens, n, bool(body.get("stream")),
                                 bool(options.get("include_usage")))


def _token_ids(value: object) -> bool:
    return isinstance(value, list) and all(_is_int(t) and t >= 0 for t in value)


def parse_completion(body: object) -> CompletionRequest:
    """A checked completions request; OpenAIError (400) naming the first bad field."""
    fields, model, sampling = _common(body, ("max_tokens",))
    prompt = fields.get("prompt")
    prompts: list[str | list[int]]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif _token_ids(prompt) and prompt:
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(_token_ids(p) and p for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise bad_field("prompt", "a string, strings, token ids or lists of token ids")
    _optional(fields, "echo", lambda v: isinstance(v, bool), "a boolean")
    return CompletionRequest(model, prompts, sampling, fields)


def parse_chat(body: object) -> ChatRequest:
    """A checked chat completions request; OpenAIError (400) naming the first bad field."""
    fields, model, sampling = _common(body, ("max_tokens", "max_completion_tokens"))
    messages = fields.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_field("messages", "a non-empty array of messages")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise bad_field(f"messages[{index}]", "an object")
        if not isinstance(message.get("role"), str):
            raise bad_field(f"messages[{index}].role", "a string")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise bad_field(f"messages[{index}].content", "a string or an array of parts")
    tools = fields.get("tools")
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, Mapping) for t in tools)):
        raise bad_field("tools", "an array of objects")
    return ChatRequest(model, [dict(m) for m in messages],
                       None if tools is None else [dict(t) for t in tools], sampling, fields)
