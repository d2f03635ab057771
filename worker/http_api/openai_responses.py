"""OpenAI answers: whole responses, server-sent-event chunks, ``usage``, and the text of a
stream decoded token by token without ever emitting half a character."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``payload`` as JSON."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


@dataclass(slots=True)
class Usage:
    """Token counts of one request; ``cached_tokens``: prompt tokens served from the cache
    (either tier), ``host_cached_tokens``: of those, the ones copied back from the host tier
    (reported beside as ``prompt_tokens_details.host_cached_tokens``)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    host_cached_tokens: int = 0

    def body(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens,
                                          "host_cached_tokens": self.host_cached_tokens}}


class IncrementalText:
    """The text of a growing token sequence, handed out as deltas, decoding only a few tokens
    per step (not the whole sequence again). A delta is the text of the tokens since the last
    one, decoded with the tokens before them as context (decoders that strip or join at the
    start of a string see the same neighbours as in the whole text), and is held back while it
    ends in an incomplete UTF-8 sequence (U+FFFD), so a character split across tokens arrives
    whole."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._tokens: list[int] = []
        self._prefix = 0  # context tokens start here
        self._read = 0  # tokens up to here are handed out

    def add(self, token: int) -> str:
        self._tokens.append(token)
        return self._delta(final=False)

    def rest(self) -> str:
        """What is left at the end (an incomplete sequence that stayed incomplete)."""
        return self._delta(final=True)

    def _delta(self, *, final: bool) -> str:
        before = self._decode(self._tokens[self._prefix:self._read])
        text = self._decode(self._tokens[self._prefix:])
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._tokens)
        return text[len(before):]


class Answer:
    """The ids, timestamp and model of one response, and its bodies and chunks."""

    def __init__(self, model: str, *, chat: bool) -> None:
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, suffix: str = "") -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": kind + suffix, "created": self.created,
                "model": self.model}

    def choice(self, index: int, text: str, finish_reason: str) -> dict[str, Any]:
        if self.chat:
            return {"index": index, "message": {"role": "assistant", "content": text},
                    "logprobs": None, "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def whole(self, choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
        return {**self._head(), "choices": choices, "usage": usage.body()}

    def chunk(self, index: int, text: str | None, finish_reason: str | None = None, *,
              first: bool = False) -> bytes:
        """One streamed piece of choice ``index``: ``text`` (None: no new text), the finish
        reason on the last; a chat stream's first chunk names the role."""
        if self.chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None,
                                      "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": None,
                      "finish_reason": finish_reason}
        suffix = ".chunk" if self.chat else ""
        return sse({**self._head(suffix), "choices": [choice]})

    def usage_chunk(self, usage: Usage) -> bytes:
        suffix = ".chunk" if self.chat else ""
        return sse({**self._head(suffix), "choices": [], "usage": usage.body()})
