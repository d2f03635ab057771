"""``simulate``: load a trace, hash it once, compute the bounds, run each policy."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from coordinator.hashing import HashConfig, Namespace, PageHasher
from kvcoord.simulate.engine import (
    ROUTERS,
    SimConfig,
    check_policies,
    infinite_bound,
    pooled_bound,
    run_policy,
)
from kvcoord.simulate.report import SimulationReport
from kvcoord.simulate.trace import BLOCK_TOKENS, load_trace, trace_page_keys

DEFAULT_CAPACITY_TOKENS = 500_000  # an 80 GB GPU, Llama-3-8B bf16 at 128 KiB of KV per token
# Pages of one trace block: the finest grain the trace's hash ids describe. A 16-token page
# only adds sharing inside partial last blocks (+0.08% hit on the synthetic trace) for ~30x
# the run time; pass --page-size 16 to check.
DEFAULT_PAGE_SIZE = BLOCK_TOKENS
# Any fixed key gives the same hit ratios; the simulator's keys never leave the process.
_SIM_HASH_KEY = b"kvcoord.simulate.fixed-key.v1...."

# (policy name, requests in the run) -> a callback given how many more requests are done.
PhaseProgress = Callable[[str, int], Callable[[int], None]]


def simulate(
    trace: str | Path,
    *,
    workers: int,
    capacity_tokens: int = DEFAULT_CAPACITY_TOKENS,
    policies: Sequence[str] = tuple(ROUTERS),
    page_size: int = DEFAULT_PAGE_SIZE,
    limit: int | None = None,
    seed: int = 0,
    progress: PhaseProgress | None = None,
) -> SimulationReport:
    """Run every policy in ``policies`` over the trace (its first ``limit`` requests).

    All arguments are checked before the trace is read (ValueError); trace problems raise
    ``TraceError`` (a ValueError naming the line). ``progress(policy, requests)`` is called
    as each policy's run starts and returns a callback told how many more requests are done.
    """
    names = check_policies(policies)
    if not names:
        raise ValueError("no policy to simulate")
    started = time.monotonic()
    hasher = PageHasher(HashConfig(_SIM_HASH_KEY, page_size=page_size))
    namespace = Namespace(model="simulate", page_size=page_size)
    config = SimConfig(workers, capacity_tokens, hasher, namespace, seed=seed)
    requests = load_trace(trace, limit)
    keys = trace_page_keys(requests, hasher, namespace)
    infinite = infinite_bound(requests, keys, page_size)
    pooled = pooled_bound(requests, keys, config)
    runs = {
        name: run_policy(name, requests, keys, config,
                         progress(name, len(requests)) if progress is not None else None)
        for name in names
    }
    return SimulationReport(
        trace=str(trace), workers=workers, capacity_tokens=capacity_tokens,
        page_size=page_size, requests=len(requests), seed=seed, infinite=infinite,
        pooled=pooled, runs=runs, elapsed_s=time.monotonic() - started,
    )
