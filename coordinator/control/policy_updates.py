"""Policy updates end to end on one coordinator: Begin/Commit/Abort through the store's
compare-and-set, DRAIN/APPLY/RESUME commands to this coordinator's workers, the APPLIED barrier,
fencing, and following updates made through other replicas. The transitions themselves are
``coordinator.core.policy_state``; the record held here, and the routes and watchers waiting on
it, are ``coordinator.control.policy.policy_view``.

Sync mode (on-policy RL): Begin(v) -> DRAINING(v->v+1); every live worker gets DRAIN, acks
DRAINED, gets APPLY(v+1) and acks APPLIED once it has loaded v+1 and dropped v's pages; Commit
waits for APPLIED from every worker live at Begin until its deadline, fences the missing, writes
SERVING(v+1) and sends RESUME. Routes wait (or fail UNAVAILABLE, reason DRAINING, with RetryInfo)
meanwhile.
Async mode: no drain; workers get APPLY one at a time while routes keep flowing to any version
within ``max_staleness``; Commit waits for the same barrier.
Shards: the members are every shard's (``control.shard_members``), recorded in the store with
their acks; each shard's replicas relay the commands to their own members as they follow.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import replace

import structlog

from coordinator.config import CoordinatorConfig
from coordinator.control.policy import READ_ATTEMPTS, CommitResult, PolicyView, latest_stages
from coordinator.control.policy.policy_acks import await_barrier, failures_of
from coordinator.control.replication_sink import ReplicationSink
from coordinator.control.sessions import WorkerStreams
from coordinator.control.sessions.sync_messages import Command
from coordinator.control.shard_members import local_members, members_elsewhere
from coordinator.core import policy_state
from coordinator.core.errors import Aborted, FailedPrecondition
from coordinator.core.fleet import Fleet, RegisteredWorker
from coordinator.core.policy_state import PolicyRecord
from coordinator.store.protocol import MetadataStore, StoreUnavailable
from coordinator.wire import Reason

log = structlog.get_logger(__name__)


class PolicyUpdates:
    """Owns this coordinator's view of the policy state (``record``) and runs updates."""

    def __init__(
        self, *, config: CoordinatorConfig, store: MetadataStore, fleet: Fleet,
        view: PolicyView, streams: WorkerStreams, replication: ReplicationSink,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``view``: the record read and written here (routes wait on it); ``streams``: how
        commands reach this replica's workers; ``replication``: told after each change made
        here (Begin's abort_running flag), so the other replicas hear of it at once rather
        than at their next poll."""
        self._config = config
        self._store = store
        self._fleet = fleet
        self._view = view
        self._streams = streams
        self._replication = replication
        self._clock = clock
        self._rolling: asyncio.Task[None] | None = None
        # target version -> worker -> last stage seen here ("member", "drained", "applied"): the
        # barrier counts these at once; the store's copy covers acks taken by other replicas.
        self._stages: dict[int, dict[str, str]] = {}
        self._abort_running: dict[int, bool] = {}  # target -> its DRAINs stop generation
        # ((target, epoch), clock) when this coordinator first saw the update in progress.
        self._first_seen: tuple[tuple[int, int], float] | None = None
        self.last: CommitResult | None = None
        # target -> this replica's workers already sent their command for it (by Begin here,
        # or by ``follow`` relaying an update begun through another replica).
        self._relayed: dict[int, set[str]] = {}
        # One change at a time per replica: a ``follow`` must not relay an update this replica
        # is itself beginning or finishing.
        self._lock = asyncio.Lock()

    @property
    def record(self) -> PolicyRecord:
        """The policy state this replica holds (``PolicyView.record``)."""
        return self._view.record

    async def _cas(self, step: Callable[[PolicyRecord], PolicyRecord]) -> PolicyRecord:
        """Apply ``step`` to the stored record by compare-and-set, re-reading and re-validating
        on a lost race (so a stale caller gets ``Aborted`` from ``step``, never a double bump)."""
        for _ in range(READ_ATTEMPTS):
            current = await self._view.read()
            new = step(current)
            if await self._store.cas_policy(current, new):
                written = replace(new, epoch=current.epoch + 1)
                self._view.high_water.saw(written)
                self._view.set(written)
                return written
        raise Aborted("the policy state kept changing under concurrent updates: retry")

    # ------------------------------------------------------------------ begin / ack / commit

    async def begin(
        self, expected_version: int, mode: str, weights_uri: str, abort_running: bool = False
    ) -> PolicyRecord:
        async with self._lock:
            record = await self._begin(expected_version, mode, weights_uri, abort_running)
        self._replication.policy_changed(abort_running)
        return record

    async def _begin(
        self, expected_version: int, mode: str, weights_uri: str, abort_running: bool
    ) -> PolicyRecord:
        def step(current: PolicyRecord) -> PolicyRecord:
            self._view.check_not_restoring(current)  # on the state read: the read may restore
            return policy_state.begin(current, expected_version, mode, weights_uri)

        record = await self._cas(step)
        target = record.target_version
        assert target is not None  # begin always sets a target
        members = local_members(self._fleet, record.version, self._clock())
        # Shards: the other shards' members from their store records (their owners relay).
        elsewhere = members_elsewhere(await self._store.list_workers(), shard=self._config.shard,
                                      version=record.version) if self._config.shard else []
        stages = self._stages.setdefault(target, {})
        for worker_id in [*(s.worker_id for s in members), *elsewhere]:
            stages[worker_id] = "member"
            await self._store.record_ack(target, worker_id, "member")
        log.info("policy_state.begin", version=record.version, target=target, mode=record.mode,
                 members=[s.worker_id for s in members], other_shards=elsewhere)
        relayed = self._relayed.setdefault(target, set())
        relayed.update(s.worker_id for s in members if self._streams.has_stream(s.worker_id))
        self._abort_running[target] = abort_running
        if record.mode == "sync":
            for session in members:  # the other replicas' workers get theirs from them
                session.draining = True
                self._streams.send(session.worker_id,
                                    Command("drain", target, abort_running=abort_running))
            self._fleet.changed()
        else:
            local = [s for s in members if s.worker_id in relayed]
            self._rolling = asyncio.create_task(self._roll(target, local, weights_uri))
        return record

    async def _roll(self, target: int, members: list[RegisteredWorker], uri: str) -> None:
        """Async mode: APPLY to one worker at a time, each waiting for its APPLIED ack."""
        for session in members:
            if self.record.target_version != target:
                return  # aborted or committed meanwhile
            if not self._streams.send(session.worker_id, Command("apply", target, uri)):
                continue
            deadline = self._clock() + self._config.barrier_timeout_ms / 1000
            while session.policy_version != target and self._clock() < deadline:
                await self._view.wait_change(0.05)

    async def ack(self, session: RegisteredWorker, stage: str, version: int,
                  reason: str = "") -> None:
        """A worker's PolicyAck. DRAINED -> send it APPLY; APPLIED -> it now serves ``version``;
        FAILED -> it is fenced at once (unroutable at any version), and ``reason`` is kept in
        the update's status."""
        record = self.record
        if version not in (record.target_version, record.version):
            log.warning("policy.stale_ack", worker=session.worker_id, stage=stage,
                        version=version, target=record.target_version)
            return
        if stage == policy_state.FAILED:
            self._failed(session, version, reason or "no reason given")
            stage = policy_state.failed_stage(reason or "no reason given")
        if version == record.target_version:
            self._stages.setdefault(version, {})[session.worker_id] = stage
            try:
                await self._store.record_ack(version, session.worker_id, stage)
            except StoreUnavailable:
                # Kept locally (the barrier counts it); the stream must survive a Redis blip.
                log.warning("policy.ack_not_persisted", worker=session.worker_id, stage=stage,
                            version=version)
        if stage == "drained" and version == record.target_version and record.mode == "sync":
            self._streams.send(
                session.worker_id, Command("apply", version, record.target_weights_uri)
            )
        elif stage == "applied":
            old = self._fleet.set_serving_version(session, version)
            log.info("worker.version", worker=session.worker_id, old=old, new=version)
            self._replication.state(session, 0)
            try:
                await self._store.update_worker(
                    session.worker_id, session.incarnation, policy_version=str(version)
                )
            except StoreUnavailable:
                log.warning("policy.version_not_persisted", worker=session.worker_id,
                            version=version)
        self._view.notify()

    def _failed(self, session: RegisteredWorker, version: int, reason: str) -> None:
        """A member could not do a stage: unroutable now, not at the commit (it may be holding
        weights of neither version)."""
        session.fenced = True
        session.draining = False
        self._fleet.changed()
        log.warning("worker.fenced", worker=session.worker_id, version=version, reason=reason,
                    cause="failed")

    async def failures(self, version: int) -> dict[str, str]:
        """Members of the update to ``version`` that reported a failure, with their reasons
        (acks taken by any replica)."""
        return failures_of(latest_stages(await self._store.get_acks(version),
                                   self._stages.get(version, {})))

    async def commit(self, version: int, timeout: float) -> CommitResult:
        """Wait for APPLIED(version) from every member up to ``timeout`` seconds (less when
        every member still missing reported a failure), fence the missing, then SERVING(version)
        and RESUME to the rest. When members failed and none applied, the update is aborted
        instead (SERVING at the current version, as ``abort``) and FailedPrecondition says why:
        committing would leave nothing serving the new version."""
        record = await self._view.refresh()
        policy_state.commit(record, version)  # refuses a wrong target before any waiting
        members = await self._members(version)
        barrier, stages = await await_barrier(
            self._store, self._view, lambda: self._stages.get(version, {}), version, members,
            self._clock() + timeout, self._clock)
        failures = failures_of(stages)
        if failures and not barrier.acked:
            await self.abort(version)
            reasons = "; ".join(f"{w}: {r}" for w, r in failures.items())
            raise FailedPrecondition(f"the update to version {version} was aborted: no member "
                                     f"applied it and {len(failures)} failed ({reasons})")
        async with self._lock:
            record = await self._cas(lambda cur: policy_state.commit(cur, version))
            self._stages[version] = latest_stages(stages, self._stages.get(version, {}))
            self._finish(version, committed=True, acked=barrier.acked)
        self._replication.policy_changed(False)
        result = CommitResult(record, tuple(sorted(barrier.acked)), tuple(sorted(barrier.missing)),
                              failures)
        self.last = result
        log.info("policy_state.commit", version=version, acked=result.acked, fenced=result.fenced,
                 failed=sorted(failures))
        return result

    def _finish(self, target: int, *, committed: bool, acked: frozenset[str]) -> None:
        """The update to ``target`` ended. Committed: members in ``acked`` resume, the rest
        are fenced; aborted: every member re-applies the current weights and resumes. Commands
        reach this replica's workers; the others' owners do the same when they follow."""
        record = self.record
        members = self._stages.get(target, {})
        for worker_id in sorted(members):
            session = self._fleet.get(worker_id)
            if session is None:
                continue
            session.draining = False
            if not committed:
                # Always: an APPLY of the abandoned version may still be in flight to it. The
                # worker runs commands in order and skips a reload of what it already serves.
                self._streams.send(worker_id, Command("apply", record.version,
                                                       record.weights_uri))
                self._streams.send(worker_id, Command("resume", record.version))
            elif worker_id in acked:
                self._streams.send(worker_id, Command("resume", target))
            else:
                self._fence(worker_id, target)
        self._fleet.changed()
        self._relayed.pop(target, None)

    def _fence(self, worker_id: str, version: int) -> None:
        session = self._fleet.get(worker_id)
        if session is None:
            return
        session.fenced = True
        session.draining = False
        log.warning("worker.fenced", worker=worker_id, version=version)
        self._streams.close(
            worker_id, f"fenced: missed the barrier for policy version {version}; re-register",
            Reason.FENCED,
        )

    async def _members(self, version: int) -> frozenset[str]:
        acks = await self._store.get_acks(version)
        return frozenset(acks) | frozenset(self._stages.get(version, {}))

    async def reconnected(self, session: RegisteredWorker) -> None:
        """A member's stream came back (here, or moved here from another replica) mid-update:
        resend the command its stage calls for (a command or ack lost with the old stream must
        not get it fenced). The worker skips what it already did (an APPLY of the version it
        serves is acked without a reload)."""
        record = self.record
        target = record.target_version
        if target is None:
            return
        stage = self._stages.get(target, {}).get(session.worker_id)
        if stage is None:  # a member of an update begun through another replica
            stage = (await self._load_members(target)).get(session.worker_id)
        if stage is None or stage == "applied":
            return
        self._relayed.setdefault(target, set()).add(session.worker_id)
        if record.mode == "sync" and stage == "member":
            session.draining = True
            self._fleet.changed()
            self._command_for(session, record, stage)
        else:
            self._streams.send(
                session.worker_id, Command("apply", target, record.target_weights_uri)
            )
        log.info("policy.command_resent", worker=session.worker_id, stage=stage, target=target)

    async def abort(self, version: int) -> PolicyRecord:
        """Back to SERVING(current): every member is told to (re)apply the current weights and
        resume."""
        async with self._lock:
            record = await self._cas(lambda cur: policy_state.abort(cur, version))
            await self._load_members(version)
            self._finish(version, committed=False, acked=frozenset())
        self._replication.policy_changed(False)
        log.info("policy_state.abort", version=version, back_to=record.version)
        return record

    async def _load_members(self, target: int) -> dict[str, str]:
        """Every member of the update to ``target`` with its furthest stage, from the store
        (acks taken by any replica) merged with what this replica saw."""
        merged = latest_stages(await self._store.get_acks(target), self._stages.get(target, {}))
        self._stages[target] = merged
        return merged

    # ------------------------------------------------------------------ other replicas' updates

    async def follow(self, *, abort_running: bool | None = None) -> None:
        """Catch up with the stored state changed through another replica (its PolicyChanged
        event, or the periodic re-read): an update that ended sends RESUME/APPLY or fences
        this replica's members as the commit or abort calls for; an update in progress sends
        this replica's members the command their stage calls for, once each."""
        async with self._lock:
            old = self.record
            new = await self._view.read()
            if new.epoch < old.epoch:
                return  # a read older than what we already hold
            self._view.set(new)
            ended = old.target_version
            if ended is not None and ended != new.target_version:
                stages = await self._load_members(ended)
                committed = new.version >= ended
                acked = frozenset(w for w, stage in stages.items() if stage == "applied")
                self._finish(ended, committed=committed, acked=acked)
            target = new.target_version
            if target is None:
                return
            if abort_running is not None:
                self._abort_running.setdefault(target, abort_running)
            await self._relay(new, await self._load_members(target))

    async def _relay(self, record: PolicyRecord, stages: dict[str, str]) -> None:
        target = record.target_version
        assert target is not None
        relayed = self._relayed.setdefault(target, set())
        rolling: list[RegisteredWorker] = []
        for worker_id, stage in sorted(stages.items()):
            session = self._fleet.get(worker_id)
            if (worker_id in relayed or session is None
                    or not self._streams.has_stream(worker_id)):
                continue
            relayed.add(worker_id)
            if record.mode == "async":
                if stage != "applied":
                    rolling.append(session)
                continue
            session.draining = stage != "applied"
            self._fleet.changed()
            self._command_for(session, record, stage)
        if rolling:
            self._rolling = asyncio.create_task(
                self._roll(target, rolling, record.target_weights_uri)
            )

    def _command_for(self, session: RegisteredWorker, record: PolicyRecord, stage: str) -> None:
        """Send the command a sync update's member at ``stage`` is due."""
        target = record.target_version
        assert target is not None
        if stage == "member":
            abort_running = self._abort_running.get(target, False)
            self._streams.send(session.worker_id,
                                Command("drain", target, abort_running=abort_running))
        elif stage == "drained":
            self._streams.send(session.worker_id,
                                Command("apply", target, record.target_weights_uri))

    async def expire(self) -> None:
        """Abort an update nobody committed within ``update_timeout_ms`` (a trainer that died
        mid-update must not block routes forever). Timed from when this coordinator first saw
        the update, so any replica can do it; the CAS makes a second abort a no-op."""
        record = self.record
        target = record.target_version
        if target is None:
            self._first_seen = None
            return
        now = self._clock()
        if self._first_seen is None or self._first_seen[0] != (target, record.epoch):
            self._first_seen = ((target, record.epoch), now)
            return
        if now - self._first_seen[1] < self._config.update_timeout_ms / 1000:
            return
        log.warning("policy.update_timed_out", target=target,
                    after_ms=self._config.update_timeout_ms)
        with contextlib.suppress(Aborted):
            await self.abort(target)

    # ------------------------------------------------------------------ routes and watchers

