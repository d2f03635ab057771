"""The prefix index: which worker holds which page keys, at which tier, confirmed or pending.

- ``prefix_index``: ``PrefixIndex``, the one class callers use (store, remove, match,
  pending reservations, a worker's whole inventory).
- ``index_types``: its values and refusals (``Tier``, ``MatchDetail``, ``IndexStats``, ...).
- ``holdings`` and ``holder_masks``: the table underneath, key -> holder slots per tier
  (compiled where built: ``coordinator.core.accel``).
- ``index_audit``: ``check_integrity`` and ``digest``, the invariants tests and replicas check.

Pure core: no I/O. ``coordinator.index`` re-exports ``PrefixIndex`` as the documented contract.
"""

from coordinator.core.index.index_types import (
    IndexIntegrityError,
    IndexStats,
    MatchDetail,
    Tier,
    TierMatch,
)
from coordinator.core.index.prefix_index import PrefixIndex

__all__ = ["IndexIntegrityError", "IndexStats", "MatchDetail", "PrefixIndex", "Tier", "TierMatch"]
