"""The SDK's value types: what the clients return (routes, lookups, policy state, workers, stats)
and ``PageKeys``, a prompt already hashed into page keys."""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.core.hashing import PAGE_KEY_BYTES


@dataclass(frozen=True, slots=True)
class PageKeys:
    """A prompt sent as page keys (trusted roles): concatenated 16-byte digests."""

    keys: bytes
    token_count: int | None = None

    def __post_init__(self) -> None:
        if not self.keys or len(self.keys) % PAGE_KEY_BYTES:
            raise ValueError(
                f"page keys must be a non-empty multiple of {PAGE_KEY_BYTES} bytes, "
                f"got {len(self.keys)}"
            )


@dataclass(frozen=True, slots=True)
class LookupResult:
    matches: dict[str, int]  # worker id -> matched tokens
    policy_version: int
    prompt_pages: int = 0
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)
    """Worker id -> its matched tokens by tier (``{"gpu": n, "cpu": n, "disk": n}``, summing to
    ``matches[worker_id]``): a GPU hit is reused in place, a CPU or disk hit is copied back
    first. A coordinator older than these fields sends zeros for every tier."""


@dataclass(frozen=True, slots=True)
class Route:
    """A ``route`` answer: the chosen worker (its gRPC ``address``), the prompt's tokens it
    holds (``matched_tokens``, ``matched_pages``) and the ``policy_version`` it serves it at."""

    worker_id: str
    address: str
    matched_tokens: int
    policy_version: int
    matched_pages: int = 0
    routing_policy: str = ""
    http_url: str = ""
    """The worker's OpenAI-compatible base URL, where it registered one."""
    route_id: str = ""
    """This routing decision's id (unique per coordinator process)."""
    end_awaited: bool = False
    """Asked with ``report_end`` and the worker is external: call ``end_routes([route_id])``
    when the request ends (it counts as the worker's load until then)."""


@dataclass(frozen=True, slots=True)
class EndedRoutes:
    """An ``end_routes`` answer: routes now ended, and ids that changed nothing (already
    ended, expired, issued by another replica, or never awaited)."""

    ended: int
    unknown: int


@dataclass(frozen=True, slots=True)
class RouteBatch:
    """A ``route_batch`` answer: ``routes[i]`` answers ``prompts[i]`` (identical prompts share
    one route and its ``route_id``); ``order`` is a permutation of the prompt indices: run them
    in that order, so prompts sharing a prefix run back to back."""

    routes: list[Route]
    order: list[int]


@dataclass(frozen=True, slots=True)
class PolicyState:
    version: int
    phase: str  # "serving" | "draining"
    target_version: int | None = None
    mode: str = "sync"
    acked_workers: tuple[str, ...] = ()
    fenced_workers: tuple[str, ...] = ()
    # Members of the update in progress (or just committed) that reported a failure -> reason.
    failures: dict[str, str] = field(default_factory=dict)
    weights_uri: str = ""  # where ``version``'s weights load from ("" = seeded / the engine's own)


@dataclass(slots=True)
class PolicyUpdate:
    """An update in progress (``policy_update``): push weights for ``version``; after the
    block, ``result`` is the committed state (its acked and fenced workers)."""

    version: int
    begun: PolicyState
    result: PolicyState | None = None


@dataclass(frozen=True, slots=True)
class RolloutRecord:
    """Which policy version generated a sample, on which worker (invariant 4)."""

    rollout_id: str
    policy_version: int
    worker_id: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cursor: str


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    worker_id: str
    address: str
    policy_version: int
    state: str
    incarnation: int = 0
    external: bool = False
    cached_pages: int = 0
    total_pages: int = 0
    free_pages: int = 0
    running_requests: int = 0
    queued_tokens: int = 0
    inflight_routes: int = 0
    routed_requests: int = 0
    routed_tokens: int = 0
    routed_cached_tokens: int = 0
    owner_replica: str = ""
    http_url: str = ""
    host_pages: int = 0
    """Pages of the worker's host-memory tier as registered (``total_pages``: the device's)."""
    cached_gpu_pages: int = 0
    """Of ``cached_pages`` (the index's holdings of the worker), those in GPU, CPU and disk."""
    cached_cpu_pages: int = 0
    cached_disk_pages: int = 0
    prefill_backlog_tokens: float = 0.0
    """Prefill work ``kv_aware`` counts queued there (tokens), drained at
    ``prefill_tokens_per_s``: configured, then learned from the prefills it saw end."""
    prefill_tokens_per_s: float = 0.0
    prefill_route_seconds: float = 0.0
    """The fixed cost of a request there beside the rate, learned (0 until it can be told)."""
    prefill_attention_tokens: float = 0.0
    """The position at which a prompt token costs two at position 0 there, learned (0 until
    the measures show attention)."""

    @property
    def hit_ratio(self) -> float:
        return self.routed_cached_tokens / self.routed_tokens if self.routed_tokens else 0.0


@dataclass(frozen=True, slots=True)
class Stats:
    workers: int
    routable_workers: int
    index_keys: int
    index_entries: int
    pending_entries: int
    lookups: int
    routes: int
    prompt_tokens: int
    cached_tokens: int
    hit_ratio: float
    events_applied: int
    resyncs: int
    policy_version: int
    policy_phase: str
    store: str
    replica_id: str = ""
    replicas: tuple[str, ...] = ()
    replication_published: int = 0
    replication_applied: int = 0
    replication_lag_p50_ms: float = 0.0
    replication_lag_p99_ms: float = 0.0
