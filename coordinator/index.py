"""Contract import path (DESIGN): ``coordinator.index.PrefixIndex``. The index lives in
``coordinator.core.index.prefix_index``; this module re-exports its public names."""

from coordinator.core.index import IndexIntegrityError, IndexStats, MatchDetail, PrefixIndex, Tier

__all__ = ["IndexIntegrityError", "IndexStats", "MatchDetail", "PrefixIndex", "Tier"]
