"""What the prefix index takes and returns, and how it refuses bad input.

- :class:`Tier` (where a page is held), :class:`MatchDetail` (one worker's match),
  :class:`TierMatch` (a lookup's depths with their tiers) and :class:`IndexStats` (sizes):
  immutable values.
- :class:`IndexIntegrityError`: raised by ``PrefixIndex.check_integrity`` only, never for input.
- :class:`WorkerRecord` (one worker's side of the index) and :class:`IndexTables` (the index's
  tables, for the audits of ``index_audit``; read-only by type: ``ReadOnlyWorkerRecord`` and
  ``ReadOnlyHoldings`` name no mutator, so mypy refuses an audit that writes).
- ``check_worker`` / ``check_keys`` / ``check_read_keys``: ValueError for a worker id that is
  not a non-empty string, or keys that are not a sequence of 16-byte ``bytes``. Mutators run
  the full checks before changing anything; reads run the cheaper one.

Pure core: no I/O.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from coordinator.core.hashing import PAGE_KEY_BYTES, PageKeys
from coordinator.core.index.holdings import ReadOnlyHoldings


class Tier(enum.StrEnum):
    """Where a worker holds a page; lower tiers cost a copy before reuse."""

    GPU = "gpu"
    CPU = "cpu"
    DISK = "disk"


@dataclass(frozen=True, slots=True)
class MatchDetail:
    """One worker's match: ``pages`` deep, of which ``lower_tier_pages`` are held only in CPU or
    DISK and ``pending_pages`` are pending (unconfirmed) entries. ``confirmed_pages`` is the
    leading run of confirmed holdings alone (pending ignored): what :meth:`PrefixIndex.match`
    reports, at most ``pages``; equal to ``pages`` when pending entries were not counted."""

    pages: int
    lower_tier_pages: int
    pending_pages: int
    confirmed_pages: int

    @staticmethod
    def plain(depth: int) -> MatchDetail:
        """``depth`` pages, none in a lower tier or pending."""
        return MatchDetail(depth, 0, 0, depth)


class TierMatch(NamedTuple):
    """:meth:`PrefixIndex.match` with tiers: ``pages`` is ``match``'s answer; ``lower_tiers[w]``
    counts, of worker ``w``'s matched pages, those it holds in CPU and in DISK. Only workers with
    such pages are named (the rest of every worker's depth is in GPU)."""

    pages: dict[str, int]
    lower_tiers: dict[str, dict[Tier, int]]


class IndexStats(NamedTuple):
    """Sizes, for metrics and GetStats."""

    keys: int  # distinct keys with at least one confirmed holder
    holdings: int  # confirmed (worker, key) pairs
    pending: int  # live pending (worker, key) entries
    workers: int


class IndexIntegrityError(Exception):
    """The index's internal structures disagree (a bug, never bad input)."""


def check_worker(worker_id: str) -> None:
    if not isinstance(worker_id, str) or not worker_id:
        raise ValueError("worker id must be a non-empty string")


def check_keys(keys: Sequence[bytes]) -> None:
    if type(keys) is PageKeys:
        return  # cut from a wire blob of whole keys: checked when made
    # Two C-level passes instead of a Python loop: store() runs at millions of keys/s.
    if isinstance(keys, (bytes, bytearray, memoryview, str)):
        raise ValueError("keys must be a sequence of 16-byte keys, not one blob")
    if set(map(type, keys)) - {bytes}:
        raise ValueError("page keys must be bytes")
    if set(map(len, keys)) - {PAGE_KEY_BYTES}:
        raise ValueError(f"page keys must be {PAGE_KEY_BYTES} bytes")


def check_read_keys(keys: Sequence[bytes]) -> None:
    # Reads cannot corrupt anything and only validated keys are ever stored, so a cheaper
    # check suffices: one C-level join (bytes-like, 16 bytes per key on average); an
    # unhashable key is caught at lookup. A key of another length simply matches nothing.
    if isinstance(keys, (bytes, bytearray, memoryview, str)):
        raise ValueError("keys must be a sequence of 16-byte keys, not one blob")
    try:
        total = len(b"".join(keys))
    except TypeError:
        raise ValueError("page keys must be bytes") from None
    if total != PAGE_KEY_BYTES * len(keys):
        raise ValueError(f"page keys must be {PAGE_KEY_BYTES} bytes")


@dataclass(slots=True)
class WorkerRecord:
    """One worker's side of the index: its slot and mask bit (``1 << slot``), the tier of each
    key it holds below GPU (and their count per tier, kept as keys move), and its pending
    entries (key -> deadline). Held and pending keys are disjoint."""

    slot: int
    bit: int
    spilled: dict[bytes, Tier] = field(default_factory=dict)
    spilled_by_tier: Counter[Tier] = field(default_factory=Counter)
    pending: dict[bytes, float] = field(default_factory=dict)


class ReadOnlyWorkerRecord(Protocol):
    """A :class:`WorkerRecord` as an audit sees it: the same fields, none writable."""

    @property
    def slot(self) -> int: ...
    @property
    def bit(self) -> int: ...
    @property
    def spilled(self) -> Mapping[bytes, Tier]: ...
    @property
    def spilled_by_tier(self) -> Mapping[Tier, int]: ...
    @property
    def pending(self) -> Mapping[bytes, float]: ...


class IndexTables(NamedTuple):
    """A ``PrefixIndex``'s tables as they are (``PrefixIndex.tables()``), for the whole-index
    audits: views, not copies (an audit allocates nothing per key to get them), typed so that
    nothing through them can write. A caller that casts that away corrupts the index.

    ``slots``: slot -> worker (None when free); ``free_slots``: the free ones; ``lower`` and
    ``pending``: key -> mask of the workers holding it below GPU / with a pending entry;
    ``queue``: pending records (deadline, worker, keys) oldest first, ``queued`` the keys they
    reference (live or not), at most ``max_pending``; ``pending_count``: live pending entries.
    """

    workers: Mapping[str, ReadOnlyWorkerRecord]
    slots: Sequence[str | None]
    free_slots: Sequence[int]
    holdings: ReadOnlyHoldings
    lower: Mapping[bytes, int]
    pending: Mapping[bytes, int]
    pending_count: int
    queue: Sequence[tuple[float, str, tuple[bytes, ...]]]
    queued: int
    max_pending: int
