"""The policy state machine: exact transitions, every refusal and its message, barrier math,
the versions a route may be served at."""

from __future__ import annotations

import pytest

from coordinator.core import policy_state
from coordinator.core.errors import Aborted, InvalidArgument
from coordinator.core.policy_state import PolicyPhase, PolicyRecord

# Every record has epoch 9: the transitions leave epoch alone (the store bumps it on CAS).
SERVING_3 = PolicyRecord(version=3, epoch=9, weights_uri="s3://ckpt/3")
DRAINING_3_TO_4 = PolicyRecord(
    version=3,
    phase=PolicyPhase.DRAINING,
    target_version=4,
    mode="sync",
    epoch=9,
    weights_uri="s3://ckpt/3",
    target_weights_uri="s3://ckpt/4",
)
ASYNC_3_TO_4 = PolicyRecord(
    version=3,
    target_version=4,
    mode="async",
    epoch=9,
    weights_uri="s3://ckpt/3",
    target_weights_uri="s3://ckpt/4",
)

# --- begin --------------------------------------------------------------------------------


def test_sync_begin_drains_towards_the_next_version() -> None:
    assert policy_state.begin(SERVING_3, 3, "sync", "s3://ckpt/4") == DRAINING_3_TO_4


def test_async_begin_keeps_serving_towards_the_next_version() -> None:
    assert policy_state.begin(SERVING_3, 3, "async", "s3://ckpt/4") == ASYNC_3_TO_4


def test_begin_defaults_to_sync_with_weights_seeded_by_version() -> None:
    assert policy_state.begin(PolicyRecord(), 0) == PolicyRecord(
        phase=PolicyPhase.DRAINING, target_version=1
    )


def test_begin_refuses_a_stale_expected_version() -> None:
    for expected in (2, 4):
        with pytest.raises(Aborted) as raised:
            policy_state.begin(SERVING_3, expected)
        assert str(raised.value) == f"stale expected_version {expected}: the policy is at 3"


@pytest.mark.parametrize("in_progress", [DRAINING_3_TO_4, ASYNC_3_TO_4])
@pytest.mark.parametrize("expected", [3, 2])
def test_begin_refuses_while_an_update_is_in_progress(
    in_progress: PolicyRecord, expected: int
) -> None:
    with pytest.raises(Aborted) as raised:
        policy_state.begin(in_progress, expected, "async")
    assert str(raised.value) == (
        "a policy update to version 4 is already in progress; commit or abort it first"
    )


def test_begin_refuses_malformed_input() -> None:
    with pytest.raises(InvalidArgument) as raised:
        policy_state.begin(SERVING_3, -1)
    assert str(raised.value) == "expected_version must be non-negative, got -1"
    with pytest.raises(InvalidArgument) as raised:
        policy_state.begin(SERVING_3, 3, "eventual")
    assert str(raised.value) == "unknown policy update mode 'eventual'; expected one of sync, async"


# --- commit and abort ---------------------------------------------------------------------


@pytest.mark.parametrize("in_progress", [DRAINING_3_TO_4, ASYNC_3_TO_4])
def test_commit_serves_the_target_with_its_weights(in_progress: PolicyRecord) -> None:
    assert policy_state.commit(in_progress, 4) == PolicyRecord(
        version=4, mode=in_progress.mode, epoch=9, weights_uri="s3://ckpt/4"
    )


@pytest.mark.parametrize("in_progress", [DRAINING_3_TO_4, ASYNC_3_TO_4])
def test_abort_returns_to_the_current_version_and_its_weights(in_progress: PolicyRecord) -> None:
    assert policy_state.abort(in_progress, 4) == PolicyRecord(
        version=3, mode=in_progress.mode, epoch=9, weights_uri="s3://ckpt/3"
    )


@pytest.mark.parametrize("verb", ["commit", "abort"])
def test_commit_and_abort_refuse_a_version_that_is_not_the_target(verb: str) -> None:
    transition = policy_state.commit if verb == "commit" else policy_state.abort
    for version in (3, 5):
        with pytest.raises(Aborted) as raised:
            transition(DRAINING_3_TO_4, version)
        assert str(raised.value) == (
            f"cannot {verb} version {version}: the update in progress is to version 4"
        )


@pytest.mark.parametrize("verb", ["commit", "abort"])
def test_commit_and_abort_refuse_when_no_update_is_in_progress(verb: str) -> None:
    transition = policy_state.commit if verb == "commit" else policy_state.abort
    committed = policy_state.commit(DRAINING_3_TO_4, 4)
    with pytest.raises(Aborted) as raised:
        transition(committed, 4)  # a repeated commit, or an abort after the commit
    assert str(raised.value) == (
        f"cannot {verb} version 4: no policy update is in progress (the policy is at 4)"
    )


@pytest.mark.parametrize("verb", ["commit", "abort"])
def test_commit_and_abort_refuse_a_negative_version(verb: str) -> None:
    transition = policy_state.commit if verb == "commit" else policy_state.abort
    with pytest.raises(InvalidArgument) as raised:
        transition(DRAINING_3_TO_4, -4)
    assert str(raised.value) == "version must be non-negative, got -4"


def test_a_full_cycle_keeps_every_record_consistent() -> None:
    records = [SERVING_3]
    records.append(policy_state.begin(records[-1], 3, "async", "s3://ckpt/4"))
    records.append(policy_state.abort(records[-1], 4))
    records.append(policy_state.begin(records[-1], 3, "sync"))
    records.append(policy_state.commit(records[-1], 4))
    for record in records:
        policy_state.check_integrity(record)
    assert records[-1] == PolicyRecord(version=4, epoch=9)  # version 4 seeded by its version


def test_check_integrity_rejects_records_no_transition_produces() -> None:
    bad = [
        PolicyRecord(version=-1),
        PolicyRecord(mode="eventual"),
        PolicyRecord(phase=PolicyPhase.DRAINING),
        PolicyRecord(target_weights_uri="s3://ckpt/1"),
        PolicyRecord(version=3, target_version=5, mode="async"),
        PolicyRecord(version=3, target_version=4, mode="sync"),  # sync but not draining
        PolicyRecord(version=3, target_version=4, mode="async", phase=PolicyPhase.DRAINING),
    ]
    for record in bad:
        with pytest.raises(ValueError, match="bad policy record"):
            policy_state.check_integrity(record)


# --- barrier ------------------------------------------------------------------------------


def test_barrier_counts_members_at_or_past_the_stage() -> None:
    acks = {"a": "applied", "b": "drained", "c": "member", "late": "applied"}
    applied = policy_state.barrier(["a", "b", "c", "d"], acks)
    assert applied == policy_state.Barrier(
        members=frozenset("abcd"),
        acked=frozenset("a"),
        missing=frozenset("bcd"),
        done=False,
    )
    drained = policy_state.barrier(["a", "b", "c", "d"], acks, stage="drained")
    assert (drained.acked, drained.missing, drained.done) == (
        frozenset("ab"),
        frozenset("cd"),
        False,
    )


def test_barrier_is_done_when_every_member_acked() -> None:
    assert policy_state.barrier(["a", "b"], {"a": "applied", "b": "applied", "x": "member"}).done
    assert policy_state.barrier([], {"a": "drained"}) == policy_state.Barrier(
        frozenset(), frozenset(), frozenset(), True
    )


def test_barrier_treats_an_unknown_recorded_stage_as_not_acked() -> None:
    result = policy_state.barrier(["a", "b"], {"a": "loaded", "b": "applied"})
    assert (result.acked, result.missing) == (frozenset("b"), frozenset("a"))


def test_barrier_refuses_an_unknown_stage() -> None:
    with pytest.raises(InvalidArgument) as raised:
        policy_state.barrier(["a"], {}, stage="loaded")
    assert (
        str(raised.value) == "unknown ack stage 'loaded'; expected one of member, drained, applied"
    )


# --- what may be served -------------------------------------------------------------------


def test_sync_serves_exactly_the_current_version_and_nothing_while_draining() -> None:
    assert policy_state.servable_versions(SERVING_3, max_staleness=2) == range(3, 4)
    assert policy_state.routes_blocked(SERVING_3) is False
    assert policy_state.servable_versions(DRAINING_3_TO_4, max_staleness=2) == range(4, 4)
    assert policy_state.routes_blocked(DRAINING_3_TO_4) is True


def test_async_serves_within_the_staleness_bound_up_to_the_target() -> None:
    assert policy_state.servable_versions(ASYNC_3_TO_4, max_staleness=2) == range(1, 5)
    assert policy_state.servable_versions(ASYNC_3_TO_4, max_staleness=0) == range(3, 5)
    assert policy_state.servable_versions(ASYNC_3_TO_4, max_staleness=10) == range(0, 5)
    assert policy_state.routes_blocked(ASYNC_3_TO_4) is False
    async_serving = policy_state.commit(ASYNC_3_TO_4, 4)
    assert policy_state.servable_versions(async_serving, max_staleness=2) == range(2, 5)
    assert policy_state.routes_blocked(async_serving) is False


def test_servable_versions_refuses_a_negative_staleness() -> None:
    with pytest.raises(InvalidArgument) as raised:
        policy_state.servable_versions(SERVING_3, max_staleness=-1)
    assert str(raised.value) == "max_staleness must be non-negative, got -1"
