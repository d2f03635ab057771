"""A streamed ``/v1/completions`` call to one worker's OpenAI endpoint, timed at the client.

``kvcoord up`` measures time to first token here, where a user would: the client sends token
ids (``prompt`` as a list of ids), the worker streams server-sent events, and the clock stops
at the first event that carries a choice. The reference worker writes an event as soon as a
token's text is whole (``worker.http_api.openai_responses.IncrementalText``), so the first event
is the first token, except when that token is part of a multi-byte character: then it arrives
with the token that completes it, one decode step later.

One keep-alive connection per (thread, endpoint): the first request of each pays the TCP
connect, later ones do not, so warm-up requests must go through the same streamer.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

POLICY_HEADER = "x-kvcoord-policy-version"


class StreamError(RuntimeError):
    """The endpoint refused the request, or its stream broke off or made no sense."""


@dataclass(frozen=True, slots=True)
class Streamed:
    """One answered request. ``ttft_s``/``total_s`` run from the request's send to its first
    choice event / to the end of its stream; the token counts are the worker's ``usage``;
    ``policy_version`` is the worker's ``x-kvcoord-policy-version`` header."""

    text: str
    ttft_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    policy_version: int


class CompletionStreamer:
    """Streams completions from workers' endpoints (module docstring); thread-safe."""

    def __init__(self, model: str = "default", timeout: float = 30.0) -> None:
        self._model = model
        self._timeout = timeout
        self._local = threading.local()
        self._all: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def complete(self, base_url: str, prompt: Sequence[int], max_tokens: int) -> Streamed:
        """POST ``prompt`` to ``base_url``/v1/completions, streamed with usage; StreamError
        for a refusal or a broken stream (the connection is then dropped, not reused)."""
        body = json.dumps({"model": self._model, "prompt": list(prompt),
                           "max_tokens": max_tokens, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        connection = self._connection(base_url)
        started = time.perf_counter()
        try:
            connection.request("POST", "/v1/completions", body,
                               {"Content-Type": "application/json"})
            response = connection.getresponse()
            if response.status != 200:
                raise StreamError(f"{base_url}: HTTP {response.status}: "
                                  f"{response.read()[:500].decode(errors='replace')}")
            return self._read(response, started)
        except (OSError, http.client.HTTPException, StreamError, ValueError, KeyError,
                TypeError) as exc:
            self._drop(base_url)
            if isinstance(exc, StreamError):
                raise
            raise StreamError(f"{base_url}: {type(exc).__name__}: {exc}") from exc

    def _read(self, response: http.client.HTTPResponse, started: float) -> Streamed:
        first: float | None = None
        text: list[str] = []
        usage: dict[str, Any] | None = None
        done = False
        while line := response.readline():
            if not line.startswith(b"data: "):
                continue  # the blank line between events
            payload = line[6:].strip()
            if payload == b"[DONE]":
                done = True
                continue
            event = json.loads(payload)
            if event.get("choices"):
                if first is None:
                    first = time.perf_counter()
                text += [choice.get("text") or "" for choice in event["choices"]]
            if event.get("usage"):
                usage = event["usage"]
        ended = time.perf_counter()
        if not done or first is None or usage is None:
            raise StreamError("the stream ended without a choice, usage and [DONE]")
        version = response.getheader(POLICY_HEADER)
        if version is None:
            raise StreamError(f"no {POLICY_HEADER} header")
        return Streamed("".join(text), first - started, ended - started,
                        int(usage["prompt_tokens"]),
                        int(usage["prompt_tokens_details"]["cached_tokens"]),
                        int(usage["completion_tokens"]), int(version))

    def _connection(self, base_url: str) -> http.client.HTTPConnection:
        connections: dict[str, http.client.HTTPConnection] = self._local.__dict__.setdefault(
            "connections", {})
        if base_url not in connections:
            url = urllib.parse.urlsplit(base_url)
            if url.scheme != "http" or url.hostname is None:
                raise StreamError(f"{base_url!r}: only plain http:// endpoints are streamed here")
            connection = http.client.HTTPConnection(url.hostname, url.port,
                                                    timeout=self._timeout)
            with self._lock:
                self._all.append(connection)
            connections[base_url] = connection
        return connections[base_url]

    def _drop(self, base_url: str) -> None:
        connection = self._local.__dict__.get("connections", {}).pop(base_url, None)
        if connection is not None:
            connection.close()

    def close(self) -> None:
        """Close every connection any thread opened."""
        with self._lock:
            for connection in self._all:
                connection.close()
            self._all.clear()
