"""The prefix index: which worker holds which page keys, at which tier, confirmed or pending.

- ``prefix_index``: ``PrefixIndex``, the one class callers use (store, remove, ``apply`` a
  batch of page events, match, pending reservations, a worker's whole inventory).
- ``page_events``: a worker's page events, typed (``PagesStored``, ``PagesRemoved``,
  ``WorkerCleared``; ``PageEvent`` is any of them, ``PAGE_EVENT_TYPES`` lists them).
- ``index_types``: its values and refusals (``Tier``, ``MatchDetail``, ``IndexStats``, ...).
- ``holdings`` and ``holder_masks``: the table underneath, key -> holder slots per tier
  (compiled where built: ``coordinator.core.accel``).
- ``index_audit``: ``check_integrity`` and ``digest``, read through ``PrefixIndex.tables()``.

Pure core: no I/O. ``coordinator.index`` re-exports ``PrefixIndex`` as the documented contract.
"""

from coordinator.core.index.index_types import (
    IndexIntegrityError,
    IndexStats,
    MatchDetail,
    Tier,
    TierMatch,
)
from coordinator.core.index.page_events import (
    PAGE_EVENT_TYPES,
    PageEvent,
    PagesRemoved,
    PagesStored,
    WorkerCleared,
)
from coordinator.core.index.prefix_index import PrefixIndex

__all__ = ["PAGE_EVENT_TYPES", "IndexIntegrityError", "IndexStats", "MatchDetail", "PageEvent",
           "PagesRemoved", "PagesStored", "PrefixIndex", "Tier", "TierMatch", "WorkerCleared"]
