"""The compiled holdings against the pure-Python ones, operation by operation (hypothesis
stateful): every answer equal, both self-consistent after every step. Run where the compiled
core is built; a machine with a C compiler and Cython (CI's) must have built it."""

from __future__ import annotations

import shutil
from importlib.util import find_spec

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from coordinator.core import accel
from coordinator.core.index.holdings import (
    MAX_SLOTS,
    PyHoldings,
    compiled_available,
    make_holdings,
)

needs_compiled = pytest.mark.skipif(not compiled_available(), reason=accel.status())


def test_the_compiled_core_is_built_where_it_can_be() -> None:
    if shutil.which("cc") is None or find_spec("Cython") is None:
        pytest.skip("no C compiler or no Cython here: the pure-Python path serves")
    assert compiled_available(), accel.status()


# Few keys but many slots: long probe runs after deletions, out-of-line holder arrays (more
# than six holders), masks wider than 64 bits.
KEYS = [i.to_bytes(2, "little") * 8 for i in range(300)]
keys = st.lists(st.sampled_from(KEYS), max_size=40)
slots = st.sampled_from([0, 1, 2, 5, 63, 64, 65, 130, 700, MAX_SLOTS - 1])


class Differential(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.py = PyHoldings()
        self.c = make_holdings(accelerated=True)

    @rule(keys=keys, slot=slots)
    def add(self, keys: list[bytes], slot: int) -> None:
        assert self.c.add(keys, slot) == self.py.add(keys, slot)

    @rule(slot=slots, first=st.integers(0, 299), length=st.integers(1, 300))
    def add_range(self, slot: int, first: int, length: int) -> None:
        run = KEYS[first:first + length]
        assert self.c.add(run, slot) == self.py.add(run, slot)

    @rule(keys=keys, slot=slots)
    def discard(self, keys: list[bytes], slot: int) -> None:
        assert self.c.discard(keys, slot) == self.py.discard(keys, slot)

    @rule(slot=slots)
    def drop_slot(self, slot: int) -> None:
        assert self.c.drop_slot(slot) == self.py.drop_slot(slot)

    @rule(keys=keys, slot=slots)
    def reads(self, keys: list[bytes], slot: int) -> None:
        assert self.c.not_held(keys, slot) == self.py.not_held(keys, slot)
        assert [self.c.holds(k, slot) for k in keys] == [self.py.holds(k, slot) for k in keys]
        assert [self.c.mask(k) for k in keys] == [self.py.mask(k) for k in keys]

    @rule(first=st.integers(0, 299), length=st.integers(0, 60),
          pending=st.dictionaries(st.sampled_from(KEYS), st.integers(1, 2**200), max_size=8))
    def runs(self, first: int, length: int, pending: dict[bytes, int]) -> None:
        prompt = KEYS[first:first + length]
        assert self.c.runs(prompt, None) == self.py.runs(prompt, None)
        assert self.c.runs(prompt, pending) == self.py.runs(prompt, pending)

    @rule(first=st.integers(0, 299), length=st.integers(1, 60), tail=st.integers(0, 60),
          masks=st.lists(st.integers(1, 2**70), min_size=1, max_size=3))
    def runs_with_routed_tails(self, first: int, length: int, tail: int,
                               masks: list[int]) -> None:
        """As a router leaves them: a prompt's tail pending under a few masks, each repeated
        over neighbouring keys (the compiled walk decodes a mask once for its neighbours)."""
        prompt = KEYS[first:first + length]
        pending = {k: masks[i * len(masks) // len(prompt)]
                   for i, k in enumerate(prompt) if i >= len(prompt) - tail}
        assert self.c.runs(prompt, pending) == self.py.runs(prompt, pending)

    @invariant()
    def agree(self) -> None:
        assert len(self.c) == len(self.py)
        every = (0, 1, 2, 5, 63, 64, 65, 130, 700, MAX_SLOTS - 1)
        c_keys, py_keys = self.c.keys_by_slot(every), self.py.keys_by_slot(every)
        for slot in every:
            assert self.c.count(slot) == self.py.count(slot)
            assert sorted(c_keys[slot]) == sorted(py_keys[slot])
        self.c.check()
        self.py.check()


TestDifferential = needs_compiled(Differential.TestCase)
Differential.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                          deadline=None)


@needs_compiled
def test_bad_keys_and_slots_are_refused_as_the_pure_path_refuses_them() -> None:
    for holdings in (PyHoldings(), make_holdings(accelerated=True)):
        assert holdings.runs([b"x" * 15, KEYS[0]], None) == []  # another length: no match
        with pytest.raises(ValueError, match="bytes"):
            holdings.runs([bytearray(16)], None)
    compiled = make_holdings(accelerated=True)
    for bad in ([b"short"], ["a" * 16], [bytearray(16)]):
        with pytest.raises(ValueError):
            compiled.add(bad, 0)
    for slot in (-1, MAX_SLOTS):
        with pytest.raises(ValueError, match="slot"):
            compiled.add(KEYS[:1], slot)
    assert len(compiled) == 0
    with pytest.raises(ValueError):
        compiled.add([KEYS[0], b"short"], 4)  # part-way: what came before stays, counted
    assert (compiled.count(4), len(compiled)) == (1, 1)
    compiled.check()


@needs_compiled
def test_a_large_table_grows_and_shrinks_back_to_nothing() -> None:
    compiled = make_holdings(accelerated=True)
    many = [i.to_bytes(16, "little") for i in range(50_000)]
    assert compiled.add(many, 3) == 50_000 and compiled.add(many[::2], 900) == 25_000
    assert compiled.runs(many[:10], None) == [((1 << 3) | (1 << 900), 1), (1 << 3, 10)]
    assert compiled.discard(many[1::2], 3) == 25_000
    assert compiled.drop_slot(900) == 25_000 and compiled.drop_slot(3) == 25_000
    assert len(compiled) == 0 and compiled.keys_by_slot([3]) == {3: []}
    compiled.check()
