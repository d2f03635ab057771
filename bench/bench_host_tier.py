"""The host tier on the reference worker: prefill of a 2,048-token prompt whose 1,792-token
prefix sits in host memory, against the same prefix cold and the same prefix on the device, in
one run through the real runtime (``generate(prompt, 1)``: lookup, copy back, forward,
recording, release).

The model is larger than the default reference model, so that a prefill's compute dominates a
copy of its KV, as on a real engine: ``BENCH_MODEL`` (8 layers, hidden 512, 8 query / 2 KV
heads of 64 dims, SwiGLU 1,408: ~23M parameters, 8 KiB of fp32 KV per token). ``--quick``
uses ``QUICK_MODEL`` (2 layers, hidden 256) so the smoke run stays short; its ratios mean less.

How the prefix is put in the host tier for each timed request: the device pool holds 130 pages
(a 2,048-token prompt needs 128), and a filler prompt that is itself cached (in either tier)
runs untimed first; bringing its 128 pages up evicts the prefix's pages down to the host tier.
The filler's copy back is not timed; the prefix's is, and so is the copy down of the filler's
pages that the timed request's allocation evicts (``copy_down_ms``): a host hit on a full
device pays both. Medians over ``repeats``.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from coordinator.core.hashing import HashConfig
from worker.runtime import Generation
from worker.runtime.engine import ModelConfig
from worker.runtime.runtime import WorkerRuntime

BENCH_MODEL = ModelConfig(hidden=512, layers=8, heads=8, kv_heads=2, head_dim=64,
                          intermediate=1408)
QUICK_MODEL = ModelConfig(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64,
                          intermediate=704)
PROMPT_TOKENS = 2048
PREFIX_TOKENS = 1792
PAGE_SIZE = 16
DEVICE_PAGES = PROMPT_TOKENS // PAGE_SIZE + 2
HOST_PAGES = 2 * DEVICE_PAGES
_KEY = bytes(range(32))


def bench_host_tier(quick: bool = False, repeats: int = 5) -> dict[str, Any]:
    """Prefill ms with the prefix cold / in the host tier / on the device, and the copy."""
    model = QUICK_MODEL if quick else BENCH_MODEL
    repeats = 1 if quick else repeats
    rt = WorkerRuntime(model=model, pages=DEVICE_PAGES, host_pages=HOST_PAGES,
                       page_size=PAGE_SIZE, hash_config=HashConfig(_KEY, page_size=PAGE_SIZE),
                       device="cpu")
    rng = random.Random(0)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(model.vocab_size) for _ in range(n)]

    prefix, filler = fresh(PREFIX_TOKENS), fresh(PROMPT_TOKENS)
    rt.generate(fresh(PROMPT_TOKENS), 1)  # warm-up
    cold_s = _median_s(lambda: _expect(rt.generate(fresh(PROMPT_TOKENS), 1), 0, 0), repeats)
    rt.generate(filler, 1)  # cached from now on: the tool that pushes the prefix down
    rt.generate(prefix + fresh(PROMPT_TOKENS - PREFIX_TOKENS), 1)
    suffix = PROMPT_TOKENS - PREFIX_TOKENS
    copied: list[tuple[int, float, float]] = []

    def host_prefix() -> None:
        before = rt.stats().copies
        started = time.perf_counter()
        generation = rt.generate(prefix + fresh(suffix), 1)
        elapsed = time.perf_counter() - started
        after = rt.stats().copies
        assert before is not None and after is not None
        copied.append((after.bytes_to_device - before.bytes_to_device,
                       after.seconds_to_device - before.seconds_to_device,
                       after.seconds_to_host - before.seconds_to_host))
        _expect(generation, PREFIX_TOKENS, PREFIX_TOKENS - 2 * PAGE_SIZE)
        host_times.append(elapsed)

    host_times: list[float] = []
    for _ in range(repeats):
        rt.generate(filler, 1)  # untimed: the filler comes up, the prefix goes down
        host_prefix()
    device_s = _median_s(
        lambda: _expect(rt.generate(prefix + fresh(suffix), 1), PREFIX_TOKENS, 0), repeats)
    rt.check_integrity()
    host_s = statistics.median(host_times)
    copy_bytes, copy_s, down_s = copied[len(copied) // 2]
    return {
        "model": "quick" if quick else "bench",
        "model_params_m": round(_params(model) / 1e6, 1),
        "kv_bytes_per_token": 2 * model.layers * model.kv_heads * model.head_dim * 4,  # fp32
        "prompt_tokens": PROMPT_TOKENS,
        "prefix_tokens": PREFIX_TOKENS,
        "prefill_cold_ms": cold_s * 1e3,
        "prefill_host_prefix_ms": host_s * 1e3,
        "prefill_device_prefix_ms": device_s * 1e3,
        "copy_back_ms": copy_s * 1e3,
        "copy_back_bytes": copy_bytes,
        "copy_back_gb_per_s": copy_bytes / copy_s / 1e9 if copy_s else 0.0,
        # The same request's allocation sends the filler's pages down: part of its time too.
        "copy_down_ms": down_s * 1e3,
        "speedup.host_prefix_vs_cold": cold_s / host_s,
        "speedup.device_prefix_vs_cold": cold_s / device_s,
        "host_prefix_over_device_prefix": host_s / device_s,
    }


def _expect(result: Generation, cached: int, host_at_least: int) -> None:
    # A benchmark that silently stopped hitting the tier it measures would report the wrong
    # thing. The prefix's first pages may stay on the device (the filler leaves room for 2).
    if result.cached_tokens != cached or result.host_cached_tokens < host_at_least or (
            host_at_least == 0 and result.host_cached_tokens):
        raise RuntimeError(f"expected {cached} cached tokens ({host_at_least}+ from the host "
                           f"tier), got {result.cached_tokens} ({result.host_cached_tokens})")


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _params(model: ModelConfig) -> int:
    return sum(math.prod(shape) for shape in model.weight_shapes().values())
