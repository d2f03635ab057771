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
to all, so a caller may end a route through any replica. The end may reach a third replica
before the route does: every ended id is remembered for a while (``AwaitedRoutes``), and a route
held under a remembered id is settled at once instead of counting until its TTL. A replica
that joins later takes the others' held routes with the time each has left
(``held_for``/``restore``).
"""

from __future__ import annotations

import itertools
import secrets
from collections import OrderedDict
from collections.abc import Iterable, Mapping
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


@dataclass(frozen=True, slots=True)
class HeldRoute:
    """One held route as a replica shares it with one that joins later: its id, ``copies``
    routes of ``uncached_tokens`` to compute and ``context_tokens`` of prompt each, and the
    seconds left before its TTL releases it."""

    route_id: str
    uncached_tokens: int
    copies: int
    context_tokens: int
    expires_in_s: float

    def __post_init__(self) -> None:
        if not self.route_id or self.copies < 1 or min(self.uncached_tokens,
                                                        self.context_tokens) < 0:
            raise ValueError(f"a held route needs an id, copies >= 1 and tokens >= 0, got "
                             f"{self.route_id!r}, {self.copies}, {self.uncached_tokens}, "
                             f"{self.context_tokens}")


class AwaitedRoutes:
    """Issues route ids; holds awaited routes, oldest first, at most ``capacity`` (past it the
    oldest is taken as ended).

    Ended ids are remembered for ``ttl_s`` (a route's own lifetime), so that a route arriving
    after its end (a ``Routed`` overtaken by its ``RoutesEnded``, or a joining replica's
    snapshot taken before the end) is settled at once. Memory bound: at most ``capacity`` ids
    are remembered, the oldest forgotten first, and ids empty or longer than
    ``MAX_ROUTE_ID_LENGTH`` (never ours) are not remembered, so a flood of unknown ids costs
    at most ``capacity`` entries (~260 bytes each at 64 characters: 17 MB at the default
    65,536, measured) and pushes out older ends, whose late routes then count until their
    TTL, as before."""

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
        # Ended ids -> when to forget them; insertion order is that order (one TTL).
        self._ended: OrderedDict[str, float] = OrderedDict()
        self.expired = 0
        self.settled_on_arrival = 0  # routes held under an id already ended

    def __len__(self) -> int:
        return len(self._held)

    @property
    def ends_remembered(self) -> int:
        return len(self._ended)

    def worker_of(self, route_id: str) -> str | None:
        """The worker a held route went to (None: not held here)."""
        held = self._held.get(route_id)
        return held.session.worker_id if held is not None else None

    def new_id(self) -> str:
        return f"{self._prefix}-{next(self._counter):x}"

    def hold(self, session: RegisteredWorker, uncached_tokens: int, copies: int,
             now: float, route_id: str = "", context_tokens: int = 0) -> str:
        """Count ``copies`` routes of ``uncached_tokens`` (and ``context_tokens`` of prompt)
        each as ``session``'s load until ``end`` or the deadline; returns their id (a new one,
        unless ``route_id`` gives the id another replica issued; an id held already is not
        held twice, and an id ended already is not held at all)."""
        self.expire(now)
        if route_id in self._held:
            return route_id
        if route_id and route_id in self._ended:
            self.settled_on_arrival += 1
            return route_id
        route_id = route_id or self.new_id()
        self._put(route_id, _Held(session, uncached_tokens, copies, now + self.ttl_s,
                                  context_tokens))
        self._trim()
        return route_id

    def _put(self, route_id: str, held: _Held) -> None:
        self._held[route_id] = held
        held.session.hold_awaited(held.uncached_tokens, held.copies, held.context_tokens)

    def _trim(self) -> None:
        while len(self._held) > self._capacity:
            self._release(self._held.popitem(last=False)[1])

    def end(self, route_ids: Iterable[str], now: float) -> EndedRoutes:
        """End these routes (each id at most once; unknown ids change nothing). Every id is
        remembered, so that a route held under it later (it had not arrived yet) is settled
        at once."""
        self.expire(now)
        ended = unknown = 0
        for route_id in route_ids:
            held = self._held.pop(route_id, None)
            if held is None:
                unknown += 1
            else:
                self._release(held)
                ended += 1
            self._remember_end(route_id, now)
        return EndedRoutes(ended, unknown)

    def _remember_end(self, route_id: str, now: float) -> None:
        if not route_id or len(route_id) > MAX_ROUTE_ID_LENGTH:
            return
        self._ended.pop(route_id, None)  # re-inserted last: forget-at order stays
        self._ended[route_id] = now + self.ttl_s
        if len(self._ended) > self._capacity:
            self._ended.popitem(last=False)

    def expire(self, now: float) -> None:
        """Release routes past their deadline and forget ends past theirs (the TTL is one
        value, so insertion order is deadline order: each stops at the first one still due;
        ``restore`` keeps that order)."""
        while self._held:
            route_id, held = next(iter(self._held.items()))
            if held.deadline > now:
                break
            del self._held[route_id]
            self._release(held)
            self.expired += 1
        while self._ended and next(iter(self._ended.values())) <= now:
            self._ended.popitem(last=False)

    def held_for(self, sessions: Mapping[str, RegisteredWorker],
                 now: float) -> dict[str, list[HeldRoute]]:
        """The routes held for each of ``sessions`` (by worker id; an older incarnation's
        routes are not the session's), oldest first, with the time each has left."""
        self.expire(now)
        found: dict[str, list[HeldRoute]] = {}
        for route_id, held in self._held.items():
            worker_id = held.session.worker_id
            if sessions.get(worker_id) is held.session:
                found.setdefault(worker_id, []).append(HeldRoute(
                    route_id, held.uncached_tokens, held.copies, held.context_tokens,
                    held.deadline - now))
        return found

    def restore(self, session: RegisteredWorker, routes: Iterable[HeldRoute],
                now: float) -> int:
        """Hold ``routes`` (another replica's, ``held_for``) for ``session`` until their own
        deadlines (at most ``ttl_s`` from ``now``); an id held or ended here already is
        skipped. Returns how many were held."""
        self.expire(now)
        last = next(reversed(self._held.values())).deadline if self._held else now
        restored = 0
        in_order = True
        for route in routes:
            if route.route_id in self._held or route.route_id in self._ended:
                continue
            deadline = now + min(route.expires_in_s, self.ttl_s)
            if deadline <= now:
                continue
            in_order = in_order and deadline >= last
            last = max(last, deadline)
            self._put(route.route_id, _Held(session, route.uncached_tokens, route.copies,
                                            deadline, route.context_tokens))
            restored += 1
        if not in_order:  # rare (a bootstrap): sort once so that ``expire`` may stop early
            self._held = OrderedDict(sorted(self._held.items(),
                                            key=lambda item: item[1].deadline))
        self._trim()
        return restored

    @staticmethod
    def _release(held: _Held) -> None:
        held.session.release_awaited(held.uncached_tokens, held.copies, held.context_tokens)
