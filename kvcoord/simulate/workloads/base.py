"""What every workload family is built from: fresh block ids, prompts cut from growing streams,
and the rule that turns an endless stream of sessions into the first N requests.

A generated request is a :class:`~kvcoord.simulate.trace.TraceRequest`, exactly what the trace
loader yields: hash id ``h`` names one block of ``BLOCK_TOKENS`` (512) tokens, equal ids are
equal blocks, and a request's ``input_length`` fits its blocks (``(len(hash_ids) - 1) * 512 <
input_length <= len(hash_ids) * 512``; the last block is usually partial). Two prompts share a
cached prefix exactly as far as their leading ids agree, because the simulator expands ids
into tokens and hashes them with the production chained keys.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from kvcoord.simulate.trace import BLOCK_TOKENS, TraceRequest

# (requests wanted, the workload's own seeded rng) -> those requests, in arrival order.
Generator = Callable[[int, random.Random], list[TraceRequest]]


@dataclass(frozen=True, slots=True)
class Workload:
    """One family: its registry name, a line for ``--help``, how many requests a run has
    unless ``--requests`` says otherwise, and the generator."""

    name: str
    summary: str
    default_requests: int
    generate: Generator


class BlockIds:
    """Hands out hash ids no other block of this workload has used: 0, 1, 2, ..."""

    __slots__ = ("_next",)

    def __init__(self) -> None:
        self._next = 0

    def take(self, count: int) -> tuple[int, ...]:
        """``count`` fresh ids, in order."""
        first = self._next
        self._next += count
        return tuple(range(first, self._next))


class SharedPrompts:
    """A few prompts that many streams start with (system prompts, agent harnesses): each
    whole blocks of fresh ids, the i-th most popular picked with Zipf weight ``i ** -zipf``."""

    __slots__ = ("_popularity", "_prompts")

    def __init__(self, rng: random.Random, ids: BlockIds, count: int,
                 blocks: tuple[int, int], zipf: float = 1.0) -> None:
        self._prompts = [ids.take(rng.randint(*blocks)) for _ in range(count)]
        self._popularity = zipf_weights(count, zipf)

    def pick(self, rng: random.Random) -> tuple[int, ...]:
        """One prompt's hash ids, drawn by popularity."""
        return rng.choices(self._prompts, cum_weights=self._popularity)[0]


class Stream:
    """A token stream that only grows: a conversation or an agent session's context.

    It starts with ``shared`` whole blocks (a system prompt other streams hold too); every
    token appended after them is this stream's own. :meth:`prompt` is always a prefix of every
    later prompt, so turn k's ids start with turn k-1's full blocks. The partial last block
    keeps its id as it fills: a block's id names its full 512 tokens, and a prompt that ends
    inside it is simply cut (as the loader cuts every prompt to ``input_length``).
    """

    __slots__ = ("_blocks", "_ids", "tokens")

    def __init__(self, shared: tuple[int, ...], ids: BlockIds) -> None:
        self._blocks = list(shared)
        self._ids = ids
        self.tokens = len(shared) * BLOCK_TOKENS

    def append(self, tokens: int) -> None:
        """Grow the stream by ``tokens`` (>= 0) tokens, taking fresh ids for new blocks."""
        self.tokens += tokens
        missing = math.ceil(self.tokens / BLOCK_TOKENS) - len(self._blocks)
        if missing > 0:
            self._blocks.extend(self._ids.take(missing))

    def prompt(self) -> tuple[int, ...]:
        """The hash ids of the whole stream so far (its last block possibly partial)."""
        return tuple(self._blocks[: math.ceil(self.tokens / BLOCK_TOKENS)])


def request(timestamp_ms: float, input_length: int, output_length: int,
            hash_ids: tuple[int, ...]) -> TraceRequest:
    """A request at ``timestamp_ms`` rounded to a whole millisecond (as Mooncake traces
    store it); its index is set when the run's requests are ordered (:func:`collect`)."""
    return TraceRequest(0, float(round(timestamp_ms)), input_length, output_length, hash_ids)


def collect(units: Iterable[tuple[float, list[TraceRequest]]], count: int) -> list[TraceRequest]:
    """The first ``count`` requests, in arrival order and indexed 0.., of an endless series
    of units (a conversation, a session, a GRPO group, a RAG query).

    ``units`` yields ``(start_ms, requests)`` with non-decreasing starts, every request at or
    after its unit's start. Generation stops once ``count`` requests arrive no later than the
    newest start: no later unit can arrive before them, so the cut is exact (ties keep
    generation order). Fewer requests come back only if ``units`` runs out.
    """
    if count < 1:
        raise ValueError(f"--requests must be >= 1, got {count}")
    kept: list[TraceRequest] = []
    pending: list[float] = []  # arrival times not yet known to precede every later unit
    settled = 0
    for start, requests in units:
        start = round(start)  # as each request's time is rounded (monotone, so order holds)
        while pending and pending[0] <= start:
            heapq.heappop(pending)
            settled += 1
        if settled >= count:
            break
        kept.extend(requests)
        for r in requests:
            heapq.heappush(pending, r.timestamp_ms)
    ordered = sorted(kept, key=lambda r: r.timestamp_ms)[:count]
    return [TraceRequest(i, r.timestamp_ms, r.input_length, r.output_length, r.hash_ids)
            for i, r in enumerate(ordered)]


def starts(rng: random.Random, per_s: float, shape: float) -> Iterator[float]:
    """Start times (ms, from 0) of a renewal process averaging ``per_s`` starts a second,
    whose gaps are Gamma-distributed with ``shape``: 1 is a Poisson process; below 1 the gaps'
    coefficient of variation is ``1 / sqrt(shape)`` > 1, i.e. bursts and lulls (BurstGPT fits
    LLM request arrivals with a Gamma distribution)."""
    if not (per_s > 0 and shape > 0):
        raise ValueError(f"arrival rate and shape must be > 0, got {per_s}, {shape}")
    scale_ms = 1000.0 / per_s / shape  # Gamma(k, theta) has mean k * theta
    now = 0.0
    while True:
        yield now
        now += rng.gammavariate(shape, scale_ms)


def lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    """A log-normal integer with this median and log-space sigma, clipped to [low, high]."""
    value = rng.lognormvariate(math.log(median), sigma)
    return max(low, min(high, round(value)))


def zipf_weights(count: int, exponent: float) -> list[float]:
    """Cumulative Zipf weights for ranks 1..count (rank r weighs ``r ** -exponent``), ready
    for ``random.choices(..., cum_weights=...)``."""
    total = 0.0
    out = []
    for rank in range(1, count + 1):
        total += rank ** -exponent
        out.append(total)
    return out
