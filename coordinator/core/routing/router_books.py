"""What a router books of the routes in flight to each worker, whoever chose them: a decision
another replica made (``take_reservation``), another replica's routes in flight when this one
joins (``inflight``, ``restore_inflight``), routes ended elsewhere (``end_remote_routes``) and
routes past their TTL (``expire_awaited``). ``Router`` adds its own decisions to the same books.

Pure core: no I/O; time comes from the injected ``clock``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from coordinator.core.fleet import Fleet, RegisteredWorker
from coordinator.core.index import PrefixIndex
from coordinator.core.routing.awaited_routes import AwaitedRoutes, EndedRoutes
from coordinator.core.routing.inflight_snapshot import (
    InFlightRoutes,
    inflight_of,
    restore_inflight,
)
from coordinator.core.routing.route_types import RouteReservation


class RouterBooks:
    """The in-flight books over ``fleet`` and ``index``; mutates pending entries, workers'
    in-flight accounting and prefill backlogs, and ``awaited``."""

    def __init__(self, *, index: PrefixIndex, fleet: Fleet, clock: Callable[[], float],
                 awaited: AwaitedRoutes, max_inflight: int) -> None:
        self._index = index
        self._fleet = fleet
        self._clock = clock
        self.awaited = awaited
        self.max_inflight = max_inflight

    def take_reservation(self, reservation: RouteReservation) -> bool:
        """Count a decision another replica made, as if made here (pending entries, in-flight
        load; not this replica's routing totals). False, changing nothing, when the worker is
        not the incarnation it was routed to."""
        session = self._fleet.get(reservation.worker_id)
        if session is None or session.incarnation != reservation.incarnation:
            return False
        if reservation.pending_keys:
            self._index.add_pending(session.worker_id, reservation.pending_keys)
        now = self._clock()
        if reservation.awaited:
            self.awaited.hold(session, reservation.uncached_tokens, reservation.copies,
                              now, route_id=reservation.route_id,
                              context_tokens=reservation.context_tokens)
        else:
            session.hold_inflight(reservation.uncached_tokens, reservation.copies,
                                  self.max_inflight, reservation.context_tokens)
        work = reservation.prefill_tokens
        if work is None:  # an older replica: the most it could have counted
            work = reservation.uncached_tokens * reservation.copies
        keys = reservation.pending_keys
        session.queue_prefill(work, now, keys, reservation.context_tokens)
        return True

    def inflight(self, sessions: Iterable[RegisteredWorker]) -> list[InFlightRoutes]:
        """The routes in flight to each of ``sessions`` here (for a replica that joins)."""
        return inflight_of(sessions, self.awaited, self._clock())

    def restore_inflight(self, routes: InFlightRoutes) -> bool:
        """Take another replica's in-flight routes of a worker (``inflight_snapshot``); False,
        changing nothing, when the worker is not that incarnation here."""
        session = self._fleet.get(routes.worker_id)
        if session is None or session.incarnation != routes.incarnation:
            return False
        restore_inflight(session, routes, self.awaited, self._clock(), self.max_inflight)
        return True

    def end_remote_routes(self, route_ids: Sequence[str]) -> EndedRoutes:
        """End routes another replica was told to end (not passed on again)."""
        return self.awaited.end(route_ids, self._clock())

    def expire_awaited(self) -> None:
        """Release awaited routes past their TTL (the reaper calls this)."""
        self.awaited.expire(self._clock())
