"""What the worker runtime takes and gives: its refusals (each maps to a gRPC status in the
servers), a finished :class:`Generation`, a :class:`RuntimeStats` snapshot (with the host
tier's :class:`TierCopyStats`), and the :class:`EventSink` its prefix cache reports to.
``worker.runtime.runtime`` re-exports them. No torch: the worker SDK (``worker.client``) answers
with the same :class:`Generation`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from coordinator.core.index import Tier

__all__ = ["EventSink", "Generation", "GenerationAborted", "GenerationCancelled",
           "InvalidRequest", "PoolExhausted", "RuntimeStats", "TierCopyStats"]

class InvalidRequest(ValueError):
    """Refused input (maps to INVALID_ARGUMENT): empty prompt, token id outside the vocabulary,
    max_new_tokens out of range, a request longer than the model's context, bad weights."""


class PoolExhausted(Exception):
    """The request cannot fit the KV pool even after evicting every cached page (maps to
    RESOURCE_EXHAUSTED). Nothing is held when it is raised."""


class GenerationAborted(Exception):
    """The request was stopped by a policy drain that aborts running generation (maps to
    ABORTED: route it again, to a worker serving the new version). Nothing is held when
    raised."""


class GenerationCancelled(Exception):
    """The caller cancelled the request (``generate``'s ``cancel``); nothing is held or recorded
    when raised."""


@dataclass(frozen=True, slots=True)
class Generation:
    """A finished request. ``tokens`` is the completion only. ``cached_tokens``: prompt tokens
    whose KV came from the prefix cache, either tier; ``host_cached_tokens``: of those, the ones
    copied back from the host tier; ``computed_tokens``: prompt tokens run through the
    model in prefill. When the whole prompt was cached, its last token is re-run (only for its
    logits, its KV is not rewritten), so cached + computed may be len(prompt) + 1."""

    tokens: list[int]
    policy_version: int
    cached_tokens: int
    computed_tokens: int
    host_cached_tokens: int = 0


@dataclass(slots=True)
class TierCopyStats:
    """What the copier moved since it was made: pages and bytes each way, and seconds spent
    (wall time, the device synchronised)."""

    pages_to_host: int = 0
    pages_to_device: int = 0
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    seconds_to_host: float = 0.0
    seconds_to_device: float = 0.0


@dataclass(frozen=True, slots=True)
class RuntimeStats:
    """A snapshot (unsynchronised with a running request, each number is consistent alone).
    ``total_pages``, ``free_pages``, ``cached_pages``: the device pool; ``host_*``: the host
    tier's pool (all 0 without one), ``host_cached_pages`` the reusable pages it holds.
    ``running_requests``: requests executing now (0 or 1); ``queued_tokens``: prompt +
    max_new_tokens of the requests waiting for their turn. ``copies``: the host tier's copies
    so far (None without one)."""

    total_pages: int
    free_pages: int
    cached_pages: int
    running_requests: int
    queued_tokens: int
    policy_version: int
    host_total_pages: int = 0
    host_free_pages: int = 0
    host_cached_pages: int = 0
    copies: TierCopyStats | None = None


class EventSink(Protocol):
    """Receives the prefix cache's changes (the agent turns them into Sync events). Called on
    the generating thread with the runtime's lock held: must not call back into the runtime."""

    def stored(self, keys: list[bytes]) -> None: ...

    def removed(self, keys: list[bytes]) -> None: ...

    def moved(self, keys: list[bytes], tier: Tier) -> None:
        """``keys`` are now held in ``tier`` (moved down to the host tier, or back up)."""
