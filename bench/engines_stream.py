"""The engines bench's request stream: the Mooncake synthetic trace, sampled, scaled to the model.

**Sampling.** In the trace, a prefix is shared only between requests whose hash ids start alike,
so every request belongs to one *family*: the requests with its first hash id. A family's
requests are spread over the trace's whole 17 minutes, so a short contiguous slice shares
almost nothing (6% of blocks in its first 200 requests), while the trace as a whole shares
most. The stream takes whole families, chosen by a seeded shuffle, until it has the requests it
wants (the last family cut to fit), in trace order: it keeps the trace's mix of one-off and
recurring prompts and every prefix its requests share.

**Scaling.** Each 512-token trace block becomes ``block_tokens`` words of one token each
(``engines_model``), the last block cut to the request's ``input_length`` scaled alike, the
whole cut to fit the model's context beside the template and the answer. Answers are capped at
``max_output_tokens`` (the bench measures prefill and routing, not decode). Arrival times keep
the trace's spacing, multiplied by one factor (``Stream.scaled``) that the bench derives from
the engines' measured prefill speed.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from bench.engines_model import chat, prompt_text, template_tokens
from kvcoord.simulate.trace import TraceRequest, load_trace
from kvcoord.simulate.workloads import generate, jsonl
from worker.text.tokenizer import TextTokenizer

TRACE_BLOCK = 512  # tokens per hash id in the trace
GENERATED_PER_REQUEST = 4
"""A generated workload's trace holds this many requests per stream request, so that whole
families can be sampled from it."""


@dataclass(frozen=True, slots=True)
class StreamShape:
    """How to cut the stream: ``requests`` in all; ``block_tokens`` per trace block;
    ``max_output_tokens`` at most per answer; ``seed`` picks the families."""

    requests: int
    block_tokens: int = 64
    max_output_tokens: int = 8
    seed: int = 0


@dataclass(frozen=True, slots=True)
class StreamRequest:
    """One request: its place in the stream and the trace, when it is sent (seconds after the
    stream starts), its text, and its prompt as the engines count it (template included)."""

    index: int
    trace_index: int
    arrival_s: float
    hash_ids: tuple[int, ...]
    text: str
    prompt_tokens: int
    max_tokens: int

    @property
    def messages(self) -> list[dict[str, str]]:
        return chat(self.text)


@dataclass(frozen=True, slots=True)
class Stream:
    """The requests in arrival order, the trace span they came from (seconds), and the
    stream's distinct words (a shared prefix counted once: the prefill a fleet sharing one
    perfect cache would still do)."""

    requests: tuple[StreamRequest, ...]
    trace_span_s: float
    distinct_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.requests)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0

    def scaled(self, factor: float) -> Stream:
        """The same stream with every arrival time multiplied by ``factor`` (> 0)."""
        if factor <= 0:
            raise ValueError(f"a time scale must be > 0, got {factor}")
        return replace(self, requests=tuple(replace(r, arrival_s=r.arrival_s * factor)
                                            for r in self.requests))


def workload_trace(workload: str, trace: Path, requests: int, work: Path) -> Path:
    """The trace file a ``workload``'s stream of ``requests`` is sampled from: ``trace`` for
    the trace workload, else the simulator's generated family (``GENERATED_PER_REQUEST`` x
    ``requests`` of it, seed 0) written into ``work``."""
    if workload == "trace":
        return trace
    path = work / f"{workload}.jsonl"
    jsonl.write(generate(workload, requests=GENERATED_PER_REQUEST * requests), path)
    return path


def sample_families(trace: Sequence[TraceRequest], requests: int, seed: int) -> list[int]:
    """Indices into ``trace`` of whole families (first hash id alike), shuffled by ``seed``,
    until ``requests`` are taken; returned in trace order. ValueError when the trace has fewer."""
    if requests > len(trace):
        raise ValueError(f"the trace has {len(trace)} requests, {requests} asked")
    families: dict[int, list[int]] = defaultdict(list)
    for i, request in enumerate(trace):
        families[request.hash_ids[0] if request.hash_ids else -1 - i].append(i)
    roots = sorted(families)
    random.Random(seed).shuffle(roots)
    picked: list[int] = []
    for root in roots:
        picked += families[root][:requests - len(picked)]
        if len(picked) == requests:
            break
    return sorted(picked)


def build_stream(trace_path: Path, shape: StreamShape, tokenizer: TextTokenizer,
                 max_model_len: int) -> Stream:
    """The stream (arrivals at the trace's own pace: scale with ``Stream.scaled``). Each
    prompt's id count is checked against the tokenizer (ValueError on a mismatch)."""
    trace = load_trace(trace_path)
    chosen = [trace[i] for i in sample_families(trace, shape.requests, shape.seed)]
    overhead = template_tokens(tokenizer)
    start_ms = chosen[0].timestamp_ms
    out: list[StreamRequest] = []
    used: dict[int, int] = {}  # hash id -> the most of its words any prompt uses
    for index, request in enumerate(chosen):
        max_tokens = max(1, min(request.output_length, shape.max_output_tokens))
        room = max_model_len - overhead - max_tokens
        words = min(room, max(1, math.ceil(request.input_length * shape.block_tokens
                                           / TRACE_BLOCK)))
        text = prompt_text(request.hash_ids, shape.block_tokens, words)
        for position, hash_id in enumerate(request.hash_ids):
            in_block = min(shape.block_tokens, words - position * shape.block_tokens)
            if in_block <= 0:
                break
            used[hash_id] = max(used.get(hash_id, 0), in_block)
        out.append(StreamRequest(index, request.index, (request.timestamp_ms - start_ms) / 1000,
                                 request.hash_ids, text, words + overhead, max_tokens))
    for request in out[:: max(1, len(out) // 8)]:  # a sample: encoding every prompt is slow
        counted = len(tokenizer.encode_chat(request.messages))
        if counted != request.prompt_tokens:
            raise ValueError(f"request {request.index}: {counted} ids, "
                             f"{request.prompt_tokens} expected")
    span = (chosen[-1].timestamp_ms - start_ms) / 1000
    return Stream(tuple(out), span, sum(used.values()))


def write_sample(trace_path: Path, out: Path, requests: int, seed: int = 0) -> None:
    """Write the trace lines of ``sample_families(..., requests, seed)`` to ``out``, verbatim:
    the committed sample the quick run replays (``sample_families`` over it takes it whole)."""
    lines = [line for line in trace_path.read_text().splitlines() if line.strip()]
    picked = sample_families(load_trace(trace_path), requests, seed)
    # load_trace sorts by timestamp (stable): map its order back to file lines the same way.
    order = sorted(range(len(lines)), key=lambda i: json.loads(lines[i])["timestamp"])
    out.write_text("".join(lines[order[i]] + "\n" for i in picked))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.engines_stream",
                                     description="write a sample of whole families")
    parser.add_argument("trace", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--requests", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    arguments = parser.parse_args()
    write_sample(arguments.trace, arguments.out, arguments.requests, arguments.seed)
