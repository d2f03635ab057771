"""A worker's page events, typed: it stored pages (in a tier), removed pages, or cleared all.

The one domain form of a page event, for every side: the reference worker's runtime and the
engine bridge make them, ``coordinator.sync_codec`` carries them over the ``Sync`` stream,
``PrefixIndex.apply`` applies a batch of them, replicas pass them on, and the simulator's
workers publish them. Each variant's ``kind`` is its name on the replication stream.

Pure core: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from coordinator.core.index.index_types import Tier


@dataclass(frozen=True, slots=True)
class PagesStored:
    """The worker holds ``keys`` in ``tier``; keys it already held move to ``tier`` (one tier
    per worker and key, so a move down or back up is a Stored event too)."""

    keys: Sequence[bytes]
    tier: Tier = Tier.GPU
    kind: ClassVar[str] = "stored"


@dataclass(frozen=True, slots=True)
class PagesRemoved:
    """The worker no longer holds ``keys``, in any tier."""

    keys: Sequence[bytes]
    kind: ClassVar[str] = "removed"


@dataclass(frozen=True, slots=True)
class WorkerCleared:
    """The worker dropped every page it held (a cache reset, new weights)."""

    keys: ClassVar[Sequence[bytes]] = ()
    kind: ClassVar[str] = "cleared"


PageEvent = PagesStored | PagesRemoved | WorkerCleared
"""Any one page event; dispatch on its type."""
