"""When each request arrives in one seeded run: its trace time plus a seeded jitter.

A seed varies the arrivals, not only tie-breaks: request ``i`` arrives at
``timestamp_ms + U(0, jitter_ms)`` with ``U`` drawn from a generator seeded by the seed alone
(``random.Random("kvcoord.simulate.arrivals:<seed>")``), so every policy replays the same
arrivals under one seed and other arrivals under another. Requests whose jittered times cross
swap places. :data:`ARRIVAL_JITTER_MS` is the default: 250 ms, about the Mooncake synthetic
trace's mean gap between arrivals (256 ms), so a seed reshuffles neighbours without changing
the offered load.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvcoord.simulate.trace import TraceRequest

ARRIVAL_JITTER_MS = 250.0


def jittered_arrivals(
    requests: Sequence[TraceRequest], seed: int, jitter_ms: float = ARRIVAL_JITTER_MS
) -> list[tuple[float, int]]:
    """``(arrival_s, request position)`` for every request, in arrival order (ties keep trace
    order). ValueError unless ``jitter_ms`` is finite and >= 0."""
    if not (0 <= jitter_ms < float("inf")):
        raise ValueError(f"--jitter-ms must be >= 0, got {jitter_ms}")
    rng = random.Random(f"kvcoord.simulate.arrivals:{seed}")
    times = [(r.timestamp_ms + rng.uniform(0.0, jitter_ms)) / 1000.0 for r in requests]
    order = sorted(range(len(requests)), key=times.__getitem__)
    return [(times[i], i) for i in order]
