"""What a policy update's acks add up to: each member's furthest stage across the store's copy
and this replica's, the failures among them, and a commit's outcome. Kept apart from
``policy_updates`` (which runs updates) because these are plain values, read by the commit and by
``GetPolicy`` alike."""

from __future__ import annotations

from collections.abc import Callable, Set
from dataclasses import dataclass, field

from coordinator.control.policy.policy_view import PolicyView
from coordinator.core import policy_state
from coordinator.core.policy_state import Barrier, PolicyRecord
from coordinator.store.protocol import MetadataStore

STORE_READ_INTERVAL_S = 0.1  # how often a waiting commit re-reads acks other replicas took


@dataclass(frozen=True, slots=True)
class CommitResult:
    """A committed update: who applied it, who was fenced, and why the members that reported
    a failure failed (``failures``: worker -> reason, a subset of ``fenced``)."""

    record: PolicyRecord
    acked: tuple[str, ...]
    fenced: tuple[str, ...]
    failures: dict[str, str] = field(default_factory=dict)


def latest_stages(stored: dict[str, str], local: dict[str, str]) -> dict[str, str]:
    """Per worker, the furthest stage either copy has seen (a failure outranks every stage)."""
    merged = dict(stored)
    for worker, stage in local.items():
        if policy_state.stage_rank(stage) > policy_state.stage_rank(merged.get(worker, "member")):
            merged[worker] = stage
        else:
            merged.setdefault(worker, stage)
    return merged


def failures_of(stages: dict[str, str]) -> dict[str, str]:
    """Worker -> reason, for the members whose recorded stage is a failure."""
    failed = {w: policy_state.failure_reason(stage) for w, stage in stages.items()}
    return {w: reason for w, reason in sorted(failed.items()) if reason is not None}


async def await_barrier(
    store: MetadataStore, view: PolicyView, local: Callable[[], dict[str, str]], version: int,
    members: Set[str], deadline: float, clock: Callable[[], float],
) -> tuple[Barrier, dict[str, str]]:
    """Wait until every one of ``members`` applied ``version``, every one still missing
    reported a failure, or ``clock()`` passes ``deadline``. Returns the barrier then and the
    stages it was taken on: ``local()`` (the acks this replica took) merged with the store's
    copy (those other replicas took), re-read every ``STORE_READ_INTERVAL_S``."""
    stored: dict[str, str] = {}
    next_read = 0.0
    while True:
        now = clock()
        if now >= next_read:
            stored, next_read = dict(await store.get_acks(version)), now + STORE_READ_INTERVAL_S
        stages = latest_stages(stored, local())
        barrier = policy_state.barrier(members, stages)
        if barrier.done or barrier.settled or clock() >= deadline:
            return barrier, stages
        await view.wait_change(min(0.05, max(0.0, deadline - clock())))
