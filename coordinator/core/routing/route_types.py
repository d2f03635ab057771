"""What the router takes and answers: prompts and scopes in; lookups, routes, batches and the
reservations replicas share out. Immutable values; pure core.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.core.index import Tier

__all__ = ["BatchResult", "LookupResult", "PromptInput", "RouteReservation",
           "RouteResult", "Scope"]

@dataclass(frozen=True, slots=True)
class PromptInput:
    """A validated prompt: packed little-endian u32 tokens, or trusted page keys."""

    token_count: int
    token_bytes: bytes | None = None
    page_keys: tuple[bytes, ...] | None = None


@dataclass(frozen=True, slots=True)
class Scope:
    """The cache namespace of a request. ``tenant`` is set by the server from the caller's
    identity, never from a request field."""

    model: str | None = None
    adapter: str = ""
    policy_version: int | None = None
    tenant: str = ""
    cache_salt: str = ""  # the engine's per-request salt (Namespace.cache_salt)


@dataclass(frozen=True, slots=True)
class LookupResult:
    matches: dict[str, int]  # worker id -> matched pages (confirmed holdings only)
    policy_version: int
    prompt_pages: int
    page_size: int
    # Of a worker's matched pages, those in CPU and DISK; workers not named hold all in GPU.
    lower_tiers: dict[str, dict[Tier, int]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RouteResult:
    worker_id: str
    address: str
    matched_pages: int
    policy_version: int
    prompt_pages: int
    page_size: int
    routing_policy: str  # the routing rule's name (the chooser's), as the wire field says
    http_url: str = ""
    route_id: str = ""
    # The caller asked to report the end and the worker is external: the route is load on it
    # until ``EndRoutes(route_id)`` (core.awaited_routes).
    end_awaited: bool = False

    @property
    def matched_tokens(self) -> int:
        return self.matched_pages * self.page_size


@dataclass(frozen=True, slots=True)
class RouteReservation:
    """What one routing decision reserved on its worker, for the other coordinator replicas to
    count as well (issue 17 §4: replicas route as one): pending entries for the prompt's keys
    the worker does not hold yet, and ``copies`` in-flight routes of the uncached tokens. An
    ``awaited`` route is held until ``EndRoutes(route_id)`` (or the TTL), any other until the
    worker's heartbeats report it finished, as on the replica that chose it.
    ``prefill_tokens`` is the prefill work the decision added to the worker's backlog
    (``booked_work``); None from a release that did not send it, when the other
    replicas count every copy's uncached tokens instead. ``context_tokens`` is each copy's
    prompt length (the KV it pins while in flight); 0 from such a release."""

    worker_id: str
    incarnation: int
    route_id: str
    pending_keys: tuple[bytes, ...]
    uncached_tokens: int
    copies: int
    awaited: bool
    prefill_tokens: int | None = None
    context_tokens: int = 0

    def __post_init__(self) -> None:
        if self.copies < 1 or self.uncached_tokens < 0:
            raise ValueError(f"a reservation needs copies >= 1 and uncached_tokens >= 0, got "
                             f"{self.copies}, {self.uncached_tokens}")
        if self.context_tokens < 0:
            raise ValueError(f"a reservation's context_tokens must be >= 0, got "
                             f"{self.context_tokens}")
        if self.prefill_tokens is not None and self.prefill_tokens < 0:
            raise ValueError(f"a reservation's prefill_tokens must be >= 0, got "
                             f"{self.prefill_tokens}")


@dataclass(frozen=True, slots=True)
class BatchResult:
    routes: list[RouteResult]
    order: list[int]
