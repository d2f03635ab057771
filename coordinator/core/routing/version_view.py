"""``VersionView``: one servable version's side of a route, what the router's choose step reads.

A route is hashed under each version it may be served at (one, or several within an async
update's ``max_staleness``); each version brings its own keys, eligible workers and index
depths, and its holders become the chooser's candidates. Pure core: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.core.fleet import Candidate, Fleet, RegisteredWorker, WorkerStatus
from coordinator.core.hashing import Namespace
from coordinator.core.index import MatchDetail


@dataclass(frozen=True, slots=True)
class VersionView:
    """One servable version's side of a route: its namespace, the prompt's keys under it, its
    eligible workers (load-floor order) and their index depths (pending entries included)."""

    ns: Namespace
    keys: list[bytes]
    eligible: list[RegisteredWorker]
    details: dict[str, MatchDetail]

    def without(self, workers: frozenset[str]) -> VersionView:
        """This view with ``workers`` taken out of the eligible workers and the depths."""
        return VersionView(self.ns, self.keys,
                           [s for s in self.eligible if s.worker_id not in workers],
                           {w: d for w, d in self.details.items() if w not in workers})

    def holders(self, fleet: Fleet, now: float, min_version: int | None) -> list[Candidate]:
        """The routable workers holding some of the prompt (pending included) at ``now``, as
        candidates in the order of ``details``: O(holders), not O(fleet)."""
        ns = self.ns
        floor = ns.policy_version if min_version is None else max(ns.policy_version, min_version)
        candidates = []
        for worker_id, detail in self.details.items():
            session = fleet.get(worker_id)
            if (
                session is not None
                and session.serves(ns.policy_version, floor, ns.model)
                and session.status(now) is WorkerStatus.READY
            ):
                candidates.append(Candidate(
                    worker_id, detail.pages, detail.lower_tier_pages, session.current_load(now)
                ))
        return candidates
