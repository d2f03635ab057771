"""Deterministic benchmark prompts: multi-turn conversations over shared system prompts."""

from __future__ import annotations

import random

PROMPT_TOKENS = 4096
SYSTEM_TOKENS = 1024


def conversation_pool(
    conversations: int = 256, systems: int = 16, tokens: int = PROMPT_TOKENS, seed: int = 1
) -> list[list[int]]:
    """``conversations`` prompts of ``tokens`` tokens; each starts with one of ``systems``
    shared system prompts and continues with its own turns."""
    rng = random.Random(seed)
    heads = [[rng.randrange(128_000) for _ in range(SYSTEM_TOKENS)] for _ in range(systems)]
    return [
        heads[c % systems] + [rng.randrange(128_000) for _ in range(tokens - SYSTEM_TOKENS)]
        for c in range(conversations)
    ]


def fresh_prompts(n: int, tokens: int = PROMPT_TOKENS, seed: int = 2) -> list[list[int]]:
    """Prompts never seen before (nothing in any cache): the cold-hashing case."""
    rng = random.Random(seed)
    return [[rng.randrange(128_000) for _ in range(tokens)] for _ in range(n)]
