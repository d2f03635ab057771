"""Benchmarks of the pure core (hashing, prefix index) and of NVIDIA Dynamo's Rust peer.

Every function returns a flat dict of numbers; the `make bench` runner prints and writes them.
Timings use ``time.perf_counter_ns``; each figure is the median over repeated runs. Units are
in the key names (``_us`` microseconds, ``_per_s`` rates).

Workload ("realistic" for a chat fleet): prompts of 4,096 tokens (256 pages of 16), each
starting with one of 16 shared 1,024-token system prompts followed by its own 3,072 tokens;
``prompts_per_worker`` prompts per worker, prompt i cached on worker i mod W. Queries are
prompts of that population (a full hit on one worker, the system prompt on many).
"""

from __future__ import annotations

import json
import random
import statistics
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from coordinator.core.hashing import HashAlgorithm, HashConfig, Namespace, PageHasher
from coordinator.core.index import PrefixIndex
from coordinator.core.index.holdings import compiled_available

PAGE = 16
# Routes in flight while match_detail is timed, each with its prompt's pages pending on a
# worker (the router marks what it sends there): a router under load walks these too.
PENDING_ROUTES = 256
PROMPT_TOKENS = 4096
SYSTEM_TOKENS = 1024
SYSTEM_PROMPTS = 16
TURNS = 10
TURN_TOKENS = 400
_KEY = bytes(range(32))


@dataclass(frozen=True, slots=True)
class Workload:
    prompts: list[list[int]]  # token ids
    owners: list[int]  # worker index of each prompt


def make_workload(workers: int, prompts_per_worker: int = 8, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    systems = [_random_tokens(rng, SYSTEM_TOKENS) for _ in range(SYSTEM_PROMPTS)]
    prompts = [
        rng.choice(systems) + _random_tokens(rng, PROMPT_TOKENS - SYSTEM_TOKENS)
        for _ in range(workers * prompts_per_worker)
    ]
    return Workload(prompts, [i % workers for i in range(len(prompts))])


def conversation(seed: int = 1) -> list[list[int]]:
    """The token lists of a 10-turn conversation, each turn appending ~400 tokens."""
    rng = random.Random(seed)
    history: list[int] = []
    turns = []
    for _ in range(TURNS):
        history = history + _random_tokens(rng, TURN_TOKENS + rng.randrange(-8, 9))
        turns.append(history)
    return turns


def bench_hashing(repeats: int = 7) -> dict[str, float]:
    """Per-4,096-token cost cold and warm, and a 10-turn conversation, per algorithm;
    ``<algorithm>_cache_mismatches``: prompts whose keys through the chain cache differ from an
    uncached hasher's (must be 0).

    ``conv_cached_us``: every turn hashed in full through one cached hasher (what the
    coordinator does); ``conv_uncached_us``: the same without a cache; ``conv_new_pages_us``:
    hashing each page exactly once (the lower bound the cache approaches).
    """
    out: dict[str, float] = {}
    for algorithm in HashAlgorithm:
        label = algorithm.value.split("-")[0]
        for name, value in _bench_algorithm(HashConfig(_KEY, algorithm), repeats).items():
            out[f"{label}_{name}"] = value
    return out


def _bench_algorithm(config: HashConfig, repeats: int) -> dict[str, float]:
    ns = Namespace()
    rng = random.Random(2)
    prompts = [_random_tokens(rng, PROMPT_TOKENS) for _ in range(repeats)]
    hasher = PageHasher(config)
    cold = [_time_ns(lambda p=p: hasher.page_keys(p, ns)) for p in prompts]
    warm = [_time_ns(lambda p=p: hasher.page_keys(p, ns)) for p in prompts]
    turns = conversation()

    def whole_conversation(cache_pages: int) -> None:
        h = PageHasher(config, cache_pages=cache_pages)
        for turn in turns:
            h.page_keys(turn, ns)

    # The chain cache must change nothing but the time: every key as an uncached hasher's.
    uncached = PageHasher(config, cache_pages=0)
    mismatches = sum(hasher.page_keys(p, ns) != uncached.page_keys(p, ns) for p in prompts)
    cached = PageHasher(config, cache_pages=262_144)
    mismatches += sum(cached.page_keys(t, ns) != uncached.page_keys(t, ns) for t in turns)
    return {
        "cache_mismatches": mismatches,
        "4096_cold_us": statistics.median(cold) / 1e3,
        "4096_warm_us": statistics.median(warm) / 1e3,
        "conv_cached_us": _median_us(lambda: whole_conversation(262_144), repeats),
        "conv_uncached_us": _median_us(lambda: whole_conversation(0), repeats),
        "conv_new_pages_us": _median_us(
            lambda: PageHasher(config, cache_pages=0).page_keys(turns[-1], ns), repeats
        ),
    }


def bench_index(workers: int, prompts_per_worker: int = 8, repeats: int = 3,
                accelerated: bool | None = None) -> dict[str, float]:
    """Store throughput and match latency for 256-page prompts over ``workers`` workers;
    ``owner_misses``: stored prompts that do not match in full on their owner (must be 0).
    ``accelerated``: the index's holdings (None: as ``make_holdings`` picks)."""
    load = make_workload(workers, prompts_per_worker)
    hasher = PageHasher(HashConfig(_KEY))
    keys = [hasher.page_keys(p, Namespace()) for p in load.prompts]
    return {"workers": workers, **_bench_prefix_index(load, keys, repeats, accelerated)}


def _sync_batches(keys: list[list[bytes]]) -> list[bytes]:
    """Each prompt's keys as the serialized ``EventBatch`` a worker sends (one stored event)."""
    from coordinator.v1 import coordinator_pb2 as pb

    return [pb.EventBatch(seq=i + 1, events=[pb.PageEvent(
        kind=pb.PageEvent.KIND_STORED, page_keys=b"".join(k), tier=pb.TIER_GPU)],
    ).SerializeToString() for i, k in enumerate(keys)]


def _bench_prefix_index(load: Workload, keys: list[list[bytes]], repeats: int,
                        accelerated: bool | None = None) -> dict[str, float]:
    """Store from serialized ``Sync`` batches (parsed, converted and applied as the servicer
    does: the same start as Dynamo's JSON events), then match. ``match_detail`` is timed with
    ``PENDING_ROUTES`` routes' pages pending on workers that do not hold them (the index's
    clock stands still meanwhile, so none expires): ``pending_matches`` is how many timed
    queries met a pending entry (0 would mean the pending walk never ran)."""
    from coordinator.sync_codec import events_from_pb
    from coordinator.v1 import coordinator_pb2 as pb

    names = [f"worker-{w}" for w in sorted(set(load.owners))]
    pages = sum(map(len, keys))
    batches = _sync_batches(keys)
    store_s: list[float] = []
    still = time.monotonic()  # pending entries added below stay live while they are timed
    index = PrefixIndex(clock=lambda: still, accelerated=accelerated)
    parse = pb.EventBatch.FromString
    for _ in range(repeats):
        index = PrefixIndex(clock=lambda: still, accelerated=accelerated)
        start = time.perf_counter_ns()
        for owner, batch in zip(load.owners, batches, strict=True):
            index.apply(names[owner], events_from_pb(parse(batch)))
        store_s.append((time.perf_counter_ns() - start) / 1e9)
    queries = random.Random(3).choices(keys, k=2000)
    match = _latencies_us(index.match, queries, repeats)
    # Routes in flight: a timed query's pages pending on the next worker after its holder's.
    pending = 0
    for i, routed in enumerate(queries[:PENDING_ROUTES]):
        holder = next(iter(index.match(routed)), names[0])
        pending += index.add_pending(names[(names.index(holder) + 1 + i) % len(names)], routed)
    detail = _latencies_us(lambda q: index.match_detail(q, include_pending=True), queries, repeats)
    pending_matches = sum(any(d.pending_pages for d in index.match_detail(
        q, include_pending=True).values()) for q in queries)
    # Every stored prompt must match in full on the worker that stored it.
    owner_misses = sum(index.match(k).get(names[owner], 0) != len(k)
                       for owner, k in zip(load.owners, keys, strict=True))
    return {
        "owner_misses": owner_misses,
        "pages": pages,
        "store_pages_per_s": pages / statistics.median(store_s),
        "match_p50_us": match[0],
        "match_mean_us": match[1],
        "match_detail_p50_us": detail[0],
        "pending_keys": pending,
        "pending_matches": pending_matches,
        "holders_of_first_page": len(index.match(queries[0][:1])),
    }


def bench_dynamo_peer(
    worker_counts: Sequence[int] = (64, 1024), prompts_per_worker: int = 8, repeats: int = 3
) -> dict[str, float] | None:
    """The same workloads through NVIDIA Dynamo's Rust radix tree (``ai-dynamo-runtime``),
    and ours on the same inputs in the same run.

    ``speedup.<what>`` is Dynamo's time over ours (ours faster => > 1.0): ``hash_4096_*``
    (one 4,096-token prompt, cold and warm chain cache, against Dynamo's per-block xxh3, which
    has no cache), ``hash_conversation_*`` (a 10-turn conversation), ``w<N>_store``,
    ``w<N>_match`` (p50) and ``w<N>_match_detail`` (ours with pending, p50).

    Calls used: ``compute_block_hash_for_seq(tokens, kv_block_size) -> list[int]`` (per-block
    xxh3 of the block's tokens; Dynamo chains them in the tree, and re-hashes every block on
    every request), ``RadixTree().apply_event(worker_id: int, event_json: bytes)`` with a
    ``{"event_id", "data": {"stored": {"parent_hash", "blocks": [{"block_hash",
    "tokens_hash"}]}}, "dp_rank"}`` event, ``RadixTree.find_matches(local_hashes).scores ->
    {(worker_id, dp_rank): blocks}``. The tree applies
    events on a background thread, so a store run is timed up to the first find_matches
    after it. Returns None when ``dynamo._core`` does not import.
    """
    try:
        from dynamo._core import compute_block_hash_for_seq
    except ImportError:
        return None
    rng = random.Random(2)
    out: dict[str, float] = {}
    prompts = [_random_tokens(rng, PROMPT_TOKENS) for _ in range(max(repeats, 7))]
    dynamo_hash = (
        statistics.median(
            _time_ns(lambda p=p: compute_block_hash_for_seq(p, PAGE)) for p in prompts
        )
        / 1e3
    )
    out["xxh3_4096_us"] = dynamo_hash
    turns = conversation()
    out["conv_us"] = _median_us(
        lambda: [compute_block_hash_for_seq(t, PAGE) for t in turns], repeats
    )
    # Ours on the same prompts, in the same run (speedup > 1: ours is faster).
    for algorithm in HashAlgorithm:
        label = algorithm.value.split("-")[0]
        ours = _bench_algorithm(HashConfig(_KEY, algorithm), len(prompts))
        for phase in ("cold", "warm"):
            out[f"ours_{label}_4096_{phase}_us"] = ours[f"4096_{phase}_us"]
            out[f"speedup.hash_4096_{label}_{phase}"] = dynamo_hash / ours[f"4096_{phase}_us"]
        out[f"ours_{label}_conv_cached_us"] = ours["conv_cached_us"]
        out[f"speedup.hash_conversation_{label}"] = out["conv_us"] / ours["conv_cached_us"]
    paths = [(True, ""), (False, "pure_")] if compiled_available() else [(False, "pure_")]
    for workers in worker_counts:
        load = make_workload(workers, prompts_per_worker)
        hasher = PageHasher(HashConfig(_KEY))
        keys = [hasher.page_keys(p, Namespace()) for p in load.prompts]
        theirs = _bench_radix_tree(load, keys, repeats)
        w = f"w{workers}"
        for name, value in theirs.items():
            out[f"{w}_{name}"] = value
        for accelerated, path in paths:  # the compiled index core, then pure Python
            ours = _bench_prefix_index(load, keys, repeats, accelerated)
            for name in ("store_pages_per_s", "match_p50_us", "match_detail_p50_us"):
                out[f"{w}_ours_{path}{name}"] = ours[name]
            out[f"speedup.{w}_{path}store"] = (ours["store_pages_per_s"]
                                               / theirs["store_pages_per_s"])
            out[f"speedup.{w}_{path}match"] = theirs["match_p50_us"] / ours["match_p50_us"]
            # match_detail(include_pending=True): the router's whole walk (pending-inclusive
            # and confirmed depths) against the same find_matches.
            out[f"speedup.{w}_{path}match_detail"] = (theirs["match_p50_us"]
                                                      / ours["match_detail_p50_us"])
    return out


def bench_index_memory(unique_keys: int, workers: int = 256,
                       accelerated: bool | None = None) -> dict[str, float]:
    """Bytes per unique key of an index holding ``unique_keys`` keys, each on one of
    ``workers`` workers (stored in 64-key batches, round robin), by tracemalloc (every
    allocation the index made, the compiled table's included) and by RSS growth."""
    import tracemalloc

    def rss_bytes() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096

    names = [f"worker-{w}" for w in range(workers)]
    tracemalloc.start()
    rss_before, traced_before = rss_bytes(), tracemalloc.get_traced_memory()[0]
    index = PrefixIndex(clock=time.monotonic, accelerated=accelerated)
    start = time.perf_counter()
    for batch in range(0, unique_keys, 64):
        index.store(names[(batch // 64) % workers], _unique_keys(batch, unique_keys))
    seconds = time.perf_counter() - start
    traced = tracemalloc.get_traced_memory()[0] - traced_before
    tracemalloc.stop()
    rss = rss_bytes() - rss_before
    stats = index.stats()
    return {
        "unique_keys": stats.keys,
        "traced_bytes_per_key": traced / stats.keys,
        "rss_bytes_per_key": rss / stats.keys,
        "store_s": seconds,
    }


def bench_slot_reads(unique_keys: int, workers: int = 64, repeats: int = 5,
                     accelerated: bool | None = None) -> dict[str, float]:
    """One worker's keys read (``worker_keys``, ``worker_inventory``) and resynced
    (``replace_worker`` with the inventory it holds: a reconnect's usual resync) in an index of
    ``unique_keys`` keys spread over ``workers`` workers (64-key batches, round robin), ms per
    call, median of ``repeats``.

    The baseline, measured in the same run: ``table_pass_ms``, every worker's inventory at once
    (``worker_inventories``), the whole table read through the same path. ``table_pass_over_one``
    is how many one-worker inventories that costs: about ``workers`` or more when a call costs
    the worker's keys, far fewer when each call scans the table (21 at 10^6 keys before issue
    29). ``wrong_keys``: keys ``worker_keys`` read back other than those stored (must be 0)."""
    names = [f"worker-{w}" for w in range(workers)]
    index = PrefixIndex(clock=time.monotonic, accelerated=accelerated)
    one, stored = names[1], set[bytes]()
    for batch in range(0, unique_keys, 64):
        keys = _unique_keys(batch, unique_keys)
        index.store(names[(batch // 64) % workers], keys)
        if (batch // 64) % workers == 1:
            stored.update(keys)
    inventory = index.worker_inventory(one)
    one_ms = _median_us(lambda: index.worker_inventory(one), repeats) / 1e3
    table_ms = _median_us(lambda: index.worker_inventories(names), repeats) / 1e3
    return {
        "unique_keys": unique_keys,
        "workers": workers,
        "wrong_keys": len(index.worker_keys(one) ^ stored),
        "worker_keys_ms": _median_us(lambda: index.worker_keys(one), repeats) / 1e3,
        "replace_worker_ms": _median_us(lambda: index.replace_worker(one, inventory),
                                        repeats) / 1e3,
        "worker_inventory_ms": one_ms,
        "table_pass_ms": table_ms,
        "table_pass_over_one": table_ms / one_ms,
    }


def _unique_keys(first: int, end: int, batch: int = 64) -> list[bytes]:
    """Keys ``first`` up to ``min(first + batch, end)`` (exclusive) of a reproducible set of
    16-byte keys."""
    import hashlib

    return [hashlib.blake2b(n.to_bytes(8, "little"), digest_size=16).digest()
            for n in range(first, min(first + batch, end))]


def _bench_radix_tree(load: Workload, keys: list[list[bytes]], repeats: int) -> dict[str, float]:
    from dynamo._core import RadixTree, compute_block_hash_for_seq

    local = [compute_block_hash_for_seq(p, PAGE) for p in load.prompts]
    events = []
    for i, (prompt_keys, hashes) in enumerate(zip(keys, local, strict=True)):
        # block_hash: any chained per-prefix id will do; our keys' first 8 bytes serve.
        chained = [int.from_bytes(k[:8], "little") for k in prompt_keys]
        blocks = [{"block_hash": b, "tokens_hash": t} for b, t in zip(chained, hashes, strict=True)]
        stored = {"stored": {"parent_hash": None, "blocks": blocks}}
        events.append(json.dumps({"event_id": i, "data": stored, "dp_rank": 0}).encode())
    store_s = []
    tree: Any = None
    for _ in range(repeats):
        tree = RadixTree()
        start = time.perf_counter_ns()
        for owner, event in zip(load.owners, events, strict=True):
            tree.apply_event(owner, event)
        tree.find_matches(local[0])  # returns once the background thread has caught up
        store_s.append((time.perf_counter_ns() - start) / 1e9)
    queries = random.Random(3).choices(local, k=2000)
    p50, mean = _latencies_us(lambda q: tree.find_matches(q).scores, queries, repeats)
    return {
        "store_pages_per_s": sum(map(len, local)) / statistics.median(store_s),
        "match_p50_us": p50,
        "match_mean_us": mean,
    }


def _random_tokens(rng: random.Random, n: int) -> list[int]:
    # randbytes is ~50x faster than n randrange calls; ids below 2**17 like a real vocabulary.
    raw = array("I", rng.randbytes(4 * n))
    return [t & 0x1FFFF for t in raw]


def _time_ns(fn: Callable[[], object]) -> int:
    start = time.perf_counter_ns()
    fn()
    return time.perf_counter_ns() - start


def _median_us(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm up imports and allocator
    return statistics.median(_time_ns(fn) for _ in range(repeats)) / 1e3


def _latencies_us(
    fn: Callable[[Any], object], queries: Sequence[Any], repeats: int
) -> tuple[float, float]:
    """(median of per-run p50, median of per-run mean) over ``repeats`` passes of queries."""
    p50s, means = [], []
    for _ in range(repeats):
        lat = [_time_ns(lambda q=q: fn(q)) for q in queries]
        p50s.append(statistics.median(lat) / 1e3)
        means.append(statistics.fmean(lat) / 1e3)
    return statistics.median(p50s), statistics.median(means)
