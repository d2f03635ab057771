"""``PolicyView``: this replica's view of the policy state (which weights version is live).

The metadata store holds the truth, changed only by compare-and-set (``policy_updates``); this
holds the last record read or written here, keeps it fresh (``check_fresh``), restores a store
that went back (``high_water``), and is what routes, registrations and watchers read and wait
on: routes wait here while a sync update drains (``await_routable``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable

import structlog

from coordinator.config import CoordinatorConfig
from coordinator.control.policy.high_water import HighWater
from coordinator.core import policy_state
from coordinator.core.errors import Aborted, FailedPrecondition, Unavailable
from coordinator.core.policy_state import PolicyRecord
from coordinator.store.protocol import MetadataStore
from coordinator.wire import Reason

log = structlog.get_logger(__name__)

READ_ATTEMPTS = 16
"""Reads (and compare-and-set rounds) tried before a change racing with others is Aborted."""


class PolicyView:
    """The policy record this replica holds, and the waits on its changes."""

    def __init__(
        self, *, config: CoordinatorConfig, store: MetadataStore, high_water: HighWater,
        clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._config = config
        self._store = store
        self._clock = clock
        self._wall_clock = wall_clock  # restored_at_ms is compared across replicas
        self.high_water = high_water
        self.record = PolicyRecord()
        self.restores = 0  # times the store was found behind the high-water mark and restored
        # Clock at the start of the newest successful read of the stored state: routes are
        # refused once it is older than policy_stale_ms (see ``check_fresh``).
        self.read_at = clock()
        self._changed = asyncio.Event()  # replaced (set, then renewed) on every change

    def set(self, record: PolicyRecord) -> None:
        """Hold ``record`` (wakes every waiter when it differs)."""
        if record != self.record:
            self.record = record
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()

    async def refresh(self) -> PolicyRecord:
        """Re-read the store (the truth shared by every replica)."""
        self.set(await self.read())
        return self.record

    async def read(self) -> PolicyRecord:
        """The stored state, never behind the high-water mark: a store that went back (it lost
        data) is restored first (``_restore``). Every read goes through here: it is what keeps
        this replica fresh (``check_fresh``) and what catches a store that forgot."""
        for _ in range(READ_ATTEMPTS):
            started = self._clock()
            stored = await self._store.get_policy()
            if self.high_water.behind(stored):
                restored = await self._restore(stored)
                if restored is None:
                    continue  # the store changed meanwhile (or the read was an old one)
                stored = restored
            self.high_water.saw(stored)
            self.read_at = max(self.read_at, started)
            return stored
        raise Aborted("the policy state kept changing under concurrent updates: retry")

    async def _restore(self, stored: PolicyRecord) -> PolicyRecord | None:
        """Write the high-water state over ``stored`` by compare-and-set; None when the store
        no longer holds ``stored``."""
        now_ms = int(self._wall_clock() * 1000)
        restored = self.high_water.restoration(stored, self.record, now_ms)
        if not await self._store.restore_policy(stored, restored):
            return None
        self.restores += 1
        # A fresh logger: a rare alarm, and log capture (tests) must see it whatever is cached.
        structlog.get_logger(__name__).error(
            "policy.version_restored", alarm=True, stored_version=stored.version,
            stored_epoch=stored.epoch, restored_version=restored.version,
            restored_phase=restored.phase.value, restored_target=restored.target_version,
            restored_epoch=restored.epoch,
            detail="the metadata store went back (data lost, or an old backup): restored the "
            "highest policy state seen here; BeginPolicyUpdate is refused for one lease",
        )
        return restored

    async def worker_reported(self, version: int) -> None:
        """A worker (Register, heartbeat) has loaded ``version``. A version above every one
        seen here is checked against the store at once, so nothing lower is answered again;
        raises StoreUnavailable when the store cannot be read."""
        if not self.high_water.report(version):
            return
        if await self._store.get_acks(version):
            # An update to it was begun in this store (since aborted, or followed here
            # late): the worker holds a target's weights, not a version the store forgot.
            self.high_water.saw_target(version)
        else:
            log.warning("policy.version_reported_above_store", version=version,
                        held=self.record.version)
        await self.refresh()

    def check_fresh(self) -> None:
        """Unavailable (with a retry hint) when this replica has not read the policy state for
        ``policy_stale_ms``: a commit may have happened that it has not seen, and a route it
        answers could carry the old version."""
        age = self._clock() - self.read_at
        if age > self._config.policy_stale_s:
            raise Unavailable(
                f"this coordinator has not read the policy state for {age * 1000:.0f} ms "
                f"(policy_stale_ms is {self._config.policy_stale_s * 1000:.0f}): the metadata "
                "store is unreachable from here; retry, or another coordinator",
                reason=Reason.POLICY_STALE, retry_after_ms=self._config.route_retry_ms,
            )

    def check_not_restoring(self, current: PolicyRecord) -> None:
        """FailedPrecondition within one lease of a restore (by any replica: the time is in
        the record): workers that have not reported yet may hold a higher version."""
        if not current.restored_at_ms:
            return
        left_ms = current.restored_at_ms + self._config.lease_ms - self._wall_clock() * 1000
        if left_ms > 0:
            raise FailedPrecondition(
                f"the policy state was restored to version {current.version} after the "
                "metadata store lost it; policy updates resume once every live worker has "
                f"reported its version (one lease): retry in {left_ms:.0f} ms",
                reason=Reason.POLICY_RESTORED, retry_after_ms=math.ceil(left_ms),
            )

    def serving_version(self) -> int:
        """The version a route without an explicit one is served under."""
        return self.record.version

    def servable_versions(self) -> range:
        """The versions a route may be served under now (the serving one, and in an async
        update those within ``max_staleness``)."""
        return policy_state.servable_versions(self.record, self._config.max_staleness)

    def notify(self) -> None:
        """Wake every waiter (a worker's ack changed the barrier, not the record)."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait_change(self, timeout: float) -> None:
        """Return at the next change (or ``notify``), or after ``timeout`` seconds."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    # ------------------------------------------------------------------ routes and watchers

    async def wait_routable(self, timeout: float) -> None:
        """Return once routes may flow (no sync update draining), or after ``timeout`` seconds:
        the caller decides what to answer when still blocked."""
        deadline = self._clock() + timeout
        while policy_state.routes_blocked(self.record) and self._clock() < deadline:
            await self.wait_change(min(0.05, deadline - self._clock()))

    async def await_routable(
        self, *, pinned_version: bool, time_left: Callable[[], float | None]
    ) -> None:
        """While a sync update drains, a route without a pinned version waits for it (up to
        ``route_wait_ms``, and 50 ms short of what ``time_left()`` says remains of the caller's
        deadline), then is refused UNAVAILABLE, reason DRAINING, with RetryInfo
        (``route_retry_ms``): no generation may start between DRAIN and RESUME. A pinned
        version never waits (the router checks it). Returns at once when nothing drains."""
        if pinned_version or not policy_state.routes_blocked(self.record):
            return
        wait = self._config.route_wait_ms / 1000
        remaining = time_left()
        if remaining is not None:
            wait = min(wait, max(0.0, remaining - 0.05))
        await self.wait_routable(wait)
        if policy_state.routes_blocked(self.record):
            raise Unavailable(
                f"policy update to version {self.record.target_version} is draining the "
                "fleet: retry", reason=Reason.DRAINING, retry_after_ms=self._config.route_retry_ms,
                metadata={"target_version": str(self.record.target_version)},
            )

    async def watch(self) -> AsyncIterator[PolicyRecord]:
        """The current state, then every change (local at once; other replicas' within a poll)."""
        poll = self._config.policy_poll_ms / 1000
        last: PolicyRecord | None = None
        while True:
            record = await self.refresh()
            if record != last:
                last = record
                yield record
            await self.wait_change(poll)
