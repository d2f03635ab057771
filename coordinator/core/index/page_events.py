"""A worker's page events, typed: it stored pages (in a tier), removed pages, or cleared all.

The one domain form of a page event, for every side: the reference worker's runtime and the
engine bridge make them, ``coordinator.sync_codec`` carries them over the ``Sync`` stream,
``PrefixIndex.apply`` applies a batch of them, replicas pass them on, and the simulator's
workers publish them. Each variant's ``kind`` is its name on the replication stream, and
``of(keys, tier)`` builds it from the parts every wire form carries, so a decoder looks the
variant up in a registry (``PAGE_EVENT_TYPES``) rather than branching on a kind.

Pure core: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Self

from coordinator.core.index.index_types import Tier


@dataclass(frozen=True, slots=True)
class PagesStored:
    """The worker holds ``keys`` in ``tier``; keys it already held move to ``tier`` (one tier
    per worker and key, so a move down or back up is a Stored event too)."""

    keys: Sequence[bytes]
    tier: Tier = Tier.GPU
    kind: ClassVar[str] = "stored"

    @classmethod
    def of(cls, keys: Sequence[bytes], tier: Tier) -> Self:
        """The event from its wire parts."""
        return cls(keys, tier)


@dataclass(frozen=True, slots=True)
class PagesRemoved:
    """The worker no longer holds ``keys``, in any tier."""

    keys: Sequence[bytes]
    kind: ClassVar[str] = "removed"

    @classmethod
    def of(cls, keys: Sequence[bytes], tier: Tier) -> Self:
        """The event from its wire parts; ``tier`` is ignored (a removal is from every tier)."""
        return cls(keys)


@dataclass(frozen=True, slots=True)
class WorkerCleared:
    """The worker dropped every page it held (a cache reset, new weights)."""

    keys: ClassVar[Sequence[bytes]] = ()
    kind: ClassVar[str] = "cleared"

    @classmethod
    def of(cls, keys: Sequence[bytes], tier: Tier) -> Self:
        """The event from its wire parts; both are ignored (a decoder that must refuse keys on
        a clear checks them first)."""
        return cls()


PageEvent = PagesStored | PagesRemoved | WorkerCleared
"""Any one page event; dispatch on its type."""

PAGE_EVENT_TYPES: tuple[type[PageEvent], ...] = (PagesStored, PagesRemoved, WorkerCleared)
"""Every variant, for registries keyed by a wire kind (a new variant is added here too)."""
