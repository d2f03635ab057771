"""PrefixIndex against a brute-force model of sets, driven by hypothesis.

Every step compares ``match`` and ``match_detail`` (with and without pending) for every prompt
with the model, and calls ``check_integrity()``.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from coordinator.core import accel
from coordinator.core.index import MatchDetail, PrefixIndex, Tier
from coordinator.core.index.holdings import compiled_available

TTL = 2.0
WORKERS = ["w0", "w1", "w2", "w3"]
# A small universe of chained prompts: p1 and p2 share p0's first three pages.
_P0 = [bytes([0, i]) * 8 for i in range(6)]
PROMPTS = [
    _P0,
    _P0[:3] + [bytes([1, i]) * 8 for i in range(4)],
    [bytes([2, i]) * 8 for i in range(5)],
]
PROMPTS.append(PROMPTS[1][:3] + PROMPTS[2][:2])
KEYS = sorted({k for p in PROMPTS for k in p})
TIER_ORDER = {Tier.DISK: 0, Tier.CPU: 1, Tier.GPU: 2}

workers = st.sampled_from(WORKERS)
tiers = st.sampled_from(list(Tier))
key_lists = st.lists(st.sampled_from(KEYS), max_size=6)
prompt_slices = st.tuples(
    st.sampled_from(range(len(PROMPTS))), st.integers(0, 7), st.integers(0, 7)
).map(lambda t: PROMPTS[t[0]][min(t[1], t[2]) : max(t[1], t[2])])


class IndexMachine(RuleBasedStateMachine):
    accelerated = False  # the holdings under test (coordinator.core.index.holdings)

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.index = PrefixIndex(clock=lambda: self.now, pending_ttl=TTL,
                                 accelerated=self.accelerated)
        self.held: dict[str, dict[bytes, Tier]] = {}
        self.pending: dict[str, dict[bytes, float]] = {}  # key -> deadline

    def _known(self, worker: str) -> None:
        self.held.setdefault(worker, {})
        self.pending.setdefault(worker, {})

    @rule(worker=workers, keys=st.one_of(prompt_slices, key_lists), tier=tiers)
    def store(self, worker: str, keys: list[bytes], tier: Tier) -> None:
        self._known(worker)
        new = len(set(keys) - self.held[worker].keys())
        assert self.index.store(worker, keys, tier) == new
        for key in keys:
            self.held[worker][key] = tier
            self.pending[worker].pop(key, None)

    @rule(worker=workers, keys=st.one_of(prompt_slices, key_lists))
    def remove(self, worker: str, keys: list[bytes]) -> None:
        gone = set(keys) & self.held.get(worker, {}).keys()
        assert self.index.remove(worker, keys) == len(gone)
        for key in keys:
            self.held.get(worker, {}).pop(key, None)
            self.pending.get(worker, {}).pop(key, None)

    @rule(worker=workers)
    def drop_worker(self, worker: str) -> None:
        assert self.index.drop_worker(worker) == len(self.held.pop(worker, {}))
        self.pending.pop(worker, None)

    @rule(worker=workers, gpu=key_lists, cpu=key_lists, disk=key_lists)
    def replace_worker(
        self, worker: str, gpu: list[bytes], cpu: list[bytes], disk: list[bytes]
    ) -> None:
        self.index.replace_worker(worker, {"gpu": gpu, "cpu": cpu, "disk": disk})
        self._known(worker)
        inventory: dict[bytes, Tier] = {}
        for tier, keys in ((Tier.DISK, disk), (Tier.CPU, cpu), (Tier.GPU, gpu)):
            inventory.update(dict.fromkeys(keys, tier))
        self.held[worker] = inventory
        for key in inventory:
            self.pending[worker].pop(key, None)

    @rule(worker=workers, keys=prompt_slices)
    def add_pending(self, worker: str, keys: list[bytes]) -> None:
        self._expire()
        self._known(worker)
        fresh = set(keys) - self.held[worker].keys()
        new = len(fresh - self.pending[worker].keys())
        assert self.index.add_pending(worker, keys) == new
        for key in fresh:
            self.pending[worker][key] = self.now + TTL

    @rule(dt=st.sampled_from([0.5, 1.0, 2.0, 2.5]))
    def advance_clock(self, dt: float) -> None:
        self.now += dt

    @precondition(lambda self: bool(self.pending))
    @rule()
    def expire(self) -> None:
        expected = self._expire()
        assert self.index.expire_pending() == expected

    def _expire(self) -> int:
        expired = 0
        for entries in self.pending.values():
            for key in [k for k, deadline in entries.items() if deadline <= self.now]:
                del entries[key]
                expired += 1
        return expired

    def _model_detail(self, keys: list[bytes], include_pending: bool) -> dict[str, MatchDetail]:
        out = {}
        for worker, held in self.held.items():
            live = {k for k, d in self.pending[worker].items() if d > self.now}
            depth = lower = pend = 0
            confirmed: int | None = None  # set at the first pending key of the run
            for key in keys:
                if key in held:
                    lower += held[key] is not Tier.GPU
                elif include_pending and key in live:
                    pend += 1
                    confirmed = depth if confirmed is None else confirmed
                else:
                    break
                depth += 1
            if depth:
                out[worker] = MatchDetail(
                    depth, lower, pend, depth if confirmed is None else confirmed
                )
        return out

    @invariant()
    def matches_agree_with_the_model(self) -> None:
        self._expire()  # match_detail(include_pending=True) below expires them in the index
        for prompt in PROMPTS:
            for keys in (prompt, prompt[1:]):
                confirmed = self._model_detail(keys, include_pending=False)
                assert self.index.match(keys) == {w: d.pages for w, d in confirmed.items()}
                assert self.index.match_detail(keys) == confirmed
                with_pending = self._model_detail(keys, include_pending=True)
                detail = self.index.match_detail(keys, include_pending=True)
                assert detail == with_pending
                # What a router reads instead of a second match(): the confirmed depth of
                # every worker in the pending-inclusive answer.
                for worker, d in detail.items():
                    assert d.confirmed_pages == confirmed.get(worker, MatchDetail(0, 0, 0, 0)).pages

    @invariant()
    def structures_agree(self) -> None:
        self.index.check_integrity()
        assert sorted(self.index.workers()) == sorted(self.held)
        for worker, held in self.held.items():
            assert self.index.worker_keys(worker) == held.keys()
            assert all(self.index.tier_of(worker, k) is t for k, t in held.items())


IndexMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestIndexStateful = IndexMachine.TestCase


class CompiledIndexMachine(IndexMachine):
    accelerated = True


CompiledIndexMachine.TestCase.settings = IndexMachine.TestCase.settings
TestCompiledIndexStateful = pytest.mark.skipif(
    not compiled_available(), reason=accel.status())(CompiledIndexMachine.TestCase)
