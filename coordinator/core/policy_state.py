"""The policy-version state machine: pure transitions over ``PolicyRecord``, no I/O, no clock.

    SERVING(v) --begin(sync)--> DRAINING(v -> v+1) --commit(v+1)--> SERVING(v+1)
    SERVING(v) --begin(async)-> SERVING(v -> v+1)  --commit(v+1)--> SERVING(v+1)
    either update in progress --abort(v+1)--> SERVING(v)

Each function takes the record the caller read and returns the record to write; it never
touches the store. The service runs the compare-and-set loop: read, compute with these
functions, ``cas_policy(read, computed)``, and on a lost CAS read again and re-validate (so a
trainer whose expected state went stale in the meantime gets ``Aborted``, never a double bump).
``epoch`` is left as read: the store writes ``expected.epoch + 1``.

Refusals: ``Aborted`` when the caller's view is stale or conflicts (wrong expected version, an
update already in progress, committing or aborting a version that is not the target);
``InvalidArgument`` when the request can never succeed (negative version, unknown mode or stage).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from coordinator.core.errors import Aborted, InvalidArgument

__all__ = [
    "FAILED",
    "MODES",
    "STAGES",
    "Barrier",
    "PolicyPhase",
    "PolicyRecord",
    "abort",
    "barrier",
    "begin",
    "check_integrity",
    "commit",
    "failed_stage",
    "failure_reason",
    "routes_blocked",
    "servable_versions",
    "stage_rank",
]

class PolicyPhase(enum.StrEnum):
    """SERVING: routes are answered (at the versions ``servable_versions`` allows). DRAINING:
    a sync update is in progress and routes wait (``routes_blocked``)."""

    SERVING = "serving"
    DRAINING = "draining"


@dataclass(frozen=True, slots=True)
class PolicyRecord:
    """The fleet's policy state. ``epoch`` increments on every successful CAS, so a watcher
    can tell that something changed even when (version, phase) came back to the same values.

    ``weights_uri`` is where ``version``'s weights load from and ``target_weights_uri`` where
    ``target_version``'s do; empty means the weights are seeded by the version. Both are kept so
    an abort can return to the current version's weights without remembering anything else.

    ``restored_at_ms`` (Unix ms, 0 = never) is when a coordinator last put back a state the
    store had lost (``coordinator.control.policy.high_water``): every replica refuses
    BeginPolicyUpdate for one lease after it, until every live worker has reported its version.
    """

    version: int = 0
    phase: PolicyPhase = PolicyPhase.SERVING
    target_version: int | None = None
    mode: str = "sync"
    epoch: int = 0
    weights_uri: str = ""
    target_weights_uri: str = ""
    restored_at_ms: int = 0


MODES = ("sync", "async")
"""``sync``: routes wait while every worker drains and loads (on-policy RL). ``async``: workers
move one by one and routes continue within ``max_staleness`` (bounded-staleness RL)."""

STAGES = ("member", "drained", "applied")
"""A worker's acknowledgements for a target version, in the order they happen; a later stage
implies the earlier ones (a worker that APPLIED the new weights has drained)."""

FAILED = "failed"
"""A member that reported it could not do a stage. Recorded as ``failed:<reason>`` (one value in
the store's acks hash, so every replica sees the reason); it outranks every stage of STAGES (a
failure ends the worker's part in that update) and never counts as acked."""


def failed_stage(reason: str) -> str:
    """The recorded stage of a member that failed, with ``reason`` (one line)."""
    return f"{FAILED}:{' '.join(reason.split())}"


def failure_reason(stage: str) -> str | None:
    """The reason of a ``failed_stage`` record; None for any other stage."""
    name, sep, reason = stage.partition(":")
    return reason if name == FAILED and sep else None


def stage_rank(stage: str) -> int:
    """Order of recorded stages: STAGES in order, then a failure; -1 for anything else."""
    if failure_reason(stage) is not None:
        return len(STAGES)
    return STAGES.index(stage) if stage in STAGES else -1


def _check_version(name: str, version: int) -> None:
    if version < 0:
        raise InvalidArgument(f"{name} must be non-negative, got {version}")


def begin(
    current: PolicyRecord, expected_version: int, mode: str = "sync", weights_uri: str = ""
) -> PolicyRecord:
    """Start the update ``current.version -> current.version + 1``.

    From SERVING(v) with ``expected_version == v``: target v+1, ``mode`` recorded,
    ``target_weights_uri = weights_uri`` (empty: the weights are seeded by the version).
    Sync -> phase DRAINING (routes wait); async -> phase stays SERVING.

    Refused with InvalidArgument for a negative ``expected_version`` or a mode not in MODES;
    with Aborted while an update is in progress, or when ``expected_version != v``.
    """
    _check_version("expected_version", expected_version)
    if mode not in MODES:
        raise InvalidArgument(f"unknown policy update mode {mode!r}; expected one of sync, async")
    if current.target_version is not None:
        raise Aborted(
            f"a policy update to version {current.target_version} is already in progress; "
            "commit or abort it first"
        )
    if expected_version != current.version:
        raise Aborted(
            f"stale expected_version {expected_version}: the policy is at {current.version}"
        )
    # Async keeps SERVING: routes continue during the update, each served by a worker whose
    # version is within max_staleness (servable_versions); only sync stops the fleet.
    phase = PolicyPhase.DRAINING if mode == "sync" else PolicyPhase.SERVING
    return dataclasses.replace(
        current,
        phase=phase,
        target_version=current.version + 1,
        mode=mode,
        target_weights_uri=weights_uri,
    )


def _check_target(current: PolicyRecord, version: int, verb: str) -> None:
    _check_version("version", version)
    if current.target_version is None:
        raise Aborted(
            f"cannot {verb} version {version}: no policy update is in progress "
            f"(the policy is at {current.version})"
        )
    if version != current.target_version:
        raise Aborted(
            f"cannot {verb} version {version}: the update in progress is to version "
            f"{current.target_version}"
        )


def commit(current: PolicyRecord, version: int) -> PolicyRecord:
    """Finish the update to ``version``: SERVING(version), no target, ``weights_uri`` becomes
    the target's; ``mode`` is kept (it still bounds what may be served, see
    servable_versions).

    Refused with Aborted when no update is in progress (including a repeated commit) or its
    target is not ``version``; InvalidArgument for a negative ``version``. Whether every worker
    acked is the caller's business (``barrier``): this records the decision.
    """
    _check_target(current, version, "commit")
    return dataclasses.replace(
        current,
        version=version,
        phase=PolicyPhase.SERVING,
        target_version=None,
        weights_uri=current.target_weights_uri,
        target_weights_uri="",
    )


def abort(current: PolicyRecord, version: int) -> PolicyRecord:
    """Abandon the update to ``version``: SERVING(current.version), no target; ``weights_uri``
    (the current version's) is untouched and the target's is dropped. ``mode`` is kept: after
    an aborted async update workers may still be spread over the staleness window.

    Refused as ``commit`` is.
    """
    _check_target(current, version, "abort")
    return dataclasses.replace(
        current, phase=PolicyPhase.SERVING, target_version=None, target_weights_uri=""
    )


def check_integrity(record: PolicyRecord) -> None:
    """Raise ValueError unless ``record`` is one the transitions above can produce: versions
    non-negative, a known mode, a target exactly one above the version (or none, and then no
    target weights), DRAINING only during a sync update."""
    if record.version < 0 or record.mode not in MODES:
        raise ValueError(f"bad policy record {record}: negative version or unknown mode")
    if record.target_version is None:
        if record.phase is not PolicyPhase.SERVING or record.target_weights_uri:
            raise ValueError(f"bad policy record {record}: draining or target weights, no target")
        return
    if record.target_version != record.version + 1:
        raise ValueError(f"bad policy record {record}: target is not version + 1")
    if (record.phase is PolicyPhase.DRAINING) != (record.mode == "sync"):
        raise ValueError(f"bad policy record {record}: sync updates drain, async ones do not")


@dataclass(frozen=True, slots=True)
class Barrier:
    """Who of ``members`` acknowledged a stage: ``acked | missing == members``, disjoint;
    ``done`` when nobody is missing (an empty barrier is done). ``failed`` (a subset of
    ``missing``): members that reported a failure, whom waiting cannot bring; ``settled`` when
    every missing member failed, so a commit need not wait out its deadline."""

    members: frozenset[str]
    acked: frozenset[str]
    missing: frozenset[str]
    done: bool
    failed: frozenset[str] = frozenset()

    @property
    def settled(self) -> bool:
        return self.missing <= self.failed


def barrier(members: Iterable[str], acks: Mapping[str, str], stage: str = "applied") -> Barrier:
    """The barrier of ``members`` (the workers live at begin) for ``stage``, given ``acks``
    (worker -> last stage acknowledged). A member counts as acked when its last stage is
    ``stage`` or a later one in STAGES. Acks of non-members are ignored (a worker that joined
    after begin learns the target at registration and stays out of the barrier); an
    unrecognised recorded stage counts as not acked, so the barrier waits rather than passes.
    InvalidArgument for a ``stage`` not in STAGES."""
    if stage not in STAGES:
        raise InvalidArgument(f"unknown ack stage {stage!r}; expected one of {', '.join(STAGES)}")
    group = frozenset(members)
    wanted = STAGES.index(stage)
    # NOTE: the upper bound leaves out a failure, which ranks above every stage
    # (``stage_rank``) but acknowledged nothing.
    acked = frozenset(m for m in group if wanted <= stage_rank(acks.get(m, "")) < len(STAGES))
    missing = group - acked
    failed = frozenset(m for m in missing if failure_reason(acks.get(m, "")) is not None)
    return Barrier(members=group, acked=acked, missing=missing, done=not missing, failed=failed)


def servable_versions(current: PolicyRecord, max_staleness: int) -> range:
    """The versions a route that asks for none may be served at, as a range (stop exclusive):

    - sync, SERVING(v): ``[v, v]``: on-policy means exactly the current version;
    - sync, DRAINING: empty (``range(v + 1, v + 1)``): no generation overlaps an update;
    - async, update to t in progress: ``[max(0, v - max_staleness), t]``;
    - async, SERVING(v): ``[max(0, v - max_staleness), v]``.

    InvalidArgument for a negative ``max_staleness``.
    """
    if max_staleness < 0:
        raise InvalidArgument(f"max_staleness must be non-negative, got {max_staleness}")
    v = current.version
    if current.mode != "async":
        if routes_blocked(current):
            return range(v + 1, v + 1)
        return range(v, v + 1)
    newest = v if current.target_version is None else current.target_version
    return range(max(0, v - max_staleness), newest + 1)


def routes_blocked(current: PolicyRecord) -> bool:
    """True while a sync update drains: routes wait (or fail UNAVAILABLE with a retry hint)."""
    return current.phase is PolicyPhase.DRAINING
