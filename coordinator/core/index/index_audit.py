"""Whole-index audits of a :class:`~coordinator.core.index.prefix_index.PrefixIndex`: O(size)
scans for tests, operators and replicas, never on a hot path. Both read the index's tables
through its one public view for them (:class:`IndexTables`, ``PrefixIndex.tables()``) and
mutate nothing.

- :func:`check_integrity`: raise :class:`IndexIntegrityError` unless the slot table, the
  per-worker records, the holdings, the two mask dicts and the pending queue all agree.
- :func:`digest`: 16 bytes naming the confirmed ``(worker, key, tier)`` entries as a set.

They take the tables, not the index: the index imports this module, so the import runs one
way only.

Pure core: no I/O.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable

from coordinator.core.hashing import PAGE_KEY_BYTES
from coordinator.core.index.index_types import IndexIntegrityError, IndexTables, Tier


def check_integrity(index: IndexTables) -> None:
    """What :meth:`PrefixIndex.check_integrity` checks."""
    occupied = {w.slot: name for name, w in index.workers.items()}
    _require(
        occupied == {s: n for s, n in enumerate(index.slots) if n is not None}
        and set(index.free_slots) == set(range(len(index.slots))) - occupied.keys(),
        "slot table, free slots and workers disagree",
    )
    expected: tuple[dict[bytes, int], ...] = ({}, {})
    queued = {(name, k, d) for d, name, keys in index.queue for k in keys}
    holdings = index.holdings
    try:
        holdings.check()
    except AssertionError as exc:
        raise IndexIntegrityError(f"holdings: {exc}") from None
    counted = 0
    by_slot = holdings.keys_by_slot([w.slot for w in index.workers.values()])
    for name, w in index.workers.items():
        _require(w.bit == 1 << w.slot, f"{name}: bit does not match slot")
        _require(all(holdings.holds(k, w.slot) for k in w.spilled),
                 f"{name}: a spilled key is not held")
        # NOTE: a tier emptied keeps a zero count; `+` drops it. The view types the counts as a
        # read-only Mapping, so they are copied into a Counter (three entries) for `+`.
        _require(Counter(w.spilled.values()) == +Counter(w.spilled_by_tier),
                 f"{name}: spilled counts per tier are wrong")
        _require(not any(holdings.holds(k, w.slot) for k in w.pending),
                 f"{name}: a held key is pending")
        held = by_slot[w.slot]
        _require(len(held) == holdings.count(w.slot), f"{name}: holdings count is wrong")
        _require(all(holdings.mask(k) >> w.slot & 1 for k in held),
                 f"{name}: a held key's mask lacks the worker")
        counted += len(held)
        sets: tuple[Iterable[bytes], ...] = (w.spilled, w.pending)
        for masks, keys in zip(expected, sets, strict=True):
            for key in keys:
                masks[key] = masks.get(key, 0) | w.bit
        _require(
            all((name, k, d) in queued for k, d in w.pending.items()),
            f"{name}: a pending entry has no queue record",
        )
    occupied_bits = sum(w.bit for w in index.workers.values())
    _require(counted == sum(holdings.count(s) for s in range(len(index.slots))),
             "a free slot still holds keys")
    _require(all(holdings.mask(k) & ~occupied_bits == 0 for keys in by_slot.values()
                 for k in keys), "a key is held by a free slot")
    for actual, wanted, label in zip(
        (index.lower, index.pending), expected, ("lower", "pending"), strict=True,
    ):
        _require(actual == wanted, f"{label} masks disagree with the workers' key sets")
    live = sum(len(w.pending) for w in index.workers.values())
    _require(live == index.pending_count, "pending count is wrong")
    _require(index.queued == sum(len(r[2]) for r in index.queue), "queued count is wrong")
    _require(index.queued <= index.max_pending, "pending bound exceeded")


def digest(index: IndexTables) -> bytes:
    """The sum mod 2**128 of each confirmed entry's BLAKE2b: see :meth:`PrefixIndex.digest`."""
    total = 0
    by_slot = index.holdings.keys_by_slot([w.slot for w in index.workers.values()])
    for worker_id, w in index.workers.items():
        name = worker_id.encode() + b"\0"
        for key in by_slot[w.slot]:
            tier = w.spilled.get(key, Tier.GPU).value.encode()
            entry = hashlib.blake2b(name + key + tier, digest_size=PAGE_KEY_BYTES).digest()
            total += int.from_bytes(entry, "big")
    return (total % (1 << (8 * PAGE_KEY_BYTES))).to_bytes(PAGE_KEY_BYTES, "big")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise IndexIntegrityError(message)
