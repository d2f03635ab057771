"""Reference-engine throughput through the real runtime: prefill of a 2,048-token prompt cold
and with a 1,792-token cached prefix, and greedy decode, measured in the same run.

A prefill is ``generate(prompt, 1)`` (slot allocation, prefix lookup, one forward, argmax,
recording, release: everything a request pays). ``*_tokens_per_s`` for prefill counts prompt
tokens served (cached ones included), ``*_computed_tokens_per_s`` only those run through the
model. Decode rate = extra tokens / extra time between ``generate(p, 1)`` and
``generate(p, 1 + DECODE_TOKENS)`` on fresh prompts. Medians over ``repeats`` runs after one
warm-up.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from coordinator.core.hashing import HashConfig
from worker.runtime.engine import ModelConfig
from worker.runtime.runtime import WorkerRuntime

PROMPT_TOKENS = 2048
CACHED_TOKENS = 1792
DECODE_TOKENS = 64
PAGE_SIZE = 16
_KEY = bytes(range(32))


def bench_engine(device: str = "auto", repeats: int = 5) -> dict[str, Any]:
    """Prefill cold vs cached-prefix and decode tokens/s of the default (tiny) model."""
    model = ModelConfig()
    rt = WorkerRuntime(model=model, pages=1024, page_size=PAGE_SIZE,
                       hash_config=HashConfig(_KEY, page_size=PAGE_SIZE), device=device)
    rng = random.Random(0)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(model.vocab_size) for _ in range(n)]

    system = fresh(CACHED_TOKENS)
    rt.generate(system, 1)  # warm-up, and caches the shared prefix (112 full pages)

    cold_s = _median_s(lambda: _checked(rt.generate(fresh(PROMPT_TOKENS), 1), 0), repeats)
    suffix = PROMPT_TOKENS - CACHED_TOKENS
    cached_s = _median_s(
        lambda: _checked(rt.generate(system + fresh(suffix), 1), CACHED_TOKENS), repeats
    )
    # Fresh 128-token prompts for both, so the two differ only in the decode steps.
    one_s = _median_s(lambda: rt.generate(fresh(128), 1), repeats * 2)
    many_s = _median_s(lambda: rt.generate(fresh(128), 1 + DECODE_TOKENS), repeats * 2)
    if many_s <= one_s:
        raise RuntimeError("decode measured no slower than a single step: machine too noisy")
    rt.check_integrity()
    return {
        "device": _device_name(device),
        "torch_threads": torch.get_num_threads(),
        "prompt_tokens": PROMPT_TOKENS,
        "cached_prefix_tokens": CACHED_TOKENS,
        "prefill_cold_ms": cold_s * 1e3,
        "prefill_cached_prefix_ms": cached_s * 1e3,
        "prefill_cold_tokens_per_s": PROMPT_TOKENS / cold_s,
        "prefill_cached_prefix_tokens_per_s": PROMPT_TOKENS / cached_s,
        "prefill_cached_prefix_computed_tokens_per_s": suffix / cached_s,
        "speedup.prefill_with_cached_prefix": cold_s / cached_s,
        "decode_tokens_per_s": DECODE_TOKENS / (many_s - one_s),
    }


def _checked(result: Any, cached: int) -> None:
    # A benchmark that silently stopped hitting the cache would report the wrong thing.
    if result.cached_tokens != cached:
        raise RuntimeError(f"expected {cached} cached tokens, got {result.cached_tokens}")


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - start) / 1e9)
    return statistics.median(times)


def _device_name(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device
