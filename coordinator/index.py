"""Contract import path (DESIGN): ``coordinator.index.PrefixIndex``. The index lives in
``coordinator.core.index``; this module re-exports its public names."""

from coordinator.core.index import PrefixIndex
from coordinator.core.index_types import IndexIntegrityError, IndexStats, MatchDetail, Tier

__all__ = ["IndexIntegrityError", "IndexStats", "MatchDetail", "PrefixIndex", "Tier"]
