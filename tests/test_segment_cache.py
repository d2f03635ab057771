"""A chat encoded a message at a time (worker/text/segment_cache.py) gives exactly the ids of
the whole rendered text, finds a conversation's earlier messages in its cache on the next turn,
and turns itself off when a tokenizer would make the two differ."""

from __future__ import annotations

import random
from pathlib import Path

from bench.engines_model import ModelShape, prompt_text, write_model
from worker.text.segment_cache import VERIFY_FIRST, SegmentEncoder, SplitToken
from worker.text.tokenizer import TextTokenizer, reference_tokenizer


def _conversation(turns: int, seed: int) -> list[list[dict[str, str]]]:
    """Each turn's messages: a system prompt, then user and assistant messages in turn."""
    rng = random.Random(seed)
    messages = [{"role": "system", "content": "Answer in one line. " * 8}]
    out = []
    for turn in range(turns):
        messages.append({"role": "user", "content": prompt_text(
            tuple(rng.randrange(500) for _ in range(2)), 32, 64)})
        out.append(list(messages))
        messages.append({"role": "assistant", "content": f"answer {turn} " * 10})
    return out


def _check_exact(tokenizer: TextTokenizer) -> None:
    for turns in _conversation(8, seed=1):
        whole = tokenizer.encode(tokenizer.render_chat(turns), add_special_tokens=False)
        assert tokenizer.encode_chat(turns) == whole


def test_a_conversations_ids_are_the_whole_texts_and_later_turns_hit_the_cache(
    tmp_path: Path,
) -> None:
    tokenizer = write_model(tmp_path / "model", ModelShape())  # the engines bench's BPE
    _check_exact(tokenizer)
    segments = tokenizer.segments
    assert segments.exact and segments.hits > 0
    hits = segments.hits
    turns = _conversation(8, seed=1)
    tokenizer.encode_chat(turns[-1])  # every message seen before
    assert segments.hits - hits == len(turns[-1])


def test_the_shipped_tokenizer_is_exact_too() -> None:
    tokenizer = reference_tokenizer()
    _check_exact(tokenizer)
    assert tokenizer.segments.exact


def test_a_token_that_takes_whitespace_from_its_left_is_never_cut_before() -> None:
    encoder = SegmentEncoder(lambda t: [len(t)], [
        SplitToken("<a>", lstrip=True, normalized=False),
        SplitToken("<b>", lstrip=False, normalized=True)])
    assert not encoder.exact  # nothing usable to cut at: the whole text, always
    assert encoder.encode("x <a> y <b>") == [11]


def test_segments_that_do_not_add_up_turn_the_cache_off_for_good() -> None:
    # A tokenizer whose ids depend on what came before a segment: the check catches it on a
    # checked call, answers the whole text's ids, and never cuts again.
    def whole_length(text: str) -> list[int]:
        return [len(text)]

    encoder = SegmentEncoder(whole_length, [SplitToken("<s>", lstrip=False, normalized=False)])
    long = "<s>" + "x" * 100
    assert encoder.encode(long + long) == [206]
    assert not encoder.exact and encoder.verified == 1
    for _ in range(VERIFY_FIRST + 1):
        assert encoder.encode(long + long) == [206]
    assert encoder.verified == 1  # off: no more checks, no more segments
