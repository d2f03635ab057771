"""The chaos bench's sustained-lag probe (``bench/chaos_lag.py``) against a real coordinator
with a small per-worker page cap: the probe stays under the cap however many pages it sends,
and a stream the coordinator does end is reported as ``LagProbeEnded``, never a crash."""

from __future__ import annotations

import pytest

from bench.chaos_lag import LAG_KEYS, LagProbeEnded, sustained_lag
from tests.coordinator_fixtures import running_coordinator, target

CAP = 64  # max_pages_per_worker


async def test_the_probe_evicts_as_a_full_pool_does_and_outlasts_the_page_cap() -> None:
    async with running_coordinator(max_pages_per_worker=CAP) as running:
        lag = await sustained_lag(target(running), target(running), rate=200, seconds=1.0,
                                  page_size=16, pool_pages=CAP // 2)
        assert lag["pages_sent"] > 4 * CAP  # far past the cap: the old probe's stream ended
        assert lag["pages_sent"] == lag["sent_batches"] * LAG_KEYS
        assert running.service.index.held_count("lag-probe") <= CAP // 2


async def test_a_stream_ended_by_the_page_cap_is_reported_not_a_crash() -> None:
    async with running_coordinator(max_pages_per_worker=CAP) as running:
        with pytest.raises(LagProbeEnded, match="RESOURCE_EXHAUSTED"):
            await sustained_lag(target(running), target(running), rate=200, seconds=1.0,
                                page_size=16, pool_pages=4 * CAP)
