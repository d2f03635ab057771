"""Per-slot operations of the compiled holdings (``count``, ``keys_by_slot``, ``drop_slot``)
against the pure-Python ones, over tables that grow, fill with tombstones and rehash in place,
and slots whose position arrays go stale and are compacted; ``check()`` after every step covers
each slot's positions. Then: a slot's keys cost its keys, not the table."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from coordinator.core import accel
from coordinator.core.index import PrefixIndex
from coordinator.core.index.holdings import PyHoldings, compiled_available, make_holdings

needs_compiled = pytest.mark.skipif(not compiled_available(), reason=accel.status())

# Enough keys that tables grow past 64 entries several times; few slots, so each slot's
# position array is long and its stale positions pass the compaction bounds.
KEYS = [i.to_bytes(16, "little") for i in range(3_000)]
SLOTS = (0, 1, 2, 70)
slots = st.sampled_from(SLOTS)
starts = st.integers(0, len(KEYS) - 1)


class PerSlotDifferential(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.py = PyHoldings()
        self.c = make_holdings(accelerated=True)

    @rule(slot=slots, first=starts, length=st.integers(1, 600), step=st.integers(1, 3))
    def add(self, slot: int, first: int, length: int, step: int) -> None:
        run = KEYS[first:first + length:step]
        assert self.c.add(run, slot) == self.py.add(run, slot)

    @rule(slot=slots, first=starts, length=st.integers(1, 600), step=st.integers(1, 3))
    def discard(self, slot: int, first: int, length: int, step: int) -> None:
        run = KEYS[first:first + length:step]
        assert self.c.discard(run, slot) == self.py.discard(run, slot)

    @rule(slot=slots, first=starts, length=st.integers(1, 200))
    def discard_and_add_back(self, slot: int, first: int, length: int) -> None:
        """A key that leaves a slot and comes back: its position is named twice until the
        slot's array is compacted."""
        run = KEYS[first:first + length]
        assert self.c.discard(run, slot) == self.py.discard(run, slot)
        assert self.c.add(run, slot) == self.py.add(run, slot)

    @rule(slot=slots)
    def drop_slot(self, slot: int) -> None:
        assert self.c.drop_slot(slot) == self.py.drop_slot(slot)

    @invariant()
    def per_slot_answers_agree(self) -> None:
        assert len(self.c) == len(self.py)
        c_keys, py_keys = self.c.keys_by_slot(SLOTS), self.py.keys_by_slot(SLOTS)
        for slot in SLOTS:
            assert self.c.count(slot) == self.py.count(slot) == len(py_keys[slot])
            assert sorted(c_keys[slot]) == sorted(py_keys[slot])
            assert sorted(self.c.keys_by_slot([slot])[slot]) == sorted(py_keys[slot])
        self.c.check()
        self.py.check()


TestPerSlotDifferential = needs_compiled(PerSlotDifferential.TestCase)
PerSlotDifferential.TestCase.settings = settings(max_examples=60, stateful_step_count=30,
                                                 deadline=None)


@needs_compiled
def test_churn_through_tombstones_and_rehashes_keeps_every_slot_exact() -> None:
    """Keys come and go in waves (a worker's cache evicting), so deleted entries pile up as
    tombstones until the table rehashes at the same size; a key held by two slots, one of
    them cycling keys out and back, leaves that slot's positions stale, then compacted."""
    py, c = PyHoldings(), make_holdings(accelerated=True)
    base = KEYS[:200]
    for holdings in (py, c):
        holdings.add(base, 70)
    for wave in range(12):
        fresh = KEYS[200 + 200 * wave:400 + 200 * wave]
        previous = KEYS[200 * wave:400 + 200 * wave][:200] if wave else []
        for holdings in (py, c):
            assert holdings.add(fresh, 1) == 200
            assert holdings.discard(previous, 1) == (200 if wave else 0)
            holdings.discard(base[wave::12], 70)
            holdings.add(base[wave::12], 70)
        for slot in (1, 70):
            assert c.count(slot) == py.count(slot)
            assert sorted(c.keys_by_slot([slot])[slot]) == sorted(py.keys_by_slot([slot])[slot])
        c.check()
    # Most of a slot discarded at once: its array, now far past its count, is compacted.
    assert c.discard(base[:190], 70) == py.discard(base[:190], 70) == 190
    assert set(c.keys_by_slot([70])[70]) == set(py.keys_by_slot([70])[70]) == set(base[190:])
    c.check()
    assert (c.drop_slot(1), c.drop_slot(70), len(c)) == (py.drop_slot(1), py.drop_slot(70), 0)
    assert c.keys_by_slot([1, 70]) == {1: [], 70: []}
    c.check()


@needs_compiled
def test_keys_cycled_out_of_a_slot_and_back_are_read_once() -> None:
    """Keys another slot keeps in the table leave slot 0 and come back, again and again, at
    the same positions: slot 0's array names them twice until a compaction (on filling up, or
    after a discard) names each once; reads name each once meanwhile."""
    py, c = PyHoldings(), make_holdings(accelerated=True)
    for holdings in (py, c):
        holdings.add(KEYS[:40], 1)
        holdings.add(KEYS[:40], 0)
    for cycle in range(60):
        cycled = KEYS[cycle % 4 * 7:cycle % 4 * 7 + 10 + cycle % 7]
        for holdings in (py, c):
            assert holdings.discard(cycled, 0) == len(cycled)
            assert holdings.add(cycled, 0) == len(cycled)
        assert sorted(c.keys_by_slot([0])[0]) == sorted(py.keys_by_slot([0])[0])
        c.check()
    assert c.discard(KEYS[:35], 0) == 35 and set(c.keys_by_slot([0])[0]) == set(KEYS[35:40])
    c.check()


@needs_compiled
def test_a_slot_dropped_while_another_holds_its_keys_leaves_the_other_whole() -> None:
    py, c = PyHoldings(), make_holdings(accelerated=True)
    for holdings in (py, c):
        holdings.add(KEYS[:1_000], 0)
        holdings.add(KEYS[500:1_500], 1)
        holdings.discard(KEYS[500:700], 0)
        assert holdings.drop_slot(0) == 800
    assert set(c.keys_by_slot([1])[1]) == set(py.keys_by_slot([1])[1]) == set(KEYS[500:1_500])
    assert (len(c), c.count(0), c.count(1)) == (1_000, 0, 1_000)
    c.check()


@pytest.mark.parametrize("accelerated", [
    False, pytest.param(True, marks=needs_compiled)], ids=["pure", "compiled"])
def test_resync_worker_keys_and_drop_agree_with_what_was_stored(accelerated: bool) -> None:
    """The index's per-worker calls built on the per-slot operations, after churn."""
    index = PrefixIndex(clock=lambda: 0.0, accelerated=accelerated)
    for w in range(8):
        index.store(f"w{w}", KEYS[w * 300:(w + 2) * 300])
    index.remove("w3", KEYS[900:1_000])
    index.replace_worker("w3", {"gpu": KEYS[950:1_100], "cpu": KEYS[2_900:]})
    assert index.worker_keys("w3") == frozenset(KEYS[950:1_100] + KEYS[2_900:])
    inventory = index.worker_inventory("w3")
    assert {tier: set(keys) for tier, keys in inventory.items()} == {
        "gpu": set(KEYS[950:1_100]), "cpu": set(KEYS[2_900:])}
    assert index.drop_worker("w3") == 250
    assert index.worker_keys("w4") == frozenset(KEYS[1_200:1_800])
    index.check_integrity()
