"""Confirmed holdings: which worker slots hold each page key, and the prefix walk over them.

The prefix index (:mod:`coordinator.core.index.prefix_index`) keeps its confirmed ``(slot, key)``
pairs in
a ``Holdings`` and everything else (slots, tiers, pending entries) itself. Two implementations
with one contract, checked against each other and a brute-force model by the same tests:

- :class:`PyHoldings`, pure Python: ``key -> int`` holder masks plus a key set per slot. Always
  available.
- ``CHoldings`` (``coordinator/core/_holdings_accel.pyx``, built by ``make install`` where
  Cython and a C compiler are present): an open-addressing table of 16-byte keys with their
  holder slots inline, no Python object per key, and per slot the table positions of its keys
  (``_slot_positions_accel.pyx``): 32-byte entries at 3/8 to 3/4 load, plus a 4-byte
  position per holding and its slack (58 bytes per key at 10^7 keys on one worker each, 4.7 of
  them the positions) instead of ~280, and no interpreter work per key operation.

``make_holdings()`` returns the accelerated one when it was built and ``KVCOORD_NO_ACCEL`` is
not set to ``1`` (``coordinator.core.accel``); ``accel.status()`` says which is in use and why.

Contract (both): keys passed to ``add`` and ``discard`` are validated 16-byte ``bytes`` (the
index checks them first); ``add`` and ``discard`` return how many pairs they created or
removed (a key repeated in one call counts once); ``keys_by_slot`` (each slot's keys in no
particular order) and ``drop_slot`` cost O(the keys of the slots named) on both, ``count``
O(1): for snapshots, resyncs and audits, never per request. ``runs`` walks a prompt's keys as
``holder_masks.prefix_runs`` does (masks are Python ints, bit ``s`` = slot ``s``): a key that is
not ``bytes`` is a ValueError, one of another length matches nothing. Slots are ints in
``[0, MAX_SLOTS)``. Not thread-safe.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

from coordinator.core import accel
from coordinator.core.index.holder_masks import clear_bits, prefix_runs, set_bits

MAX_SLOTS = 65_535
"""Worker slots a holdings table can name (the compiled one stores them as 16-bit ints)."""


class ReadOnlyHoldings(Protocol):
    """The reads of :class:`Holdings`, none of which mutates: what an audit may call.
    ``check`` raises AssertionError unless the table agrees with itself."""

    def holds(self, key: bytes, slot: int) -> bool: ...
    def not_held(self, keys: Sequence[bytes], slot: int) -> list[bytes]: ...
    def count(self, slot: int) -> int: ...
    def keys_by_slot(self, slots: Collection[int]) -> dict[int, list[bytes]]: ...
    def mask(self, key: bytes) -> int: ...
    def runs(self, keys: Sequence[bytes],
             pending: dict[bytes, int] | None) -> list[tuple[int, int]]: ...
    def check(self) -> None: ...
    def __len__(self) -> int: ...


class Holdings(ReadOnlyHoldings, Protocol):
    """What the prefix index needs of its confirmed holdings (see the module docstring)."""

    def add(self, keys: Sequence[bytes], slot: int) -> int: ...
    def discard(self, keys: Sequence[bytes], slot: int) -> int: ...
    def drop_slot(self, slot: int) -> int: ...


class PyHoldings:
    """Holder masks (``key -> int``, never 0) and each slot's key set, kept equal."""

    def __init__(self) -> None:
        self._masks: dict[bytes, int] = {}
        self._keys: dict[int, set[bytes]] = {}

    def __len__(self) -> int:
        return len(self._masks)

    def add(self, keys: Sequence[bytes], slot: int) -> int:
        held = self._keys.setdefault(slot, set())
        before = len(held)
        set_bits(self._masks, keys, 1 << slot)
        held.update(keys)
        return len(held) - before

    def discard(self, keys: Sequence[bytes], slot: int) -> int:
        held = self._keys.get(slot)
        if not held:
            return 0
        gone = held.intersection(keys)
        clear_bits(self._masks, gone, 1 << slot)
        held -= gone
        return len(gone)

    def drop_slot(self, slot: int) -> int:
        held = self._keys.pop(slot, set())
        clear_bits(self._masks, held, 1 << slot)
        return len(held)

    def holds(self, key: bytes, slot: int) -> bool:
        return key in self._keys.get(slot, ())

    def not_held(self, keys: Sequence[bytes], slot: int) -> list[bytes]:
        held = self._keys.get(slot, ())
        return [k for k in keys if k not in held]

    def count(self, slot: int) -> int:
        return len(self._keys.get(slot, ()))

    def keys_by_slot(self, slots: Collection[int]) -> dict[int, list[bytes]]:
        return {slot: list(self._keys.get(slot, ())) for slot in slots}

    def mask(self, key: bytes) -> int:
        return self._masks.get(key, 0)

    def runs(self, keys: Sequence[bytes],
             pending: dict[bytes, int] | None) -> list[tuple[int, int]]:
        return prefix_runs(keys, self._masks, pending)

    def check(self) -> None:
        expected: dict[bytes, int] = {}
        for slot, keys in self._keys.items():
            for key in keys:
                expected[key] = expected.get(key, 0) | 1 << slot
        if expected != self._masks:
            raise AssertionError("holder masks disagree with the slots' key sets")


def compiled_available() -> bool:
    """The compiled holdings were built (whether or not ``KVCOORD_NO_ACCEL`` disables them)."""
    return accel.built("_holdings_accel") is not None


def make_holdings(accelerated: bool | None = None) -> Holdings:
    """New empty holdings: compiled when built and not disabled (``accelerated=None``), or as
    asked (``True`` raises RuntimeError when the compiled core was not built)."""
    module = accel.enabled("_holdings_accel") if accelerated is None else (
        accel.built("_holdings_accel") if accelerated else None)
    if module is None:
        if accelerated:
            raise RuntimeError(f"the compiled index core is unavailable: {accel.status()}")
        return PyHoldings()
    holdings: Holdings = module.CHoldings()
    return holdings
