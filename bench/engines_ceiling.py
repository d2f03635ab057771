"""The stream's cache ceiling: the most of its prompt tokens any router can have served from
cache, so that a cached share can be read against what was there to win.

The bound is one engine with unbounded KV memory taking the whole stream in order: a prompt's
leading full blocks that an earlier prompt also began with are cached; the rest is computed. No
fleet does better: an engine serves from cache only blocks it computed itself, earlier, and
every such block was computed for an earlier prompt that began with it. As vLLM does, a prompt
whose every block is cached still computes its last token (``cached_tokens``), so at most
``(n - 1) // block`` whole blocks of an ``n``-token prompt are served from cache.

A router near its ceiling has nothing left to win by placement; where a peer is near it, no
rule can be ahead of that peer on cached share by more than the gap.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.engines_model import ModelShape, write_model
from bench.engines_stream import Stream, StreamShape, build_stream, workload_trace
from kvcoord.provenance import trace_identity
from worker.text.tokenizer import TextTokenizer


def cached_tokens(prompt_tokens: int, matched_blocks: int, block: int) -> int:
    """What an engine serves from cache for an ``prompt_tokens``-token prompt whose first
    ``matched_blocks`` full blocks it holds: whole blocks, and never the last token."""
    return min(matched_blocks, max(0, prompt_tokens - 1) // block) * block


def ceiling_tokens(prompts: Iterable[Sequence[int]], block: int) -> tuple[int, int]:
    """(cached, prompt) tokens of ``prompts`` (token ids, in arrival order) on one engine of
    unbounded memory with ``block``-token blocks (the module docstring's bound). ValueError for
    a block under 1."""
    if block < 1:
        raise ValueError(f"a block holds at least one token, got {block}")
    seen: set[bytes] = set()
    cached = total = 0
    for ids in prompts:
        chain = hashlib.blake2b(digest_size=16)
        keys = []
        for start in range(0, len(ids) - block + 1, block):
            chain.update(repr(tuple(ids[start:start + block])).encode())
            keys.append(chain.copy().digest())  # the block keyed by every id before it too
        matched = 0
        while matched < len(keys) and keys[matched] in seen:
            matched += 1
        cached += cached_tokens(len(ids), matched, block)
        total += len(ids)
        seen.update(keys)
    return cached, total


def stream_ceiling(stream: Stream, tokenizer: TextTokenizer, block: int) -> dict[str, Any]:
    """The stream's ceiling as its prompts are sent (chat template included): cached tokens at
    most, prompt tokens, and their share."""
    cached, total = ceiling_tokens(
        (tokenizer.encode_chat(r.messages) for r in stream.requests), block)
    return {"cached_tokens": cached, "prompt_tokens": total,
            "cached_share": cached / total if total else 0.0}


def rebuilt_ceiling(setup: Mapping[str, Any], workload: str, trace: Path, work: Path,
                    tokenizer: TextTokenizer, block: int) -> dict[str, Any] | None:
    """The ceiling of a run's ``workload`` stream rebuilt from the run's ``setup`` (a case
    JSON's, from before runs recorded it; generated families are rewritten into ``work``); None
    when the trace workload's ``trace`` file is missing."""
    if workload == "trace" and not trace.is_file():
        return None
    s = setup["streams"][workload]
    shape = StreamShape(requests=s["requests"], block_tokens=s["block_tokens"],
                        max_output_tokens=s["max_output_tokens"], seed=s["seed"])
    source = workload_trace(workload, trace, shape.requests, work)
    stream = build_stream(source, shape, tokenizer, setup["model"]["max_model_len"])
    return stream_ceiling(stream, tokenizer, block)


def case_ceilings(cases: Mapping[str, Mapping[str, Any]], trace: Path,
                  work: Path) -> dict[str, float | None]:
    """Each case's ceiling share (``engines_matrix.load_cases``' cases): as its run recorded
    it, else rebuilt from its setup; None where neither can be had (no setup, or the trace
    missing or not the one the run read)."""
    out: dict[str, float | None] = {}
    tokenizer = None
    for name, case in cases.items():
        setup, workload = case.get("setup") or {}, case.get("workload", "trace")
        stream = (setup.get("streams") or {}).get(workload)
        if stream is None:
            out[name] = None
        elif "ceiling" in stream:
            out[name] = stream["ceiling"]["cached_share"]
        elif workload == "trace" and (not trace.is_file() or trace_identity(trace)["sha256"]
                                      != (setup.get("trace") or {}).get("sha256")):
            out[name] = None
        else:
            if tokenizer is None:
                tokenizer = write_model(work / "model", ModelShape())
            found = rebuilt_ceiling(setup, workload, trace, work, tokenizer,
                                    case["engines"]["block_tokens"])
            out[name] = None if found is None else found["cached_share"]
    return out
