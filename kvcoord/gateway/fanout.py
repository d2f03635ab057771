"""Several completion prompts in one request, spread over the workers ``RouteBatch`` chose:
each worker's share of the prompts, and the choices merged back by index.

With ``n`` copies, choice ``k * n + j`` of a share is copy ``j`` of the share's ``k``-th prompt,
and it becomes choice ``i * n + j`` of the whole request, ``i`` that prompt's place in the
request. ``usage`` is summed over the shares.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from coordinator.client.types import Route
from worker.http_api.openai_requests import CompletionRequest


@dataclass(frozen=True, slots=True)
class Share:
    """The prompts one worker gets: their places in the request, and as the client gave them."""

    route: Route
    indexes: list[int]
    prompts: list[str | list[int]]

    def index(self, share_index: int, n: int) -> int:
        """The request's choice index of the share's choice ``share_index``."""
        return self.indexes[share_index // n] * n + share_index % n


def shares(parsed: CompletionRequest, routes: Sequence[Route]) -> list[Share]:
    """One share per chosen worker, in the order of each worker's first prompt."""
    by_worker: dict[str, Share] = {}
    for index, route in enumerate(routes):
        share = by_worker.setdefault(route.worker_id, Share(route, [], []))
        share.indexes.append(index)
        share.prompts.append(parsed.prompts[index])
    return list(by_worker.values())


def _add_usage(total: dict[str, Any], usage: dict[str, Any] | None) -> None:
    if not usage:
        return
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        total[key] = total.get(key, 0) + int(usage.get(key) or 0)
    # cached_tokens, and what an engine reports beside it (host_cached_tokens: ours).
    for key, value in (usage.get("prompt_tokens_details") or {}).items():
        if isinstance(value, int) and not isinstance(value, bool):
            details = total.setdefault("prompt_tokens_details", {})
            details[key] = details.get(key, 0) + value


def merged(answers: Sequence[tuple[Share, dict[str, Any]]], n: int) -> dict[str, Any]:
    """The whole request's answer from each share's (the first share's id and model)."""
    choices: list[dict[str, Any]] = []
    usage: dict[str, Any] = {}
    for share, answer in answers:
        for choice in answer.get("choices", []):
            choices.append({**choice, "index": share.index(int(choice["index"]), n)})
        _add_usage(usage, answer.get("usage"))
    head = dict(answers[0][1])
    head.update(choices=sorted(choices, key=lambda c: c["index"]), usage=usage)
    return head


@dataclass(slots=True)
class StreamTotals:
    """What the merged stream gathers: the first chunk's id, created and model (the usage
    chunk carries them), and the usage summed over the shares."""

    head: dict[str, Any] = field(default_factory=dict)
    usage: dict[str, Any] = field(default_factory=dict)


def reindexed_line(line: bytes, share: Share, n: int, totals: StreamTotals) -> bytes:
    """One line of a share's event stream as the whole request's: choices re-indexed; its
    usage chunk and ``[DONE]`` held back (``totals`` collects the former); blank lines
    dropped (each event is re-sent with its own); other lines as they are."""
    text = line.strip()
    if not text:
        return b""
    if not text.startswith(b"data:"):
        return line
    payload = text[5:].strip()
    if payload == b"[DONE]":
        return b""
    chunk = json.loads(payload)
    if not totals.head:
        totals.head = {k: chunk[k] for k in ("id", "object", "created", "model") if k in chunk}
    if not chunk.get("choices") and chunk.get("usage"):
        _add_usage(totals.usage, chunk["usage"])
        return b""
    for choice in chunk.get("choices", []):
        choice["index"] = share.index(int(choice["index"]), n)
    return _event(chunk)


def usage_line(totals: StreamTotals) -> bytes:
    return _event({**totals.head, "choices": [], "usage": totals.usage})


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
