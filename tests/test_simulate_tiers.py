"""`kvcoord simulate --host-capacity-tokens`: simulated workers keep evicted pages in host memory
(the production prefix cache's host tier), pay the copy back, and tell the index the tier;
`dynamo_like` credits host hits as Dynamo publishes. Numbers are worked by hand in the comments.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.core.hashing import HashConfig, Namespace, PageHasher
from coordinator.core.index import PageEvent, PagesStored, PrefixIndex, Tier
from coordinator.core.tier_costs import TierCosts
from kvcoord.simulate.cost_model import CostModel
from kvcoord.simulate.peers import DynamoLikeRouter
from kvcoord.simulate.report import SimulationReport, to_json
from kvcoord.simulate.runner import simulate
from kvcoord.simulate.simworker import Job, SimWorker
from kvcoord.simulate.trace import TraceRequest, load_trace
from tests.test_simulate_peers import context, job, keys

TRACE = Path(__file__).parent / "data" / "mooncake_300.jsonl"
PAGE = 16


def request(index: int, input_length: int, output_length: int) -> TraceRequest:
    return TraceRequest(index, 0.0, input_length, output_length, ())


# ---- one worker, by hand --------------------------------------------------------------------

def test_an_evicted_prefix_moves_to_host_and_comes_back_for_its_copy_time() -> None:
    # 100 prefill tokens/s; copying one token's KV back takes 1,000 B / 1 MB/s = 1 ms.
    cost = CostModel(prefill_tokens_per_s=100, decode_s_per_token=0.01,
                     tiers=TierCosts(kv_bytes_per_token=1000, host_to_device_bytes_per_s=1e6))
    events: list[PageEvent] = []
    index = PrefixIndex(clock=lambda: 0.0)

    def publish(worker_id: str, event: PageEvent) -> None:
        assert worker_id == "w0"
        events.append(event)
        index.apply(worker_id, [event])  # what the engine delivers after the Sync delay

    worker = SimWorker("w0", 4, host_pages=8, namespace=Namespace(model="t", page_size=PAGE),
                       hasher=PageHasher(HashConfig(b"k" * 32, page_size=PAGE)), cost=cost,
                       publish=publish)
    a_keys, b_keys = keys("a", 3), keys("b", 3)
    # a: 48 prompt tokens (3 full pages) + 16 output = 4 pages, the whole device pool.
    a = Job(request(0, 48, 16), a_keys, 0.0)
    worker.enqueue(a)
    assert worker.start_next(0.0) is a
    worker.finish_prefill(a)
    worker.finish_decode(a, 1.0)  # a's 3 pages stay cached on the device
    # b needs all 4 pages: a's cached pages are evicted, and move to host memory.
    b = Job(request(1, 48, 16), b_keys, 1.0)
    worker.enqueue(b)
    assert worker.start_next(1.0) is b
    assert b.host_tokens == b.cached_tokens == 0
    assert isinstance(events[-1], PagesStored) and events[-1].tier is Tier.CPU
    assert sorted(events[-1].keys) == sorted(a_keys)
    assert index.match_detail(a_keys)["w0"].lower_tier_pages == 3  # the router sees it there
    worker.finish_prefill(b)
    worker.finish_decode(b, 2.0)
    # c repeats a's prompt plus 8 tokens: its 3 full pages are host hits. Pinned, then 4
    # device pages allocated (b's cached pages move down), then a's copied back up.
    seen = len(events)
    c = Job(request(2, 56, 8), a_keys, 2.0)
    worker.enqueue(c)
    assert worker.start_next(2.0) is c
    assert [(type(e), getattr(e, "tier", None)) for e in events[seen:]] == [
        (PagesStored, Tier.CPU), (PagesStored, Tier.GPU)]
    assert sorted(events[seen].keys) == sorted(b_keys)
    assert sorted(events[seen + 1].keys) == sorted(a_keys)
    assert (c.cached_tokens, c.host_tokens, c.uncached_tokens) == (48, 48, 8)
    # Copy 48 tokens back (48 ms), then compute 8 tokens (80 ms): the first token at 2.128.
    assert c.prefill_end_s == pytest.approx(2.0 + 0.048 + 0.08)
    detail = index.match_detail(a_keys)["w0"]
    assert (detail.pages, detail.lower_tier_pages) == (3, 0)  # back on the device
    assert index.match_detail(b_keys)["w0"].lower_tier_pages == 3
    worker.cache.check_integrity()


def test_a_decode_ending_during_the_copy_back_does_not_shorten_it() -> None:
    # 100 prefill tokens/s, steps of 2 prefill tokens; a decode of context 10 + 2 // 2 = 11
    # costs 1 + 11 / 11 = 2 prefill tokens: one decode halves the rate. A copy: 10 ms a token.
    cost = CostModel(prefill_tokens_per_s=100, decode_s_per_token=0.2, step_prefill_tokens=2,
                     kv_read_tokens=11,
                     tiers=TierCosts(kv_bytes_per_token=1000, host_to_device_bytes_per_s=1e5))
    worker = SimWorker("w0", 6, host_pages=8, namespace=Namespace(model="t", page_size=PAGE),
                       hasher=PageHasher(HashConfig(b"k" * 32, page_size=PAGE)), cost=cost)

    def run(job: Job, start: float, end: float | None) -> None:
        worker.enqueue(job)
        assert worker.start_next(start) is job
        worker.finish_prefill(job)
        if end is not None:
            worker.finish_decode(job, end)

    run(Job(request(0, 48, 16), keys("a", 3), 0.0), 0.0, 1.0)  # a: 3 pages cached
    run(Job(request(1, 80, 16), keys("b", 5), 1.0), 1.0, 2.0)  # all 6 pages: a moves to host
    decoder = Job(request(2, 10, 2), [], 2.0)
    run(decoder, 2.0, None)  # decodes from 2.1 s to 2.5 s
    again = Job(request(3, 50, 1), keys("a", 3), 2.1)
    worker.enqueue(again)
    assert worker.start_next(2.1) is again
    # 48 host tokens: a 0.48 s copy, then 2 tokens at 50/s (the decode beside): 2.62.
    assert (again.host_tokens, again.uncached_tokens) == (48, 2)
    assert again.prefill_end_s == pytest.approx(2.1 + 0.48 + 0.04)
    # The decode ends mid-copy (2.5 s): the compute, not yet begun, now runs at 100/s.
    assert worker.finish_decode(decoder, 2.5) is again
    assert again.prefill_end_s == pytest.approx(2.1 + 0.48 + 0.02)


# ---- a fleet on the slice -----------------------------------------------------------------

@pytest.fixture(scope="module")
def small_device() -> tuple[SimulationReport, SimulationReport]:
    """The slice's first 150 requests on 2 workers of 30,000 device tokens, without and with
    400,000 host tokens each (one seed: the point is the tier, not the spread)."""
    runs = [simulate(TRACE, workers=2, capacity_tokens=30_000, host_capacity_tokens=host,
                     policies=["round_robin", "kv_aware", "dynamo_like"], seeds=1, limit=150)
            for host in (0, 400_000)]
    return runs[0], runs[1]


def test_a_host_tier_raises_the_hit_ratio_when_the_device_is_small(
    small_device: tuple[SimulationReport, SimulationReport],
) -> None:
    without, with_host = (to_json(r) for r in small_device)
    assert with_host["host_capacity_tokens"] == 400_000
    assert without["bounds"]["pooled_host"] == without["bounds"]["pooled"]
    assert with_host["bounds"]["pooled_host"] > with_host["bounds"]["pooled"]
    assert with_host["bounds"]["pooled"] == without["bounds"]["pooled"]
    for name in ("round_robin", "kv_aware", "dynamo_like"):
        before, after = without["policies"][name], with_host["policies"][name]
        assert before["host_hit_ratio"] == 0.0
        assert after["hit_ratio"] > before["hit_ratio"], name
        assert 0.0 < after["host_hit_ratio"] <= after["hit_ratio"], name


def test_prefill_and_cached_tokens_add_up_to_the_prompts_with_a_host_tier(
    small_device: tuple[SimulationReport, SimulationReport],
) -> None:
    total = sum(r.input_length for r in load_trace(TRACE, limit=150))
    for report in small_device:
        for name, runs in report.runs.items():
            for run in runs:
                assert sum(run.cached_tokens) + sum(run.worker_prefill_tokens) == total, name
                assert all(h <= c for h, c in zip(run.host_tokens, run.cached_tokens,
                                                  strict=True))
        for numbers in to_json(report)["policies"].values():
            assert numbers["prefill_tokens"] + numbers["cached_tokens"] == total
            assert numbers["host_hit_ratio"] <= numbers["hit_ratio"]
    assert json.loads(json.dumps(to_json(small_device[1])))  # plain JSON


# ---- dynamo_like's tier rule -----------------------------------------------------------------

def test_dynamo_like_credits_a_host_hit_three_quarters_of_a_device_hit() -> None:
    # Prompt: 8 full pages (128 tokens). w0 holds all 8 in host memory: credit 0.75 x 8 = 6
    # blocks, 128 - 96 = 32 new tokens (2 blocks). w1 holds 7 on the device: credit 7, 16 new
    # tokens (1 block). decode_blocks = 8 on both. logits 10 and 9: w1, although a tier-blind
    # overlap (8 against 7) would pick w0.
    index = PrefixIndex(clock=lambda: 0.0)
    prompt = keys("p", 8)
    index.store("w0", prompt, Tier.CPU)
    index.store("w1", prompt[:7])
    router = DynamoLikeRouter(context(2, index))
    assert router.route(job(prompt, 8 * PAGE), index.match_detail(prompt), 0.0) == 1
    # Equal depths, one on the device and one in host memory: the device wins every seed.
    index = PrefixIndex(clock=lambda: 0.0)
    index.store("w0", prompt, Tier.CPU)
    index.store("w1", prompt)
    for seed in range(5):
        router = DynamoLikeRouter(context(2, index, seed))
        assert router.route(job(prompt, 8 * PAGE), index.match_detail(prompt), 0.0) == 1
