"""A worker's in-flight routes as one value: taken from one replica's books, restored into the
books of a replica that joins later, so that both count the same load on the worker.

Two kinds of route are in flight (``Router._reserve``): those the worker's heartbeats settle
(kept per worker, oldest first, without ids: a heartbeat settles the oldest ones) and awaited
routes, held by id until ``EndRoutes`` or their TTL (``awaited_routes``). Restoring replaces
the first kind (the snapshot is the owner's view of them; the joiner's own count of them,
from routes shared since it learned of the worker, is at most the lag's worth) and adds the
second by id (an id held or ended here already is skipped, so nothing counts twice and a route
ended before its snapshot arrived stays ended).

Pure core: time comes from the caller.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from coordinator.core.fleet import RegisteredWorker
from coordinator.core.routing.awaited_routes import AwaitedRoutes, HeldRoute


@dataclass(frozen=True, slots=True)
class InFlightRoutes:
    """The routes in flight to one worker incarnation: ``settled_by_heartbeats`` as
    ``(uncached_tokens, context_tokens)`` per route, oldest first; ``awaited`` by id."""

    worker_id: str
    incarnation: int
    settled_by_heartbeats: tuple[tuple[int, int], ...]
    awaited: tuple[HeldRoute, ...]

    def __post_init__(self) -> None:
        if any(min(route) < 0 for route in self.settled_by_heartbeats):
            raise ValueError("an in-flight route's tokens must be >= 0")


def inflight_of(sessions: Iterable[RegisteredWorker], awaited: AwaitedRoutes,
                now: float) -> list[InFlightRoutes]:
    """The routes in flight to each of ``sessions`` by these books at ``now``."""
    by_id = {s.worker_id: s for s in sessions}
    held = awaited.held_for(by_id, now)
    return [InFlightRoutes(s.worker_id, s.incarnation,
                           tuple(zip(s.inflight, s.inflight_context, strict=True)),
                           tuple(held.get(s.worker_id, ())))
            for s in by_id.values()]


def restore_inflight(session: RegisteredWorker, routes: InFlightRoutes, awaited: AwaitedRoutes,
                     now: float, max_inflight: int) -> None:
    """Make ``session``'s in-flight books ``routes`` (see the module docstring); the caller
    has checked that ``routes`` is about this incarnation."""
    # Settling is by count, oldest first: settle every route counted here, then hold the
    # snapshot's in its order (equal neighbours, a group's copies, in one call).
    session.report_load(session.load, len(session.inflight))
    for (uncached, context), run in itertools.groupby(routes.settled_by_heartbeats):
        session.hold_inflight(uncached, sum(1 for _ in run), max_inflight, context)
    awaited.restore(session, routes.awaited, now)
