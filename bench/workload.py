"""Deterministic benchmark prompts: multi-turn conversations over shared system prompts."""

from __future__ import annotations

import math
import random

from coordinator.core.fleet import RegisteredWorker
from coordinator.core.hashing import Namespace
from coordinator.replica import CoordinatorReplica

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


def populate(service: CoordinatorReplica, workers: int, conversations: int = 256) -> None:
    """Attach ``workers`` live sessions and index the conversation pool on them: each
    conversation fully on two workers and its first half on a third (the shape a KV-aware fleet
    converges to). Sessions are installed directly: no Sync streams, no lease expiry."""
    for i in range(workers):
        service.fleet.put(RegisteredWorker(
            worker_id=f"worker-{i:04d}", incarnation=1, address=f"10.0.{i // 250}.{i % 250}:7000",
            model="default", policy_version=0, external=False, total_pages=65_536,
            lease_deadline=math.inf, connected=True,
        ))
    ns = Namespace(page_size=service.config.page_size)
    for c, tokens in enumerate(conversation_pool(conversations)):
        keys = service.hasher.page_keys(tokens, ns)
        service.index.store(f"worker-{c % workers:04d}", keys)
        service.index.store(f"worker-{(c + 1) % workers:04d}", keys)
        service.index.store(f"worker-{(c + 2) % workers:04d}", keys[: len(keys) // 2])
