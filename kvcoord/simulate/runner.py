"""``simulate``: load a trace (or take generated requests), hash it once, compute the bounds,
run each policy per seed."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from coordinator.core.hashing import HashConfig, Namespace, PageHasher
from kvcoord.provenance import trace_identity
from kvcoord.simulate.arrivals import ARRIVAL_JITTER_MS
from kvcoord.simulate.bounds import infinite_bound, pooled_bound
from kvcoord.simulate.engine import ROUTERS, SimConfig, check_policies, run_policy
from kvcoord.simulate.report import SimulationReport
from kvcoord.simulate.trace import BLOCK_TOKENS, TraceRequest, load_trace, trace_page_keys
from kvcoord.simulate.workloads import jsonl

DEFAULT_CAPACITY_TOKENS = 500_000  # an 80 GB GPU, Llama-3-8B bf16 at 128 KiB of KV per token
# Pages of one trace block: the finest grain the trace's hash ids describe. A 16-token page
# only adds sharing inside partial last blocks (+0.08% hit on the synthetic trace) for ~30x
# the run time; pass --page-size 16 to check.
DEFAULT_PAGE_SIZE = BLOCK_TOKENS
# Any fixed key gives the same hit ratios; the simulator's keys never leave the process.
_SIM_HASH_KEY = b"kvcoord.simulate.fixed-key.v1...."

DEFAULT_SEEDS = 3  # the fewest the README's comparison rule accepts
# (phase label, requests in the run) -> a callback given how many more requests are done.
PhaseProgress = Callable[[str, int], Callable[[int], None]]


def simulate(
    trace: str | Path | Sequence[TraceRequest],
    *,
    workers: int,
    capacity_tokens: int = DEFAULT_CAPACITY_TOKENS,
    host_capacity_tokens: int = 0,
    policies: Sequence[str] = tuple(ROUTERS),
    page_size: int = DEFAULT_PAGE_SIZE,
    limit: int | None = None,
    seed: int = 0,
    seeds: int = DEFAULT_SEEDS,
    arrival_jitter_ms: float = ARRIVAL_JITTER_MS,
    progress: PhaseProgress | None = None,
    trace_name: str = "requests",
) -> SimulationReport:
    """Run every policy in ``policies`` over the trace (its first ``limit`` requests) under
    each of the ``seeds`` seeds ``seed, seed + 1, ...`` (a seed jitters the arrivals by up to
    ``arrival_jitter_ms`` and breaks ties). Each worker has ``capacity_tokens`` of device KV
    memory and ``host_capacity_tokens`` of host memory (0: no host tier).

    ``trace`` is a Mooncake trace file, or requests already built (a generated workload:
    ``kvcoord.simulate.workloads``), which must be valid trace requests in arrival order
    (ValueError otherwise); the report then names them ``trace_name`` (e.g.
    ``workload:chat``) and its ``trace_sha256`` is that of all of them written as a trace
    file (``workloads.jsonl.dumps``), as a file's is of all its bytes, ``limit`` or not.

    All arguments are checked before the trace is read (ValueError); trace problems raise
    ``TraceError`` (a ValueError naming the line). ``progress(label, requests)`` is called
    as each (policy, seed) run starts and returns a callback told how many more requests are
    done.
    """
    names = check_policies(policies)
    if not names:
        raise ValueError("no policy to simulate")
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    started = time.monotonic()
    hasher = PageHasher(HashConfig(_SIM_HASH_KEY, page_size=page_size))
    namespace = Namespace(model="simulate", page_size=page_size)
    config = SimConfig(workers, capacity_tokens, hasher, namespace,
                       arrival_jitter_ms=arrival_jitter_ms,
                       host_capacity_tokens=host_capacity_tokens)
    requests, label, digest = _requests(trace, limit, trace_name)
    keys = trace_page_keys(requests, hasher, namespace)
    infinite = infinite_bound(requests, keys, page_size)
    pooled = pooled_bound(requests, keys, config.pages_per_worker * workers, hasher, namespace)
    pooled_host = pooled if not config.host_pages_per_worker else pooled_bound(
        requests, keys, (config.pages_per_worker + config.host_pages_per_worker) * workers,
        hasher, namespace,
    )
    run_seeds = tuple(range(seed, seed + seeds))
    runs = {
        name: tuple(
            run_policy(name, requests, keys, config, s,
                       progress(f"{name} seed {s}", len(requests))
                       if progress is not None else None)
            for s in run_seeds
        )
        for name in names
    }
    return SimulationReport(
        trace=label, trace_sha256=digest, workers=workers,
        capacity_tokens=capacity_tokens, host_capacity_tokens=host_capacity_tokens,
        page_size=page_size, requests=len(requests), seeds=run_seeds,
        arrival_jitter_ms=arrival_jitter_ms, infinite=infinite, pooled=pooled,
        pooled_host=pooled_host, runs=runs, elapsed_s=time.monotonic() - started,
    )


def _requests(trace: str | Path | Sequence[TraceRequest], limit: int | None,
              name: str) -> tuple[list[TraceRequest], str, str]:
    """(the requests to run, the report's trace name, its sha256) for a file or a list."""
    if isinstance(trace, str | Path):
        return load_trace(trace, limit), str(trace), trace_identity(trace)["sha256"]
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    requests = list(trace)
    if not requests:
        raise ValueError("no requests to simulate")
    jsonl.check(requests)
    if any(a.timestamp_ms > b.timestamp_ms for a, b in itertools.pairwise(requests)):
        raise ValueError("requests must be in arrival order (non-decreasing timestamp_ms)")
    digest = jsonl.sha256(requests)
    kept = requests[:limit]
    # The engine files each request's results under its index: positions 0.. in this list.
    kept = [r if r.index == i else dataclasses.replace(r, index=i) for i, r in enumerate(kept)]
    return kept, name, digest
