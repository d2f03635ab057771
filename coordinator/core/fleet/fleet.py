"""The coordinator's in-memory view of its workers: sessions, liveness, load, event sequencing.

Pure core: no grpc, redis or asyncio; time comes from the caller. The store holds the durable
registry (leases, incarnations); this module holds what routing needs on every request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from coordinator.core.errors import FailedPrecondition
from coordinator.core.fleet.peer_costs import PeerCosts
from coordinator.core.fleet.prefill_backlog import PrefillBacklog
from coordinator.core.fleet.registered_worker import (
    RegisteredWorker,
)
from coordinator.core.fleet.worker_load import WorkerLoad
from coordinator.core.tier_costs import TierCosts
from coordinator.wire import Reason


class Fleet:
    """Worker sessions by id, at most one (the newest incarnation) per worker id."""

    def __init__(
        self,
        load_floor: Callable[[WorkerLoad], float] | None = None,
        *,
        backlog_weight: float = 1.0,
        prefill_tokens_per_s: float = TierCosts().prefill_tokens_per_s,
    ) -> None:
        """``load_floor``: the router's load terms of a load; ``backlog_weight``: its weight of
        a prefill backlog token; ``prefill_tokens_per_s``: how fast a worker drains its prefill
        backlog (ValueError unless finite and > 0)."""
        PrefillBacklog(prefill_tokens_per_s)  # ValueError for a rate that is not finite, > 0
        self._load_floor = load_floor
        self._backlog_weight = backlog_weight
        self._prefill_tokens_per_s = prefill_tokens_per_s
        self._sessions: dict[str, RegisteredWorker] = {}
        self._peer_costs: dict[str, PeerCosts] = {}  # by model
        self._epoch = 0
        self._routable_cache: dict[tuple[int, int, str], list[RegisteredWorker]] = {}

    def changed(self) -> None:
        """A session's routability changed (connect, disconnect, cordon, fence, drain)."""
        self._epoch += 1
        self._routable_cache.clear()

    def set_serving_version(self, session: RegisteredWorker, version: int) -> int:
        """``session``'s worker now serves ``version`` (its keys are hashed under it): it is
        routed under that version from now on. Returns the version it served before."""
        old = session.policy_version
        session.policy_version = version
        session.served_versions.add(version)
        self.changed()
        return old

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[RegisteredWorker]:
        return iter(list(self._sessions.values()))

    def get(self, worker_id: str) -> RegisteredWorker | None:
        return self._sessions.get(worker_id)

    def put(self, session: RegisteredWorker) -> RegisteredWorker | None:
        """Install ``session``, returning the replaced (older incarnation) one, if any."""
        old = self._sessions.get(session.worker_id)
        if old is not None:
            self._forget_costs(old)
        self._sessions[session.worker_id] = session
        session.floor_of = self._load_floor
        session.backlog_weight = self._backlog_weight
        peers = self._peer_costs.get(session.model)
        if peers is None:
            peers = self._peer_costs[session.model] = PeerCosts(self._prefill_tokens_per_s)
        session.backlog = PrefillBacklog(self._prefill_tokens_per_s, peers)
        session.served_versions.add(session.policy_version)
        session._load_changed()
        self.changed()
        return old

    def remove(self, worker_id: str) -> RegisteredWorker | None:
        self.changed()
        session = self._sessions.pop(worker_id, None)
        if session is not None:
            self._forget_costs(session)
        return session

    def _forget_costs(self, session: RegisteredWorker) -> None:
        peers = self._peer_costs.get(session.model)
        if peers is not None:
            peers.forget(session.backlog)

    def require(self, worker_id: str, incarnation: int) -> RegisteredWorker:
        """The session of exactly this incarnation; FailedPrecondition for unknown or stale."""
        session = self._sessions.get(worker_id)
        if session is None:
            raise FailedPrecondition(f"unknown worker {worker_id!r}: register first",
                                     reason=Reason.REREGISTER)
        if session.incarnation != incarnation:
            raise FailedPrecondition(
                f"stale incarnation {incarnation} for worker {worker_id!r} "
                f"(current is {session.incarnation}): re-register", reason=Reason.REREGISTER,
            )
        return session

    def routable(
        self, now: float, *, version: int, min_version: int | None, model: str
    ) -> list[RegisteredWorker]:
        """READY workers of ``model`` serving exactly ``version`` (and at least ``min_version``),
        in ascending ``floor_at(now)`` order (least loaded first).

        The filtered list is cached until ``changed()`` and re-sorted per call (nearly sorted:
        one route changes one worker's load); leases are re-checked on every call, so a lapsed
        lease is unroutable at once even before the reaper notices it."""
        floor = version if min_version is None else max(version, min_version)
        key = (version, floor, model)
        cached = self._routable_cache.get(key)
        if cached is None:
            if len(self._routable_cache) >= 256:  # keys come from requests: stay bounded
                self._routable_cache.clear()
            cached = self._routable_cache[key] = [
                s for s in self._sessions.values() if s.takes_routes(version, floor, model)]
        cached.sort(key=lambda s: s.floor_at(now))
        return [s for s in cached if now < s.lease_deadline]

    def routable_worker(self, worker_id: str, now: float, *, version: int,
                        min_version: int | None, model: str) -> RegisteredWorker | None:
        """``worker_id`` if ``routable`` would list it, else None: O(1)."""
        floor = version if min_version is None else max(version, min_version)
        s = self._sessions.get(worker_id)
        if s is None or not s.takes_routes(version, floor, model) or now >= s.lease_deadline:
            return None
        return s

    def lapsed(self, now: float) -> list[RegisteredWorker]:
        """Connected sessions whose lease ran out (they must be treated as disconnected)."""
        return [s for s in self._sessions.values() if s.connected and now >= s.lease_deadline]

    def expired(self, now: float, grace: float) -> list[RegisteredWorker]:
        """Disconnected sessions past the grace period: their index entries must go."""
        return [
            s
            for s in self._sessions.values()
            if not s.connected
            and s.disconnected_at is not None
            and now - s.disconnected_at >= grace
        ]
