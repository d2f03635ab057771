"""Re-statements of the two best-known peer routing policies, for comparison in ``simulate``.

Written from the peers' source and documentation (facts, not code), each with its published
defaults; neither is tuned here. Units: a *block* is one of our pages (``page_size`` tokens).

``sglang_like`` -- SGLang's model gateway ``cache_aware`` policy as ``smg`` 0.3.2 (PyPI
``sglang-router==0.3.2``) runs it (sgl-project/sglang ``sgl-router/src/policies/
cache_aware.rs``; lightseekorg/smg ``docs/concepts/routing/cache-aware.md``; and checked
against the real ``smg`` by ``kvcoord bench engines``, docs/ENGINES.md):

- Load = requests the router sent to a worker that have not completed (its own count: it
  proxies the responses, so it sees each completion at once).
- If ``max_load - min_load > balance_abs_threshold`` **and** ``max_load > min_load *
  balance_rel_threshold`` the fleet is imbalanced: pick the least-loaded worker.
- Otherwise find the worker whose *approximate tree* (the prompts the router itself sent
  there, not the worker's real cache) matches the longest prefix; if the match rate
  (matched / prompt length) exceeds ``cache_threshold`` pick it, else pick the least-loaded
  worker (the older sgl-router picked the smallest tree here; ``smg`` 0.3.2 picks by load, as
  the engines bench observed: one request at a time, every low-match prompt went to its
  first worker). Either way the prompt is inserted into the chosen worker's tree.
- Every ``eviction_interval`` seconds each tree over ``max_tree_size`` drops least recently
  used leaves. Defaults (``smg`` 0.3.2): cache_threshold 0.3, balance_abs_threshold 64,
  balance_rel_threshold 1.5, eviction_interval 60 s, max_tree_size 67,108,864 (characters
  there; tokens here).
- Ties among equally long matches, which the Rust code leaves to hash-map order, are broken
  with the seeded rng here; ties in load go to the first worker (``min_by_key`` keeps it).
- **Tiers**: none. The approximate tree is the router's own record of what it sent, so it has
  no notion of where a worker keeps a page; with a host tier the worker simply serves more
  of what the router sent it (``acquire`` finds host hits), and the router does not know.

``dynamo_like`` -- NVIDIA Dynamo KV router (ai-dynamo/dynamo, ``lib/llm/src/kv_router/
scheduler.rs`` ``DefaultWorkerSelector::select_worker`` and ``sequence.rs``; docs "KV Router:
Cost Function", docs.nvidia.com/dynamo):

- ``logit = overlap_score_weight * prefill_blocks + decode_blocks``, lowest wins, with
  ``prefill_blocks = (active prefill tokens + request tokens - overlap_blocks * block_size)
  / block_size`` and ``decode_blocks = active blocks + the request's blocks not already
  active there``. ``overlap_blocks`` comes from an indexer fed by the workers' KV events
  (here: the production index, confirmed entries only, fed after the same Sync delay as for
  every policy); "active" = its own books of requests routed there and not finished, their
  prefill tokens until the first token (it sees the responses stream by). Defaults:
  overlap_score_weight 1.0, router_temperature 0.0 (deterministic argmin); ties go to the
  smallest tree (fewest blocks the indexer holds for the worker), then at random.
- **Tiers** ("router offloading": KV events carry the medium; ai-dynamo/dynamo
  ``lib/kv-router/src/scheduling/overlap.rs``, ``cache_hit_estimates_from_tiered_matches``
  and ``build_overlap_scores_response``; defaults in the docs' "Configuration and Tuning",
  ``--router-host-cache-hit-weight`` 0.75 and ``--router-disk-cache-hit-weight`` 0.25): the
  prompt-side credit is ``overlap_score_weight x device blocks + 0.75 x host blocks + 0.25 x
  disk blocks``, the lower-tier blocks being those matched past the device run; cached tokens
  = round(credit x block size), and ``new_tokens = isl - cached tokens`` in place of the
  device-only overlap above. Here the lower-tier blocks are the index's ``lower_tier_pages``
  of the confirmed run (the index keeps one tier per worker and key; the simulator's only
  lower tier is host memory, so the disk weight never applies).

Not simulated: llm-d's precise-prefix-cache scorer, which weighs each block by the tier it is
found in (``kvCacheBackendConfigs``: gpu 1.0, cpu 0.8; llm-d/llm-d-kv-cache-manager
``docs/configuration.md``) -- a host hit credited 0.8 of a device hit, near Dynamo's 0.75.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from coordinator.core.index import MatchDetail, PrefixIndex
from kvcoord.simulate.routers import RouterContext
from kvcoord.simulate.simworker import Job


@dataclass(frozen=True, slots=True)
class SglangConfig:
    """SGLang router cache_aware defaults (see the module docstring for the source)."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_s: float = 60.0
    max_tree_size: int = 67_108_864


class SglangLikeRouter:
    """SGLang's cache-aware rule over an approximate per-worker prefix tree.

    The tree is a second ``PrefixIndex`` fed by routing decisions (what the router *sent*),
    never by the workers' events: chained page keys make a flat key set a prefix tree. Each
    worker's keys also sit in an LRU (tail pages more recent than head pages, so leaves go
    first) for the periodic size eviction.
    """

    name = "sglang_like"

    def __init__(self, ctx: RouterContext, config: SglangConfig | None = None) -> None:
        self._ctx = ctx
        self.config = config or SglangConfig()
        self._tree = PrefixIndex(clock=lambda: 0.0)
        self._lru: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in ctx.worker_ids]
        self._load = [0] * len(ctx.worker_ids)
        self._next_eviction = self.config.eviction_interval_s

    def route(self, job: Job, details: Mapping[str, MatchDetail], now: float) -> int:
        cfg, loads = self.config, self._load
        if now >= self._next_eviction:
            self._evict()
            self._next_eviction = now + cfg.eviction_interval_s
        high, low = max(loads), min(loads)
        if high - low > cfg.balance_abs_threshold and high > low * cfg.balance_rel_threshold:
            chosen = loads.index(low)  # shortest queue; min_by_key keeps the first
        else:
            chosen = self._cache_choice(job)
        self._insert(chosen, job.keys)
        loads[chosen] += 1
        return chosen

    def on_prefill_done(self, worker: int, job: Job) -> None:
        """Nothing: SGLang's load counts whole requests."""

    def on_finished(self, worker: int, job: Job) -> None:
        self._load[worker] -= 1

    def _cache_choice(self, job: Job) -> int:
        ctx = self._ctx
        depths = self._tree.match(job.keys) if job.keys else {}
        best = max(depths.values(), default=0)
        tokens = job.request.input_length
        rate = best * ctx.page_size / tokens if tokens else 0.0
        if rate <= self.config.cache_threshold:
            return self._load.index(min(self._load))  # least loaded; min_by_key keeps the first
        pool = [i for i, worker_id in enumerate(ctx.worker_ids) if depths.get(worker_id) == best]
        return pool[0] if len(pool) == 1 else ctx.rng.choice(pool)

    def _insert(self, worker: int, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        self._tree.store(self._ctx.worker_ids[worker], keys)
        lru = self._lru[worker]
        for key in reversed(keys):  # head last: most recent, evicted after its tail
            lru[key] = None
            lru.move_to_end(key)

    def _evict(self) -> None:
        limit_pages = self.config.max_tree_size // self._ctx.page_size
        for i, lru in enumerate(self._lru):
            excess = len(lru) - limit_pages
            if excess > 0:
                victims = [lru.popitem(last=False)[0] for _ in range(excess)]
                self._tree.remove(self._ctx.worker_ids[i], victims)


@dataclass(frozen=True, slots=True)
class DynamoConfig:
    """Dynamo KV router defaults (see the module docstring for the source)."""

    overlap_score_weight: float = 1.0
    host_cache_hit_weight: float = 0.75
    disk_cache_hit_weight: float = 0.25  # no disk tier is simulated: kept for the record


class DynamoLikeRouter:
    """Dynamo's ``overlap_weight * prefill_blocks + decode_blocks`` selector, with its own
    active-sequence books (prefill tokens until the first token, blocks until the end)."""

    name = "dynamo_like"

    def __init__(self, ctx: RouterContext, config: DynamoConfig | None = None) -> None:
        self._ctx = ctx
        self.config = config or DynamoConfig()
        n = len(ctx.worker_ids)
        self._prefill_tokens = [0] * n
        self._active: list[dict[bytes, int]] = [{} for _ in range(n)]  # block -> sequences
        self._job_prefill: dict[int, int] = {}  # request index -> its counted prefill tokens

    def route(self, job: Job, details: Mapping[str, MatchDetail], now: float) -> int:
        ctx, keys = self._ctx, job.keys
        block, isl = ctx.page_size, job.request.input_length
        weight, host_weight = self.config.overlap_score_weight, self.config.host_cache_hit_weight
        best_logit, pool, new_tokens_of = float("inf"), [], [0] * len(ctx.worker_ids)
        for i, worker_id in enumerate(ctx.worker_ids):
            detail = details.get(worker_id)
            new_tokens = isl
            if detail is not None:
                overlap = detail.confirmed_pages
                lower = min(detail.lower_tier_pages, overlap)
                credit = (overlap - lower) + host_weight * lower  # blocks, tier-weighted
                new_tokens = max(0, isl - math.floor(credit * block + 0.5))  # Rust's round
            new_tokens_of[i] = new_tokens
            prefill_blocks = (self._prefill_tokens[i] + new_tokens) / block
            active = self._active[i]
            decode_blocks = len(active) + len(keys) - _active_prefix(active, keys)
            logit = weight * prefill_blocks + decode_blocks
            if logit < best_logit:
                best_logit, pool = logit, [i]
            elif logit == best_logit:
                pool.append(i)
        if len(pool) > 1:  # Dynamo: smallest tree (its indexer's) first, then arbitrary
            sizes = {i: ctx.index.held_count(ctx.worker_ids[i]) for i in pool}
            smallest = min(sizes.values())
            pool = [i for i in pool if sizes[i] == smallest]
        chosen = pool[0] if len(pool) == 1 else ctx.rng.choice(pool)
        self._prefill_tokens[chosen] += new_tokens_of[chosen]
        self._job_prefill[job.request.index] = new_tokens_of[chosen]
        active = self._active[chosen]
        for key in keys:
            active[key] = active.get(key, 0) + 1
        return chosen

    def on_prefill_done(self, worker: int, job: Job) -> None:
        self._prefill_tokens[worker] -= self._job_prefill.pop(job.request.index)

    def on_finished(self, worker: int, job: Job) -> None:
        active = self._active[worker]
        for key in job.keys:
            left = active[key] - 1
            if left:
                active[key] = left
            else:
                del active[key]


def _active_prefix(active: Mapping[bytes, int], keys: Sequence[bytes]) -> int:
    """How many leading ``keys`` are active. Keys are chained, so an active key's whole prefix
    is active too: membership is monotone along the prompt and a binary search finds it."""
    lo, hi = 0, len(keys)
    while lo < hi:
        mid = (lo + hi) // 2
        if keys[mid] in active:
            lo = mid + 1
        else:
            hi = mid
    return lo
