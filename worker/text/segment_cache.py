"""``SegmentEncoder``: a rendered chat encoded a segment at a time, each segment's ids cached, so
a conversation's next turn encodes only its new messages.

A fast tokenizer takes its added tokens (``<|im_start|>``, ``<|im_end|>``...) out of the text
before anything else: the pieces between them are normalized, pre-tokenized and modelled each
on its own. So cutting the text just before an added token changes nothing: the ids of the
whole are the ids of the segments, one after another. A chat template writes such a token at
every message's start, so the segments are the messages, and a turn that adds one message to a
conversation finds every earlier segment in the cache.

A long message is cut further, into pieces of about ``PIECE_CHARS`` characters, each cut made
just before a single space between two words. Where the tokenizer's pre-tokenizer splits words
there (byte-level BPE, Metaspace), the ids of the message are its pieces' ids one after
another, and two prompts that share a long prefix (a shared document, a system prompt pasted
into the user's turn) share their first pieces: only the rest is encoded. The cuts are placed
from the message's start, so a shared prefix is cut alike in every prompt that holds it.

Two guards keep it exact. Only added tokens that take nothing from their left
(``lstrip=False``) and match the raw text (``normalized=False``) are cut before; and the first
``VERIFY_FIRST`` encodings that joined the ids of several parts, then one call in
``VERIFY_EVERY``, are checked against the whole text's ids: on any difference the cache turns
itself off for good (``exact`` False, logged once) and every later call encodes the whole text,
as without it. A call of one part (a single segment, short or found whole) encoded exactly the
whole text: there is nothing to check. A difference in a call that cut a
message into pieces turns off only the pieces (``pieces_exact`` False). The cache is bounded
by the tokens it holds (least recently used out first).
"""

from __future__ import annotations

import itertools
import re
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import structlog

log = structlog.get_logger(__name__)

MAX_CACHED_TOKENS = 2_000_000
"""Tokens the cache holds at most (4 bytes each): a few thousand conversations' messages."""
VERIFY_FIRST = 8
"""Calls that joined several parts checked first. Whether a tokenizer keeps the split rule is a
matter of its structure (where its added tokens and its pre-tokenizer split), and every chat
joins parts at every message: a tokenizer that breaks the rule breaks it on the first such calls.
The check costs a whole encode (1.6 ms for 1,500 tokens on the development machine): at 64, the
first 64 requests of a gateway paid it twice, 40% of a 160-request bench turn."""
VERIFY_EVERY = 256
"""Then one call in this many, for a rule broken only by rare text."""
PIECE_CHARS = 1024
"""A message at least twice this long is cut into pieces of about this many characters: short
enough that a shared prefix leaves little to encode, long enough that a lookup is cheap beside
encoding the piece."""


@dataclass(frozen=True, slots=True)
class SplitToken:
    """An added token as the tokenizer declares it."""

    content: str
    lstrip: bool
    normalized: bool


class SegmentEncoder:
    """``encode(text)``: ``encode_whole(text)``'s ids, from cached segments where it can."""

    def __init__(self, encode_whole: Callable[[str], list[int]],
                 added_tokens: Iterable[SplitToken], *,
                 max_tokens: int = MAX_CACHED_TOKENS) -> None:
        self._encode_whole = encode_whole
        usable = sorted({t.content for t in added_tokens
                         if t.content and not t.lstrip and not t.normalized},
                        key=len, reverse=True)
        # Split before each usable added token (a lookahead: the token starts its segment).
        self._split = re.compile("(?=" + "|".join(map(re.escape, usable)) + ")") \
            if usable else None
        self._cache: OrderedDict[str, array[int]] = OrderedDict()
        self._cached_tokens = 0
        self._max_tokens = max_tokens
        self.exact = self._split is not None
        """Whether segments are used: False with no token to cut at, or after a mismatch."""
        self.pieces_exact = True
        """Whether long messages are cut into pieces: False after a mismatch in a call that
        cut one."""
        self._cut = False  # whether the call in progress cut a message into pieces
        self.calls = 0
        self.hits = 0
        """Segments found in the cache, since start."""
        self.verified = 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        if not self.exact or self._split is None:
            return self._encode_whole(text)
        ids: list[int] = []
        self._cut = False
        parts = 0
        for segment in self._split.split(text):
            if segment:
                ids.extend(self._segment(segment))
                parts += 1
        joined = parts > 1 or self._cut
        if (joined and self.verified < VERIFY_FIRST) or self.calls % VERIFY_EVERY == 0:
            self.verified += 1
            whole = self._encode_whole(text)
            if whole != ids:
                self._cache.clear()
                self._cached_tokens = 0
                if self._cut:
                    self.pieces_exact = False
                    log.warning("tokenizer.pieces_differ", detail="encoding a long message "
                                "by its pieces gave other ids than the whole text: messages "
                                "are no longer cut into pieces", calls=self.calls)
                else:
                    self.exact = False
                    log.warning("tokenizer.segments_differ", detail="encoding a chat by its "
                                "segments gave other ids than the whole text: segment caching "
                                "is off for this tokenizer", calls=self.calls)
                return whole
        return ids

    def _segment(self, segment: str) -> Iterable[int]:
        # Short segments (a closing tag, the generation prompt's header) are cached too: one
        # tokenizer call costs about 8 us however short its text, a lookup well under one.
        if self.pieces_exact and len(segment) >= 2 * PIECE_CHARS:
            cuts = piece_cuts(segment)
            if len(cuts) > 2:
                self._cut = True
                ids: list[int] = []
                for start, end in itertools.pairwise(cuts):
                    ids.extend(self._cached(segment[start:end]))
                return ids
        return self._cached(segment)

    def _cached(self, segment: str) -> Iterable[int]:
        cached = self._cache.get(segment)
        if cached is not None:
            self._cache.move_to_end(segment)
            self.hits += 1
            return cached
        ids = array("I", self._encode_whole(segment))
        if len(ids) <= self._max_tokens:
            self._cache[segment] = ids
            self._cached_tokens += len(ids)
            while self._cached_tokens > self._max_tokens:
                _, old = self._cache.popitem(last=False)
                self._cached_tokens -= len(old)
        return ids


def piece_cuts(text: str, piece_chars: int = PIECE_CHARS) -> list[int]:
    """Where ``text`` is cut into pieces: 0, then the first single space between two words at
    least ``piece_chars`` after the last cut (the space starts the next piece), ..., then
    ``len(text)``. The last piece is at least ``piece_chars`` long (a shorter tail stays with
    the piece before it)."""
    cuts = [0]
    limit = len(text) - piece_chars
    at = piece_chars
    while at < limit:
        space = text.find(" ", at, limit)
        if space < 0:
            break
        if not text[space - 1].isspace() and not text[space + 1].isspace():
            cuts.append(space)
            at = space + piece_chars
        else:
            at = space + 1
    cuts.append(len(text))
    return cuts
