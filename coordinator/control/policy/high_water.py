"""The high-water mark: the highest policy state and worker incarnations this process has seen,
so a store that lost data (Redis restarted without persistence, an old backup restored, a
restarted coordinator on the embedded store) is caught instead of believed.

Pure core: no I/O, no clock. ``PolicyUpdates`` consults it on every read of the policy state
and restores the store when it is ``behind``; the worker sessions feed it what workers report
(their loaded version at Register and in heartbeats, their incarnation at hello) and take
incarnation floors from it.

What counts as seen:
- a policy record read from (or written to) the store: its version, epoch and target;
- a version a worker reports having loaded, when it is above every version and target this
  process has seen: the store must have held it (committed, or an update to it begun and the
  record lost), so nothing lower may be answered again. A version that was only a target here
  (an aborted update whose weights a worker still holds) is not evidence: it was never served.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

from coordinator.core.policy_state import PolicyPhase, PolicyRecord

_MAX_WORKERS = 65_536  # incarnations remembered (hello carries ids from the network: bounded)
_MAX_INCARNATION = 2**53


class HighWater:
    """What this process has seen; only ever rises."""

    def __init__(self, max_workers: int = _MAX_WORKERS) -> None:
        self.version = 0  # highest version served (read as committed, or reported by a worker)
        self.epoch = 0  # highest policy epoch read from the store
        self.target = -1  # highest update target read from the store (-1: none)
        self.reported = 0  # highest version a worker reported having loaded
        self._incarnations: OrderedDict[str, int] = OrderedDict()
        self._max_workers = max_workers

    # ------------------------------------------------------------------ policy

    def saw(self, record: PolicyRecord) -> None:
        """``record`` is (or was) the store's state."""
        self.version = max(self.version, record.version)
        self.epoch = max(self.epoch, record.epoch)
        if record.target_version is not None:
            self.target = max(self.target, record.target_version)

    def saw_target(self, version: int) -> None:
        """The store knows ``version`` as the target of an update (its acknowledgements)."""
        self.target = max(self.target, version)

    def report(self, version: int) -> bool:
        """A worker has loaded ``version``. True when that is news: above every version and
        target seen so far (the caller then re-reads the store, which may be behind)."""
        if version <= max(self.version, self.target, self.reported):
            return False
        self.reported = version
        return True

    def floor(self, stored: PolicyRecord) -> int:
        """The lowest version the store may hold, given what was seen and reported."""
        target = max(self.target, -1 if stored.target_version is None else stored.target_version)
        reported = self.reported if self.reported > target else 0
        return max(self.version, reported)

    def behind(self, stored: PolicyRecord) -> bool:
        """Whether ``stored`` is older than something this process saw: a lower version than
        one served, or a lower epoch than one read (the store went back in time)."""
        return stored.version < self.floor(stored) or stored.epoch < self.epoch

    def restoration(self, stored: PolicyRecord, held: PolicyRecord, now_ms: int) -> PolicyRecord:
        """What to write over ``stored`` (which is ``behind``) at Unix time ``now_ms``, given
        ``held``, the state this process holds: ``held`` itself when it is at the floor (an
        update in progress is kept, with its target and weights), else the stored state when
        it is at the floor, else SERVING at the floor (a version only workers reported: its
        weights URI is unknown here, so empty). The epoch is lifted above every epoch seen, so
        every reader takes the restored state as the newest; ``restored_at_ms`` is ``now_ms``."""
        version = max(stored.version, self.floor(stored))
        epoch = max(self.epoch, stored.epoch, held.epoch) + 1
        if held.version == version:
            base = held
        elif stored.version == version:
            base = stored
        else:
            base = PolicyRecord(version=version, phase=PolicyPhase.SERVING, mode=held.mode)
        return dataclasses.replace(base, epoch=epoch, restored_at_ms=now_ms)

    # ------------------------------------------------------------------ incarnations

    def saw_incarnation(self, worker_id: str, incarnation: int) -> None:
        """``worker_id`` held ``incarnation`` (a hello, a registration, a replica's event).
        Numbers past 2**53 are ignored: no store hands them out, and Redis' Lua would round
        them."""
        if incarnation > _MAX_INCARNATION or incarnation <= self._incarnations.get(worker_id, 0):
            return
        self._incarnations[worker_id] = incarnation
        self._incarnations.move_to_end(worker_id)
        while len(self._incarnations) > self._max_workers:
            self._incarnations.popitem(last=False)  # the longest unheard-of goes first

    def incarnation(self, worker_id: str) -> int:
        """The highest incarnation seen for ``worker_id``; 0 when none."""
        return self._incarnations.get(worker_id, 0)
