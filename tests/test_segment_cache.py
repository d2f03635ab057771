"""A chat encoded a message at a time (worker/text/segment_cache.py) gives exactly the ids of
the whole rendered text, finds a conversation's earlier messages in its cache on the next turn,
and turns itself off when a tokenizer would make the two differ."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

from bench.engines_model import ModelShape, prompt_text, write_model
from worker.text.segment_cache import (
    PIECE_CHARS,
    VERIFY_EVERY,
    VERIFY_FIRST,
    SegmentEncoder,
    SplitToken,
    piece_cuts,
)
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
    # Every segment is found: each message, and the short ones between (closing tags, the
    # generation prompt's header), which cost a tokenizer call each when not cached.
    parts = [p for p in segments._split.split(tokenizer.render_chat(turns[-1])) if p]
    assert len(parts) > len(turns[-1]) and segments.hits - hits == len(parts)


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


def _shared_prefix_prompts(seed: int) -> tuple[str, str]:
    """Two long user messages that share their first ~6,000 characters."""
    rng = random.Random(seed)
    shared = prompt_text(tuple(rng.randrange(500) for _ in range(30)), 64, 30 * 64)
    return (shared + prompt_text((rng.randrange(500),), 64, 64),
            shared + prompt_text((rng.randrange(500),), 64, 64))


def test_long_messages_sharing_a_prefix_encode_only_what_differs(tmp_path: Path) -> None:
    for tokenizer in (write_model(tmp_path / "model", ModelShape()), reference_tokenizer()):
        first, second = _shared_prefix_prompts(seed=2)
        assert len(first) > 4 * PIECE_CHARS
        for text in (first, second):
            messages = [{"role": "user", "content": text}]
            whole = tokenizer.encode(tokenizer.render_chat(messages), add_special_tokens=False)
            hits = tokenizer.segments.hits
            assert tokenizer.encode_chat(messages) == whole
        segments = tokenizer.segments
        assert segments.exact and segments.pieces_exact
        shared = len(piece_cuts(first[:len(first) - 2 * PIECE_CHARS])) - 2
        assert segments.hits - hits >= shared >= 3  # the second found the shared pieces


def test_piece_cuts_fall_before_a_space_between_words_and_cover_the_text() -> None:
    rng = random.Random(3)
    for _ in range(50):
        text = "".join(rng.choice(["word", " ", "  ", "\n", "x"]) for _ in range(3_000))
        cuts = piece_cuts(text, 100)
        assert cuts[0] == 0 and cuts[-1] == len(text) and cuts == sorted(set(cuts))
        for cut in cuts[1:-1]:
            assert text[cut] == " " and not text[cut - 1].isspace()
            assert not text[cut + 1].isspace()
        assert all(b - a >= 100 for a, b in itertools.pairwise(cuts))


def test_pieces_that_do_not_add_up_turn_off_only_the_pieces() -> None:
    # A tokenizer that merges across spaces: a piece's ids are not the whole's. The check
    # catches it, answers the whole text's ids; messages are then cached whole, never cut.
    def merges_across_spaces(text: str) -> list[int]:
        return [len(word) for word in text.split("<s>")]

    encoder = SegmentEncoder(merges_across_spaces,
                             [SplitToken("<s>", lstrip=False, normalized=False)])
    text = "<s>" + "ab " * (PIECE_CHARS)
    assert encoder.encode(text) == merges_across_spaces(text)
    assert not encoder.pieces_exact and encoder.exact
    for _ in range(2):  # cached whole, then found whole
        assert encoder.encode(text) == merges_across_spaces(text)
    assert encoder.hits == 1 and encoder.pieces_exact is False


def test_only_calls_that_join_parts_are_checked_the_first_few_then_one_in_many() -> None:
    encoded: list[str] = []

    def exact(text: str) -> list[int]:  # a tokenizer that keeps the rule: one id per char
        encoded.append(text)
        return [ord(c) for c in text]

    encoder = SegmentEncoder(exact, [SplitToken("<s>", lstrip=False, normalized=False)])
    one = "<s>" + "x" * 100  # a single segment: its ids are the whole text's, nothing to check
    for _ in range(VERIFY_FIRST):
        encoder.encode(one)
    assert encoder.verified == 0
    two = "<s>" + "y" * 100 + "<s>" + "z" * 100  # two segments joined: checked
    for _ in range(VERIFY_FIRST + 4):
        assert encoder.encode(two) == exact(two)
    assert encoder.verified == VERIFY_FIRST
    encoded.clear()
    while encoder.calls % VERIFY_EVERY:
        encoder.encode(two)
    assert encoder.verified == VERIFY_FIRST + 1 and encoded == [two]  # the sampled check
