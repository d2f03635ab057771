"""The policy state machine through a real store, driven by hypothesis: concurrent trainers
with stale views, against MemoryStore and a real redis-server.

Each trainer keeps the record it last read, which other trainers may have made stale by the
time it acts. Acting means what the service's CAS loop does once: compute the transition from
that snapshot with ``coordinator.core.policy_state`` and ``cas_policy(snapshot, new)``, alone or
racing the other trainers (each on its own connection on Redis). The model is the record the store
must hold; every step checks it and the policy-version invariants of docs/ARCHITECTURE.md §0.

The store is async and hypothesis rules are not: each machine drives its handles on a private
event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from coordinator.core import policy_state
from coordinator.core.errors import Aborted, InvalidArgument
from coordinator.core.policy_state import PolicyRecord
from coordinator.store.memory import MemoryStore
from coordinator.store.protocol import MetadataStore
from coordinator.store.redis_store import RedisStore
from tests.conftest import NAMESPACE

T = TypeVar("T")
HandleOpener = Callable[[int], Awaitable[list[MetadataStore]]]

TRAINERS = ("t0", "t1", "t2")
SETTINGS = settings(
    max_examples=100,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# A move: (op, mode, weights uri, offset from the version the snapshot says is right).
moves = st.tuples(
    st.sampled_from(("begin", "commit", "abort")),
    st.sampled_from(policy_state.MODES),
    st.sampled_from(("", "s3://ckpt/a", "s3://ckpt/b")),
    st.sampled_from((0, 0, 0, -1, 1)),  # mostly right, sometimes stale or ahead
)
Move = tuple[str, str, str, int]


@dataclasses.dataclass(frozen=True)
class Attempt:
    trainer: str
    op: str
    snapshot: PolicyRecord
    new: PolicyRecord


async def _gather(coros: list[Coroutine[Any, Any, T]]) -> list[T]:
    # gather inside the loop: called outside, it would bind to the thread's default loop.
    return await asyncio.gather(*coros)


class PolicyMachine(RuleBasedStateMachine):
    def __init__(self, open_handles: HandleOpener) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        # One handle per trainer plus an observer (all the same object for MemoryStore).
        handles = self._run(open_handles(len(TRAINERS) + 1))
        self.handles = handles
        self.stores = dict(zip(TRAINERS, handles, strict=False))
        self.observer = handles[-1]
        self.model = PolicyRecord()
        self.snapshots = {t: self._run(self.stores[t].get_policy()) for t in TRAINERS}
        self.history: list[str] = []  # successful ops, in order
        self.begun_uri = ""  # the weights the update in progress asked for
        self.highest_version_seen = 0

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        for handle in self.handles:
            self._run(handle.close())
        self.loop.close()

    # --- rules ----------------------------------------------------------------------------

    @rule(trainer=st.sampled_from(TRAINERS))
    def read(self, trainer: str) -> None:
        self.snapshots[trainer] = self._run(self.stores[trainer].get_policy())
        assert self.snapshots[trainer] == self.model

    @rule(trainer=st.sampled_from(TRAINERS), move=moves, reread=st.booleans())
    def act(self, trainer: str, move: Move, reread: bool) -> None:
        if reread:  # the service's path: read, then compute and CAS at once
            self.read(trainer)
        self._race({trainer: move})

    @rule(moves=st.lists(moves, min_size=len(TRAINERS), max_size=len(TRAINERS)))
    def race(self, moves: list[Move]) -> None:
        self._race(dict(zip(TRAINERS, moves, strict=True)))

    # --- the CAS step and its checks -------------------------------------------------------

    def _compute(self, trainer: str, move: Move) -> Attempt | None:
        """The trainer's transition from its snapshot, or None when policy refuses it. Exactly
        the moves at offset 0 that fit the snapshot's phase are accepted."""
        op, mode, uri, offset = move
        snapshot = self.snapshots[trainer]
        in_progress = snapshot.target_version is not None
        try:
            if op == "begin":
                new = policy_state.begin(snapshot, snapshot.version + offset, mode, uri)
            else:
                target = snapshot.version + 1
                new = getattr(policy_state, op)(snapshot, target + offset)
        except (Aborted, InvalidArgument):
            assert offset != 0 or in_progress == (op == "begin")
            return None
        assert offset == 0 and in_progress == (op != "begin")
        return Attempt(trainer, op, snapshot, new)

    def _race(self, moves: dict[str, Move]) -> None:
        attempts = [a for t, m in moves.items() if (a := self._compute(t, m)) is not None]
        if not attempts:
            return
        casses = [self.stores[a.trainer].cas_policy(a.snapshot, a.new) for a in attempts]
        results = self._run(_gather(casses))
        winners = [a for a, won in zip(attempts, results, strict=True) if won]
        fresh = [a for a in attempts if a.snapshot == self.model]
        # A stale snapshot's CAS always fails; of the attempts made from the stored state,
        # exactly one wins (the winner moves the epoch past every snapshot taken).
        assert all(a.snapshot == self.model for a in winners)
        assert len(winners) == (1 if fresh else 0)
        if winners:
            self._apply(winners[0])

    def _apply(self, winner: Attempt) -> None:
        before, after = self.model, dataclasses.replace(winner.new, epoch=self.model.epoch + 1)
        previous = self.history[-1] if self.history else None
        if winner.op == "begin":
            # No double bump: a second begin needs a commit or an abort in between, so two
            # trainers with the same expected_version never both begin.
            assert previous != "begin"
            self.begun_uri = winner.new.target_weights_uri
        else:
            assert previous == "begin"
        if winner.op == "commit":
            assert after.version == before.version + 1
            assert after.weights_uri == self.begun_uri
        else:
            assert (after.version, after.weights_uri) == (before.version, before.weights_uri)
        self.history.append(winner.op)
        self.model = after

    # --- invariants ------------------------------------------------------------------------

    @invariant()
    def the_store_holds_the_model(self) -> None:
        stored = self._run(self.observer.get_policy())
        assert stored == self.model
        policy_state.check_integrity(stored)

    @invariant()
    def the_version_counts_commits_and_never_decreases(self) -> None:
        assert self.model.version == self.history.count("commit")
        assert self.model.version >= self.highest_version_seen
        self.highest_version_seen = self.model.version


def memory_handles() -> HandleOpener:
    async def open_handles(n: int) -> list[MetadataStore]:
        return [MemoryStore(namespace=NAMESPACE)] * n

    return open_handles


_namespaces = itertools.count()


def redis_handles(url: str) -> HandleOpener:
    async def open_handles(n: int) -> list[MetadataStore]:
        namespace = f"policy-machine-{next(_namespaces)}"  # a fresh policy per machine
        return [await RedisStore.connect(url, namespace=namespace) for _ in range(n)]

    return open_handles


def test_concurrent_trainers_on_the_memory_store() -> None:
    run_state_machine_as_test(lambda: PolicyMachine(memory_handles()), settings=SETTINGS)


@pytest.mark.redis
def test_concurrent_trainers_on_redis(redis_url: str) -> None:
    run_state_machine_as_test(lambda: PolicyMachine(redis_handles(redis_url)), settings=SETTINGS)
