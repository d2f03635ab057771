"""Where this replica's services report what changed, for the other replicas.

The Register/Sync state machine, policy updates and the operator calls (cordon) tell a
``ReplicationSink`` what their own workers and the policy state did; ``coordinator.replication``
implements it with a bounded outbox that its publisher drains. Without replicas the sink is
``NoReplication``. Every call returns at once (it queues, never waits on the store).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from coordinator.core.fleet import RegisteredWorker
from coordinator.core.index import PageEvent


class ReplicationSink(Protocol):
    """What a replica tells the others (see the module docstring)."""

    def registered(self, session: RegisteredWorker) -> None: ...
    def attached(self, session: RegisteredWorker) -> None: ...
    def detached(self, session: RegisteredWorker) -> None: ...
    def pages(self, session: RegisteredWorker, seq: int, events: Sequence[PageEvent]) -> None: ...
    def replaced(self, session: RegisteredWorker, seq: int,
                 keys_by_tier: Mapping[str, Sequence[bytes]]) -> None: ...
    def state(self, session: RegisteredWorker, completed_routes: int) -> None: ...
    def dropped(self, session: RegisteredWorker, reason: str) -> None: ...
    def cordoned(self, session: RegisteredWorker) -> None: ...
    def policy_changed(self, abort_running: bool) -> None: ...


class NoReplication:
    """The sink of a coordinator without replicas (the embedded store): reports go nowhere."""

    def registered(self, session: RegisteredWorker) -> None:
        pass

    def attached(self, session: RegisteredWorker) -> None:
        pass

    def detached(self, session: RegisteredWorker) -> None:
        pass

    def pages(self, session: RegisteredWorker, seq: int, events: Sequence[PageEvent]) -> None:
        pass

    def replaced(self, session: RegisteredWorker, seq: int,
                 keys_by_tier: Mapping[str, Sequence[bytes]]) -> None:
        pass

    def state(self, session: RegisteredWorker, completed_routes: int) -> None:
        pass

    def dropped(self, session: RegisteredWorker, reason: str) -> None:
        pass

    def cordoned(self, session: RegisteredWorker) -> None:
        pass

    def policy_changed(self, abort_running: bool) -> None:
        pass
