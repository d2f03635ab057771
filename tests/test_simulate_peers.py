"""The peer routing rules of `kvcoord simulate`, worked by hand on a few workers.

Every expected worker below is computed in the comments from the rule as the peers publish it
(kvcoord/simulate/peers.py cites the sources), with their default constants.
"""

from __future__ import annotations

import random

from coordinator.core.index import PrefixIndex
from coordinator.core.routing import KvAwareWeights
from kvcoord.simulate.peers import DynamoLikeRouter, SglangLikeRouter
from kvcoord.simulate.routers import RouterContext
from kvcoord.simulate.simworker import Job
from kvcoord.simulate.trace import TraceRequest
from kvcoord.simulate.views import CoordinatorLoads

PAGE = 16


def keys(prefix: str, n: int, start: int = 0) -> list[bytes]:
    """``n`` distinct 16-byte page keys named ``prefix``; equal names are equal pages."""
    return [f"{prefix}{i:015d}".encode() for i in range(start, start + n)]


def context(workers: int, index: PrefixIndex | None = None, seed: int = 0) -> RouterContext:
    ids = [f"w{i}" for i in range(workers)]
    return RouterContext(ids, index or PrefixIndex(clock=lambda: 0.0), PAGE,
                         random.Random(seed), KvAwareWeights(), CoordinatorLoads(ids, 100))


_serial = iter(range(10**6))


def job(page_keys: list[bytes], tokens: int) -> Job:
    return Job(TraceRequest(next(_serial), 0.0, tokens, 1, ()), page_keys, 0.0)


# ---- sglang_like: cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5 ----

def test_sglang_like_follows_the_longest_match_above_the_threshold_else_the_least_loaded() -> None:
    router = SglangLikeRouter(context(3))
    a = keys("a", 12)
    # All trees empty: match rate 0 <= 0.3, so the least loaded; all three hold 0 requests and
    # the first, w0, wins (smg's min_by_key keeps the first).
    assert router.route(job(a[:10], 160), {}, 0.0) == 0
    # a[:12] matches 10 pages of w0's tree: 160 / 192 tokens = 0.83 > 0.3 -> w0, though busier.
    assert router.route(job(a[:12], 192), {}, 0.0) == 0
    # A disjoint prompt matches nothing: the least loaded, w1 (w0 has 2 in flight).
    assert router.route(job(keys("b", 10), 160), {}, 0.0) == 1
    # 2 pages of a, then 8 new: 32 / 160 tokens = 0.2 <= 0.3 -> the least loaded, w2.
    assert router.route(job(a[:2] + keys("c", 8), 160), {}, 0.0) == 2
    # 4 pages of a, then 6 new: 64 / 160 = 0.4 > 0.3 -> the tree holding them, w0.
    assert router.route(job(a[:4] + keys("d", 6), 160), {}, 0.0) == 0
    # Its finished requests free w0: 3 in flight -> 0; a low-match prompt then goes there.
    for _ in range(3):
        router.on_finished(0, job([], 1))
    assert router.route(job(keys("e", 10), 160), {}, 0.0) == 0


def test_sglang_like_balances_once_in_flight_requests_differ_by_more_than_64() -> None:
    router = SglangLikeRouter(context(2))
    p = keys("p", 12)
    assert router.route(job(p[:10], 160), {}, 0.0) == 0  # nothing matches: least loaded, w0
    # The same prompt matches fully (rate 1.0 > 0.3) and sticks to w0 while the fleet counts as
    # balanced. Imbalanced means max - min > 64 AND max > 1.5 x min; before route k the
    # in-flight counts are k-1 vs 0, so routes 2..65 stay on w0.
    for _ in range(2, 66):
        assert router.route(job(p[:10], 160), {}, 0.0) == 0
    # 65 vs 0: 65 - 0 > 64 and 65 > 0 x 1.5 -> imbalanced: the least loaded, w1, though w0
    # holds 10 of this prompt's 12 pages.
    assert router.route(job(p, 192), {}, 0.0) == 1
    # 65 vs 1: 64 is not > 64 -> cache-aware again, and p follows its longest match, w1 (12
    # pages against 10).
    assert router.route(job(p, 192), {}, 0.0) == 1


# ---- dynamo_like: logit = 1.0 x prefill_blocks + decode_blocks, lowest wins ----------------

def test_dynamo_like_scores_overlap_against_active_prefill_and_blocks() -> None:
    index = PrefixIndex(clock=lambda: 0.0)
    a = keys("a", 8)
    index.store("w0", a[:6])  # the indexer has seen w0 store a[0:6]
    router = DynamoLikeRouter(context(2, index))
    r1 = job(a, 8 * PAGE + 8)  # 8 full pages + 8 tokens = 136 tokens
    # w0: overlap 6 pages -> new tokens 136 - 96 = 40 -> prefill_blocks 40/16 = 2.5;
    #     decode_blocks = 0 active + 8 request blocks - 0 already active = 8 -> logit 10.5
    # w1: new 136 -> 8.5; decode 8 -> 16.5.  w0 wins.
    assert router.route(r1, index.match_detail(a, include_pending=True), 0.0) == 0
    b = keys("b", 4)
    r2 = job(b, 4 * PAGE)  # 64 tokens
    # w0: prefill (40 active + 64) / 16 = 6.5; decode 8 active + 4 - 0 = 12 -> 18.5
    # w1: prefill 64 / 16 = 4;             decode 0 + 4 - 0 = 4   -> 8.    w1 wins.
    assert router.route(r2, index.match_detail(b, include_pending=True), 0.0) == 1
    r3 = job(a, 8 * PAGE + 8)
    # w0: overlap still 6 (r1's pages are not stored yet) -> new 40; prefill (40 + 40)/16 = 5;
    #     decode 8 active + 8 - 8 already active = 8 -> 13
    # w1: prefill (64 + 136)/16 = 12.5; decode 4 + 8 - 0 = 12 -> 24.5.    w0 wins.
    assert router.route(r3, index.match_detail(a, include_pending=True), 0.0) == 0
    # r1 and r3 reach their first token; r2 still prefills on w1. A new 8-block prompt c:
    router.on_prefill_done(0, r1)
    router.on_prefill_done(0, r3)
    c = keys("c", 8)
    # w0: prefill 0 + 128 -> 8; decode 8 active (a, held by r1 and r3) + 8 - 0 = 16 -> 24
    # w1: prefill (64 + 128)/16 = 12; decode 4 + 8 = 12 -> 24.  A tie: the smaller tree in
    # the indexer wins: w0 holds 6 blocks there, w1 none -> w1.
    assert router.route(job(c, 8 * PAGE), index.match_detail(c, include_pending=True),
                        0.0) == 1


def test_dynamo_like_frees_blocks_when_requests_finish() -> None:
    router = DynamoLikeRouter(context(2))
    a = keys("a", 4)
    r1 = job(a, 4 * PAGE)
    # Both cold and idle: w0 and w1 score 4 + 4 = 8; equal trees (0) -> the rng: `first`.
    first = router.route(r1, {}, 0.0)
    router.on_prefill_done(first, r1)
    # A disjoint 2-block prompt: `first` 2 + (4 active + 2) = 8, the other 2 + 2 = 4 -> other.
    b = keys("b", 2)
    assert router.route(job(b, 2 * PAGE), {}, 0.0) == 1 - first
    router.on_finished(first, r1)
    # r1 done: `first` 2 + 2 = 4; the other has b's prefill (32 tokens) and 2 active blocks:
    # (32 + 32)/16 + (2 + 2) = 8 -> first.
    assert router.route(job(keys("c", 2), 2 * PAGE), {}, 0.0) == first
