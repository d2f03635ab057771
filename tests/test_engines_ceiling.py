"""The stream's cache ceiling (bench/engines_ceiling.py): one engine of unbounded memory taking
the stream in order serves a prompt's leading full blocks that an earlier prompt began with,
never its last token; a block matches only behind the same blocks; a run's recorded ceiling and
one rebuilt from its setup agree."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.engines_ceiling import ceiling_tokens, rebuilt_ceiling, stream_ceiling
from bench.engines_model import ModelShape, write_model
from bench.engines_stream import StreamShape, build_stream, workload_trace

BLOCK = 4


def test_leading_blocks_seen_before_are_cached_and_the_last_token_never() -> None:
    first = list(range(1, 9))  # two full blocks, nothing before them
    longer = [*first, 9]  # both blocks seen: 8 of its 9 tokens
    again = list(first)  # both seen, but the last token is computed: one block
    branch = [1, 2, 3, 4, 99, 98, 97, 96, 95]  # first block only
    moved = [5, 6, 7, 8, 1, 2]  # first's second block, at another place: nothing
    cached, total = ceiling_tokens([first, longer, again, branch, moved], BLOCK)
    assert cached == 0 + 8 + 4 + 4 + 0
    assert total == 8 + 9 + 8 + 9 + 6


def test_a_prompt_of_one_partial_block_is_never_cached() -> None:
    assert ceiling_tokens([[1, 2, 3], [1, 2, 3]], BLOCK) == (0, 6)


def test_a_block_under_one_token_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        ceiling_tokens([[1]], 0)


def test_a_rebuilt_ceiling_is_the_recorded_one(tmp_path: Path) -> None:
    tokenizer = write_model(tmp_path / "model", ModelShape())
    shape = StreamShape(requests=40, block_tokens=32)
    trace = tmp_path / "unused.jsonl"  # a generated family needs no trace
    stream = build_stream(workload_trace("chat", trace, shape.requests, tmp_path), shape,
                          tokenizer, 4096)
    recorded = stream_ceiling(stream, tokenizer, 32)
    # A chat family shares its system prompt and each conversation's turns.
    assert 0 < recorded["cached_tokens"] < recorded["prompt_tokens"]
    setup = {"model": {"max_model_len": 4096}, "streams": {"chat": {
        "requests": 40, "block_tokens": 32, "max_output_tokens": shape.max_output_tokens,
        "seed": shape.seed}}}
    again = tmp_path / "again"  # the family generated anew, as the matrix does
    again.mkdir()
    assert rebuilt_ceiling(setup, "chat", trace, again, tokenizer, 32) == recorded
    assert rebuilt_ceiling(setup, "trace", trace, tmp_path, tokenizer, 32) is None  # no file
