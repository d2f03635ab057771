"""Route ids, and the routes whose end the caller reports (``EndRoutes``).

Every route gets an id. A reference worker reports the routes it finished in its heartbeats, so
the coordinator counts a route as in-flight load only until then. An engine behind a bridge
cannot tell finished requests apart (its bridge settles every route at each heartbeat), so a
caller that sees the request end (a gateway) may ask for ``report_end``: a route to an external
worker is then held here, counted as that worker's load until the caller ends it by id, or
until ``ttl_s`` passes (a caller that died), and heartbeats do not settle it. Ending is
idempotent: an id already ended, expired, or never awaited counts as unknown and changes
nothing, so no route is settled twice.

Pure core: time comes from the caller. With replicas, the one that issues an id publishes it
(``Router.take_reservation`` holds it elsewhere) and an ``EndRoutes`` on any replica is passed
to all, so a caller may end a route through any replica.
"""

from __future__ import annotations

import itertools
import secrets
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from coordinator.core.fleet import RegisteredWorker

MAX_ROUTE_ID_LENGTH = 64
"""Longer ids are refused unread (ours are 20 characters or fewer)."""


@dataclass(frozen=True, slots=True)
class _Held:
    session: RegisteredWorker
    uncached_tokens: int
    copies: int
    deadline: float
    context_tokens: int


@dataclass(frozen=True, slots=True)
class EndedRoutes:
    ended: int
    unknown: int


class AwaitedRoutes:
    """Issues route ids; holds awaited routes, oldest first, at most ``capacity`` (past it the
    oldest is taken as ended)."""

    def __init__(self, *, ttl_s: float, capacity: int = 65_536) -> None:
        if ttl_s <= 0 or capacity < 1:
            raise ValueError(f"ttl_s must be > 0 and capacity >= 1, got {ttl_s}, {capacity}")
        self.ttl_s = ttl_s
        self._capacity = capacity
        # A random prefix per process: ids of a restarted coordinator never collide with the
        # ones its callers still hold.
        self._prefix = secrets.token_hex(4)
        self._counter = itertools.count(1)
        self._held: OrderedDict[str, _Held] = OrderedDict()
        self.expired = 0

    def __len__(self) -> int:
        return len(self._held)

    def new_id(self) -> str:
        return f"{self._prefix}-{next(self._counter):x}"

    def hold(self, session: RegisteredWorker, uncached_tokens: int, copies: int,
             now: float, route_id: str = "", context_tokens: int = 0) -> str:
        """Count ``copies`` routes of ``uncached_tokens`` (and ``context_tokens`` of prompt)
        each as ``session``'s load until ``end`` or the deadline; returns their id (a new one,
        unless ``route_id`` gives the id another replica issued; an id held already is not
        held twice)."""
        self.expire(now)
        if route_id in self._held:
            return route_id
        route_id = route_id or self.new_id()
        self._held[route_id] = _Held(session, uncached_tokens, copies, now + self.ttl_s,
                                     context_tokens)
        session.hold_awaited(uncached_tokens, copies, context_tokens)
        if len(self._held) > self._capacity:
            self._release(self._held.popitem(last=False)[1])
        return route_id

    def end(self, route_ids: Iterable[str], now: float) -> EndedRoutes:
        """End these routes (each id at most once; unknown ids change nothing)."""
        self.expire(now)
        ended = unknown = 0
        for route_id in route_ids:
            held = self._held.pop(route_id, None)
            if held is None:
                unknown += 1
            else:
                self._release(held)
                ended += 1
        return EndedRoutes(ended, unknown)

    def expire(self, now: float) -> None:
        """Release routes past their deadline (the TTL is one value, so insertion order is
        deadline order: this stops at the first one still due)."""
        while self._held:
            route_id, held = next(iter(self._held.items()))
            if held.deadline > now:
                return
            del self._held[route_id]
            self._release(held)
            self.expired += 1

    @staticmethod
    def _release(held: _Held) -> None:
        held.session.release_awaited(held.uncached_tokens, held.copies, held.context_tokens)
