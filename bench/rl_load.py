"""GRPO load for ``kvcoord bench rl``: client threads, each sending a group of ``group``
concurrent greedy completions of one prompt, waiting for the whole group, then the next, until
stopped.

Prompts are token ids (3..499, the tiny model's plain tokens) drawn from a seeded RNG, a few
hundred long. A share of the groups (``hot_share``) reuses one of ``hot_prompts`` prompts
common to every client, so a prompt comes back across steps and prefix caching matters (and an
update's cache reset is visible); the rest are fresh. Each request carries its own
``x-request-id`` (the bridge reports its rollout record under it).

Every request is kept as a ``Sent``: when it was sent and answered, and its sample. The
version a sample is attributed to is the answer's ``x-kvcoord-policy-version`` (``complete``),
or what ``attribute()`` returned when the request was sent: what a client without our headers
believes (the trainer's version counter).
"""

from __future__ import annotations

import random
import statistics
import threading
import time
import urllib.error
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from bench.rl_fleet import MODEL
from bench.rl_samples import Answer, Sample, complete
from kvcoord.up_report import percentile

TOKEN_IDS = (3, 500)  # [low, high): no special token of the tiny model's tokenizer


@dataclass(frozen=True, slots=True)
class LoadShape:
    """``clients`` threads, each sending groups of ``group`` requests; prompts of
    ``prompt_tokens`` (min, max) ids; each group's ``max_tokens`` one of ``answer_tokens``."""

    clients: int = 3
    group: int = 4
    prompt_tokens: tuple[int, int] = (192, 384)
    answer_tokens: tuple[int, ...] = (16, 24, 32)
    hot_prompts: int = 8
    hot_share: float = 0.5
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Sent:
    """One request: ``status`` 200 with a sample, another HTTP status, or 0 when no answer
    came (``error`` says why)."""

    request_id: str
    sent_at: float
    answered_at: float
    status: int
    sample: Sample | None
    error: str = ""


def random_prompt(rng: random.Random, shape: LoadShape) -> tuple[int, ...]:
    return tuple(rng.randrange(*TOKEN_IDS) for _ in range(rng.randint(*shape.prompt_tokens)))


def send(url: str, prompt: Sequence[int], max_tokens: int,
         attribute: Callable[[], int] | None = None) -> Sent:
    """One greedy completion at ``url``, timed (monotonic clock). With ``attribute`` the
    sample's version is what it returned before the request left, whatever the answer says."""
    request_id = uuid.uuid4().hex
    believed = attribute() if attribute is not None else None
    sent_at = time.monotonic()
    try:
        answer = complete(url, MODEL, prompt, max_tokens, headers={"x-request-id": request_id})
    except (urllib.error.URLError, OSError, ValueError) as exc:
        answer = Answer(0, None, f"{type(exc).__name__}: {exc}")
    sample = answer.sample
    if sample is not None and believed is not None:
        sample = replace(sample, version=believed)
    return Sent(request_id, sent_at, time.monotonic(), answer.status, sample, answer.body[:300])


class GrpoLoad:
    """``shape.clients`` threads sending GRPO groups to ``url`` from ``start`` to ``stop``."""

    def __init__(self, url: str, shape: LoadShape,
                 attribute: Callable[[], int] | None = None) -> None:
        self.url, self.shape, self.attribute = url, shape, attribute
        hot = random.Random(shape.seed)
        self.hot = [random_prompt(hot, shape) for _ in range(shape.hot_prompts)]
        self._sent: list[Sent] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True,
                                          name=f"grpo-client-{i}") for i in range(shape.clients)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> list[Sent]:
        """Stop after each client's current group is answered; every request, in send order."""
        self._stopping.set()
        for thread in self._threads:
            thread.join()
        return sorted(self._sent, key=lambda s: s.sent_at)

    def count(self) -> int:
        with self._lock:
            return len(self._sent)

    def _client(self, index: int) -> None:
        rng = random.Random(self.shape.seed * 1_000 + index + 1)
        with ThreadPoolExecutor(max_workers=self.shape.group) as pool:
            while not self._stopping.is_set():
                hot = rng.random() < self.shape.hot_share
                prompt = rng.choice(self.hot) if hot else random_prompt(rng, self.shape)
                max_tokens = rng.choice(self.shape.answer_tokens)
                futures = [pool.submit(send, self.url, prompt, max_tokens, self.attribute)
                           for _ in range(self.shape.group)]
                group = [f.result() for f in futures]
                with self._lock:
                    self._sent.extend(group)


def window(sent: Sequence[Sent], begin: float, end: float) -> dict[str, Any]:
    """The requests answered in ``[begin, end)``: samples per second, failures, latency."""
    inside = [s for s in sent if begin <= s.answered_at < end]
    ok = [s for s in inside if s.sample is not None]
    latency = [(s.answered_at - s.sent_at) * 1000 for s in ok]
    span = end - begin
    return {"seconds": round(span, 2), "samples": len(ok), "failed": len(inside) - len(ok),
            "samples_per_s": len(ok) / span if span > 0 else 0.0,
            "completion_tokens_per_s": sum(len(s.sample.tokens) for s in ok if s.sample)
            / span if span > 0 else 0.0,
            "latency_p50_ms": statistics.median(latency) if latency else 0.0,
            "latency_p99_ms": percentile(latency, 99)}
